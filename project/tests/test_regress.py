"""regress on a small synthetic tree: real pytest runs, real JUnit XML, a real
baseline file. No vLLM needed: an "installed" fake vllm sits on PYTHONPATH,
and the tree holds a decoy vllm/ source package that must never be imported.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from workbench import regress, stack
from workbench.errors import WorkbenchError
from workbench.gitutil import git

TESTS = """
import os
from pathlib import Path

import pytest

import vllm


def test_ok():
    assert vllm.WHERE == "installed"


def test_now_fails():
    assert False


@pytest.mark.parametrize("x", [1, 2])
def test_param(x):
    assert x == 1


@pytest.fixture
def broken():
    raise RuntimeError("setup")


def test_setup_error(broken):
    pass


def test_skipped():
    pytest.skip("not here")


class TestGroup:
    def test_in_class(self):
        pass


def test_offline_hf_cache_and_repo_files():
    hub = Path(os.environ["HF_HOME"]) / "hub" / "models--facebook--opt-125m"
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert (hub / "refs" / "main").is_file()
    assert Path("examples/data.txt").read_text() == "from the tree"
"""
P = "tests/unit/test_sample.py"


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An sdist-like tree: tests/ (packages, as upstream's), examples/, vllm/."""
    root = tmp_path / "tree"
    (root / "tests" / "unit").mkdir(parents=True)
    (root / "tests" / "__init__.py").write_text("")
    (root / "tests" / "unit" / "__init__.py").write_text("")
    (root / P).write_text(TESTS)
    (root / "tests" / "unit" / "test_broken_import.py").write_text(
        "import no_such_module\n\ndef test_never():\n    pass\n"
    )
    (root / "examples").mkdir()
    (root / "examples" / "data.txt").write_text("from the tree")
    (root / "vllm").mkdir()
    (root / "vllm" / "__init__.py").write_text("raise ImportError('source tree')\n")
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("WHERE = 'installed'\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    return root


def run(tree: Path, selection: list[str]) -> regress.Run:
    junit = tree.parent / "junit.xml"
    return regress.run_tests(Path(sys.executable), tree, selection, junit=junit)


def test_outcomes_by_node_id(tree: Path) -> None:
    result = run(tree, ["tests"])
    assert result.installed is not None
    assert result.installed.file == tree.parent / "site" / "vllm" / "__init__.py"
    assert result.outcomes == {
        f"{P}::test_ok": "passed",
        f"{P}::test_now_fails": "failed",
        f"{P}::test_param[1]": "passed",
        f"{P}::test_param[2]": "failed",
        f"{P}::test_setup_error": "error",
        f"{P}::test_skipped": "skipped",
        f"{P}::TestGroup::test_in_class": "passed",
        f"{P}::test_offline_hf_cache_and_repo_files": "passed",
        "tests/unit/test_broken_import.py": "error",
    }
    durations = regress.file_durations(tree.parent / "junit.xml", tree)
    assert sorted((path, n) for path, _, n in durations) == [
        ("tests/unit/test_broken_import.py", 1),
        (P, 8),
    ]


def test_source_tree_on_the_path_is_refused(tree: Path, monkeypatch) -> None:
    (tree / "vllm" / "__init__.py").write_text("WHERE = 'source'\n")
    monkeypatch.setenv("PYTHONPATH", str(tree))
    with pytest.raises(WorkbenchError, match="source tree"):
        run(tree, [P])


def test_baseline_test_that_fails_is_a_regression(tree: Path, capsys) -> None:
    baseline = tree.parent / "baseline.txt"
    baseline.write_text(
        "# header\n"
        f"{P}::test_ok\n"
        f"{P}::test_now_fails\n"
        f"{P}::test_gone\n"
        "tests/other.py::test_outside_selection\n"
    )
    argv = ["--python", sys.executable, "--tests-from", str(tree)]
    status = regress.main([*argv, "--baseline", str(baseline), P])
    out = capsys.readouterr().out
    assert status == 1
    assert f"REGRESSION: {P}::test_now_fails (failed)" in out
    assert f"REGRESSION: {P}::test_gone (not run)" in out
    assert "test_outside_selection" not in out
    assert "3 tests pass that are not in the baseline" in out
    assert "regress: FAIL: 2 regressions" in out


@pytest.mark.parametrize("version", ["0.32.0+kvlc.cpu", "0.32.0"])
def test_a_test_the_stack_retires_is_not_a_regression(
    tree: Path, trial_root: Path, monkeypatch, capsys, version: str
) -> None:
    (tree.parent / "site" / "vllm" / "__init__.py").write_text(
        f"WHERE = 'installed'\n__version__ = {version!r}\n"
    )
    (trial_root / "patches" / "trial" / "retired-tests").write_text(
        f"# The trial entry changes what test_now_fails checks.\n{P}::test_now_fails\n"
        f"\n# Renamed.\n{P}::test_param\n"
    )
    monkeypatch.setattr(regress, "ROOT", trial_root)
    baseline = tree.parent / "baseline.txt"
    baseline.write_text(
        f"{P}::test_ok\n{P}::test_now_fails\n{P}::test_param[2]\n{P}::test_gone\n"
    )
    argv = ["--python", sys.executable, "--tests-from", str(tree)]
    status = regress.main([*argv, "--baseline", str(baseline), P])
    out = capsys.readouterr().out
    assert status == 1
    assert f"REGRESSION: {P}::test_gone (not run)" in out
    if version.endswith("+kvlc.cpu"):
        assert f"RETIRED: {P}::test_now_fails (failed) by trial" in out
        assert f"RETIRED: {P}::test_param[2] (failed) by trial" in out
        summary = "1 regressions against baseline.txt, 2 retired by the stack"
        assert f"regress: FAIL: {summary}" in out
    else:
        # The unpatched build is not the stack: its retirements do not apply.
        assert "RETIRED" not in out
        assert f"REGRESSION: {P}::test_now_fails (failed)" in out
        assert "regress: FAIL: 3 regressions against baseline.txt\n" in out


def test_pristine_failures_in_declared_edits_are_listed_per_entry(
    tree: Path, trial_root: Path, monkeypatch, capsys
) -> None:
    (tree.parent / "site" / "vllm" / "__init__.py").write_text(
        "WHERE = 'installed'\n__version__ = '0.32.0+kvlc.cpu'\n"
    )
    (trial_root / "patches" / "trial" / "edited-tests").write_text(
        f"# The trial entry changes what this file checks.\n{P}\n"
    )
    monkeypatch.setattr(regress, "ROOT", trial_root)
    # No --tests-from: upstream's pristine tests, here the fixture's tree.
    monkeypatch.setattr(regress.upstream, "pristine_tree", lambda: tree)
    baseline = tree.parent / "baseline.txt"
    baseline.write_text(
        f"{P}::test_ok\n{P}::test_now_fails\n{P}::test_param[2]\n"
        "tests/unit/test_broken_import.py::test_never\n"
    )
    argv = ["--python", sys.executable, "--baseline", str(baseline)]
    status = regress.main([*argv, P, "tests/unit/test_broken_import.py"])
    out = capsys.readouterr().out
    assert status == 1
    assert f"entry trial: 2 pristine tests fail, all in declared edits ({P})" in out
    assert f"EDITED: {P}::test_now_fails (failed) by trial" in out
    assert f"EDITED: {P}::test_param[2] (failed) by trial" in out
    assert "REGRESSION: tests/unit/test_broken_import.py::test_never (not run)" in out
    assert "REGRESSION: " + P not in out
    assert "1 regressions against baseline.txt" in out
    assert "2 in upstream tests the stack declares edited" in out


def test_retired_node_ids_cover_their_parametrizations_and_children() -> None:
    retired = stack.parse_retired(
        "e", f"# why\n{P}::test_x\ntests/unit/test_dir\n# other\n{P}::C::test_y[1]\n"
    )
    assert [(t.node.rsplit("/", 1)[-1], t.reason, t.line) for t in retired] == [
        ("test_sample.py::test_x", "why", 2),
        ("test_dir", "why", 3),
        ("test_sample.py::C::test_y[1]", "other", 5),
    ]
    x, directory, y = retired
    assert x.covers(f"{P}::test_x") and x.covers(f"{P}::test_x[True-1]")
    assert not x.covers(f"{P}::test_x_more")
    assert directory.covers("tests/unit/test_dir/test_a.py::test_a")
    assert not directory.covers("tests/unit/test_dir_more.py::test_a")
    assert y.names == ["C", "test_y"]
    assert y.covers(f"{P}::C::test_y[1]") and not y.covers(f"{P}::C::test_y[2]")
    result = regress.compare(
        {f"{P}::test_x[1]", f"{P}::test_z"}, {}, ["tests"], retired=[("e", x)]
    )
    assert result.regressions == [(f"{P}::test_z", "not run")]
    assert result.retired == [(f"{P}::test_x[1]", "not run", "e")]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (f"{P}::test_x\n", "line 1: .* has no reason"),
        (f"# why\n{P}::test_x\n\n{P}::test_y\n", "line 4: .* has no reason"),
        ("# why\nvllm/x.py\n", "line 2: 'vllm/x.py' is not a node id under tests/"),
        (f"# why\n{P}::test_x\n{P}::test_x\n", "line 3: .* is listed twice"),
    ],
)
def test_retired_tests_file_is_validated(text: str, error: str) -> None:
    with pytest.raises(WorkbenchError, match=f"patches/e/retired-tests {error}"):
        stack.parse_retired("e", text)


def test_record_then_compare_is_clean(tree: Path, capsys) -> None:
    baseline = tree.parent / "baseline.txt"
    argv = ["--python", sys.executable, "--tests-from", str(tree)]
    argv += ["--baseline", str(baseline), "tests"]
    assert regress.main([*argv, "--record"]) == 0
    assert regress.read_baseline(baseline) == {
        f"{P}::test_ok",
        f"{P}::test_param[1]",
        f"{P}::TestGroup::test_in_class",
        f"{P}::test_offline_hf_cache_and_repo_files",
    }
    header = [line for line in baseline.read_text().splitlines() if line[0] == "#"]
    assert "# Selection: tests" in header
    assert "# Command: ./wb regress --record --python '<python>' tests" in header
    # A command that records through regress (release-test) names itself.
    assert regress.main([*argv, "--record", "--made-by", "./wb x --record"]) == 0
    header = [line for line in baseline.read_text().splitlines() if line[0] == "#"]
    assert header[-1] == "# Command: ./wb x --record"
    # Extra pytest arguments pass through after --.
    assert regress.main([*argv, "--", "-k", "not now_fails"]) == 0
    assert "regress: PASS: 0 regressions" in capsys.readouterr().out
    # The release's own failures are counted apart from regressions, and the
    # last line is the verdict.
    summary = tree.parent / "summary.json"
    assert regress.main([*argv, "--summary-json", str(summary)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-4].startswith("regress: pytest outcomes: 4 passed, 2 failed")
    assert lines[-2] == (
        "regress: 4 of pytest's failures and errors are known: "
        "not in baseline.txt, they fail on the unpatched release too"
    )
    assert lines[-1] == "regress: PASS: 0 regressions against baseline.txt"
    assert json.loads(summary.read_text()) == {
        "passed": 4,
        "regressions": 0,
        "known_failures": 4,
        "retired": 0,
        "edited": 0,
        "skipped": 1,
    }


def test_failing_test_in_a_file_the_stack_adds_is_a_regression() -> None:
    outcomes = {
        "tests/unit/test_added.py::test_a": "passed",
        "tests/unit/test_added.py::test_b": "failed",
        "tests/unit/test_added.py::test_c": "skipped",
        "tests/unit/test_upstream.py::test_new_failing": "failed",
    }
    result = regress.compare(
        set(), outcomes, ["tests/unit"], must_pass=["tests/unit/test_added.py"]
    )
    assert result.regressions == [("tests/unit/test_added.py::test_b", "failed")]


def test_stack_test_files_are_the_added_and_changed_ones(trial_root: Path) -> None:
    added_test = "tests/v1/kv_connector/unit/test_trial.py"
    (trial_root / added_test).parent.mkdir(parents=True)
    (trial_root / added_test).write_text("def test_trial():\n    pass\n")
    with (trial_root / "patches" / "trial" / "owned-files").open("a") as owned:
        owned.write(f"{added_test}\n")
    patch = trial_root / "patches" / "trial" / "upstream.patch"
    changed_test = "tests/v1/core/test_scheduler.py"
    patch.write_text(
        patch.read_text()
        + f"diff --git a/{changed_test} b/{changed_test}\n"
        + f"--- a/{changed_test}\n+++ b/{changed_test}\n@@ -1 +1,2 @@\n x\n+y\n"
    )
    assert regress.stack_test_files(trial_root) == ([added_test], [changed_test])


def test_a_test_the_stack_adds_to_an_upstream_file_must_pass(tmp_path: Path) -> None:
    """A new test in an upstream file the stack changes is in no baseline;
    failing, it is the stack's regression, not a failure the release has
    too (found when such a test failed unnoticed)."""
    path = "tests/unit/test_upstream.py"
    (tmp_path / path).parent.mkdir(parents=True)
    release = "def test_old():\n    pass\n\nclass TestKept:\n    def test_m(self):\n        pass\n"
    (tmp_path / path).write_text(release)
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "release"]):
        git(tmp_path, *args)
    git(tmp_path, "update-ref", "refs/kvlc/base", "HEAD")
    (tmp_path / path).write_text(
        release.replace(
            "class TestKept:", "async def test_new():\n    pass\n\nclass TestKept:"
        )
        + "    def test_new_method(self):\n        pass\n"
    )
    added = regress.stack_added_tests(tmp_path, [path, "tests/unit/test_gone.py"])
    assert added == [f"{path}::TestKept::test_new_method", f"{path}::test_new"]
    outcomes = {
        f"{path}::test_old": "failed",  # fails on the release too: no baseline
        f"{path}::test_new[1]": "failed",
        f"{path}::TestKept::test_new_method": "error",
        f"{path}::TestKept::test_m": "passed",
    }
    result = regress.compare(set(), outcomes, ["tests/unit"], must_pass=added)
    assert result.regressions == [
        (f"{path}::TestKept::test_new_method", "error"),
        (f"{path}::test_new[1]", "failed"),
    ]


def test_a_tree_without_the_release_ref_is_refused(tmp_path: Path) -> None:
    git(tmp_path, "init", "-q")
    with pytest.raises(WorkbenchError, match="no refs/kvlc/base"):
        regress.stack_added_tests(tmp_path, ["tests/unit/test_upstream.py"])

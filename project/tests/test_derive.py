"""``wb derive``: the trial stack carried onto a synthetic newer release."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import REPO
from workbench import derive, export, release_test, stack, upstream
from workbench.errors import WorkbenchError
from workbench.gitutil import BASE_REF, git, git_text
from workbench.stack import RELEASE_DELTA

OUTPUT_PY = "vllm/v1/core/sched/output.py"
TRIAL_MODULE = "vllm/distributed/kv_transfer/kv_connector/v1/trial.py"
ENTRY_DOC = '"""Stats for the encoder inputs scheduled in one iteration."""'
UPSTREAM_DOC = '"""Stats for encoder inputs scheduled in one iteration."""'
ADA = "Ada Lovelace <ada@example.org>"


def _release(tmp_path: Path, pristine: Path, edit) -> Path:
    """A newer release holding the pinned release's output.py, edited."""
    tree = tmp_path / "vllm-next"
    (tree / OUTPUT_PY).parent.mkdir(parents=True)
    (tree / OUTPUT_PY).write_text(edit((pristine / OUTPUT_PY).read_text()))
    return tree


@pytest.fixture
def next_release(monkeypatch: pytest.MonkeyPatch):
    def use(tree: Path) -> None:
        monkeypatch.setattr(upstream, "next_pristine_tree", lambda: tree)

    return use


def _delta(root: Path) -> Path:
    return root / "patches" / "trial" / RELEASE_DELTA


def test_a_clean_pick_needs_no_delta(trial_root, pristine, tmp_path, next_release):
    release = _release(tmp_path, pristine, lambda t: "# moved\n" * 4 + t)
    next_release(release)
    dest = tmp_path / "derived"
    derive.derive(stack.load(trial_root), dest)
    base_tree = git_text(dest, "ls-tree", "-r", "--name-only", BASE_REF).split()
    assert base_tree == [OUTPUT_PY]
    text = (dest / OUTPUT_PY).read_text()
    assert text.startswith("# moved\n") and ENTRY_DOC in text
    assert (dest / TRIAL_MODULE).read_text() == (trial_root / TRIAL_MODULE).read_text()
    assert "Kvlc-Entry: trial" in git_text(dest, "log", "-1", "--format=%B")
    assert derive.refresh(stack.load(trial_root), dest) == []
    assert not _delta(trial_root).exists()


def test_a_conflict_is_resolved_in_the_tree_and_kept_as_the_delta(
    trial_root, pristine, tmp_path, next_release
):
    # Upstream rewrote the line the entry changes: git cannot pick the entry.
    rewritten = '"""Counts of encoder inputs scheduled in one iteration."""'
    release = _release(tmp_path, pristine, lambda t: t.replace(UPSTREAM_DOC, rewritten))
    next_release(release)
    dest = tmp_path / "derived"
    with pytest.raises(WorkbenchError, match="trial: conflicts, and no on-"):
        derive.derive(stack.load(trial_root), dest)
    # Built anyway, the entry's side taken, for a person to resolve there.
    assert ENTRY_DOC in (dest / OUTPUT_PY).read_text()
    resolved = '"""Counts of the encoder inputs scheduled in one iteration."""'
    target = dest / OUTPUT_PY
    target.write_text(target.read_text().replace(ENTRY_DOC, resolved))
    git(dest, "commit", "--quiet", "--amend", "--no-edit", "--all")
    with pytest.raises(WorkbenchError, match="refresh has not written back"):
        derive.derive(stack.load(trial_root), dest)

    assert derive.refresh(stack.load(trial_root), dest) == [
        f"wrote patches/trial/{RELEASE_DELTA}"
    ]
    delta = _delta(trial_root)
    assert f"+    {resolved}" in delta.read_text()
    # Its header says why; a refresh keeps it, and derive applies the delta.
    delta.write_text(
        "Description: upstream reworded the docstring\n\n" + delta.read_text()
    )
    assert derive.refresh(stack.load(trial_root), dest) == []
    assert delta.read_text().startswith("Description: upstream reworded")
    again = tmp_path / "again"
    derive.derive(stack.load(trial_root), again)
    assert (again / OUTPUT_PY).read_text() == target.read_text()

    out = tmp_path / "export"
    [patch] = export.export(stack.load(trial_root), out, signoff=ADA, next_release=True)
    assert f"+    {resolved}" in patch.read_text()
    assert "Signed-off-by: Ada Lovelace" in patch.read_text()


def test_a_delta_that_no_longer_applies_is_named(
    trial_root, pristine, tmp_path, next_release
):
    release = _release(tmp_path, pristine, lambda t: "# moved\n" * 4 + t)
    next_release(release)
    _delta(trial_root).write_text(
        f"diff --git a/{OUTPUT_PY} b/{OUTPUT_PY}\n"
        f"--- a/{OUTPUT_PY}\n+++ b/{OUTPUT_PY}\n"
        "@@ -1,1 +1,1 @@\n-not in the file\n+anything\n"
    )
    dest = tmp_path / "derived"
    with pytest.raises(WorkbenchError, match=r"trial: on-.*\.patch does not apply"):
        derive.derive(stack.load(trial_root), dest)
    # git's pick alone, to be fixed and refreshed.
    assert ENTRY_DOC in (dest / OUTPUT_PY).read_text()
    assert derive.refresh(stack.load(trial_root), dest) == [
        f"removed patches/trial/{RELEASE_DELTA}"
    ]
    shutil.rmtree(dest)
    derive.derive(stack.load(trial_root), dest)


def test_release_test_imports_both_model_runners_the_stack_changes():
    # On a pure-Python install the runners cannot run: the import check is
    # all that covers them there, so it must include them.
    modules = release_test.changed_modules(REPO)
    assert "vllm.v1.worker.gpu_model_runner" in modules
    assert "vllm.v1.worker.gpu.kv_connector" in modules
    assert "vllm.v1.core.sched.scheduler" in modules

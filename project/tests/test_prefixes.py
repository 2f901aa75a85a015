"""The per-prefix check, with the build and pytest replaced at their boundary."""

from __future__ import annotations

from pathlib import Path

import pytest
from workbench import prefixes, stack
from workbench.errors import WorkbenchError
from workbench.gitutil import git

MESSAGE = "T\n\nbody\n"


def _diff(path: str) -> str:
    return (
        f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n"
        "@@ -1 +1 @@\n-a = 1\n+a = 2\n"
    )


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


@pytest.fixture
def two_entries(tmp_path: Path) -> stack.Stack:
    root = tmp_path / "root"
    _write(
        root,
        {
            "patches/series": "e1\ne2\n",
            "patches/e1/message.md": MESSAGE,
            "patches/e1/upstream.patch": _diff("vllm/foo.py"),
            "patches/e1/owned-files": "tests/v1/foo/test_e1.py\n",
            "tests/v1/foo/test_e1.py": "",
            "patches/e2/message.md": MESSAGE,
            "patches/e2/upstream.patch": _diff("vllm/pkg/bar.py")
            + _diff("tests/v1/foo/test_bar.py"),
            "patches/e2/owned-files": "tests/v1/foo/test_e2.py\n",
            "patches/e2/retired-tests": "# gone\ntests/v1/foo/test_bar.py::test_old\n",
            "tests/v1/foo/test_e2.py": "",
        },
    )
    return stack.load(root)


TREE = {
    "tests/v1/foo/test_uses_foo.py": "from vllm.foo import a\n",
    "tests/v1/foo/test_uses_bar.py": "from vllm.pkg import bar\n",
    "tests/v1/foo/test_bar.py": "import vllm\n",
    "tests/v1/foo/test_other.py": "import os\n",
    "tests/v1/foo/test_e1.py": "import vllm.foo\n",
    "tests/v1/foo/test_e2.py": "import vllm.pkg.bar\n",
}
SCOPE = ("tests/v1/foo",)
BASELINE = {
    "tests/v1/foo/test_uses_foo.py::test_a",
    "tests/v1/foo/test_uses_bar.py::test_b",
    "tests/v1/foo/test_bar.py::test_old",
    "tests/v1/foo/test_bar.py::test_kept",
}


@pytest.fixture
def fake_materialize(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    made: list[list[str]] = []

    def materialize(prefix: stack.Stack, tree: Path, *, force: bool) -> str:
        assert force
        made.append([e.name for e in prefix.entries])
        _write(tree, TREE)
        # The release is the tree itself: no upstream test file gains a test.
        for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "r"]):
            git(tree, *args)
        git(tree, "update-ref", "refs/kvlc/base", "HEAD")
        return "head"

    monkeypatch.setattr(prefixes, "materialize", materialize)
    return made


def test_plan_takes_own_tests_and_upstream_tests_of_touched_files(
    two_entries: stack.Stack, tmp_path: Path
):
    _write(tmp_path / "tree", TREE)
    first = prefixes.plan(two_entries, 1, tmp_path / "tree", SCOPE)
    assert first.own_tests == ["tests/v1/foo/test_e1.py"]
    assert first.upstream_tests == ["tests/v1/foo/test_uses_foo.py"]
    second = prefixes.plan(two_entries, 2, tmp_path / "tree", SCOPE)
    assert second.label == "02-e2"
    assert second.own_tests == ["tests/v1/foo/test_e2.py"]
    assert second.upstream_tests == [
        "tests/v1/foo/test_bar.py",
        "tests/v1/foo/test_uses_bar.py",
    ]


def test_each_prefix_is_built_and_tested_and_reported_per_entry(
    two_entries: stack.Stack, fake_materialize: list[list[str]], tmp_path: Path
):
    built: list[list[str]] = []

    def builder(prefix: stack.Stack, where: Path) -> Path:
        built.append([e.name for e in prefix.entries])
        assert (
            where
            == tmp_path / "out" / "build" / "prefix" / f"0{len(built)}-e{len(built)}"
        )
        return where / "venv" / "bin" / "python"

    def runner(python: Path, tree: Path, selection: list[str], junit: Path):
        if "tests/v1/foo/test_e1.py" in selection:
            return {
                "tests/v1/foo/test_e1.py::test_new": "passed",
                "tests/v1/foo/test_uses_foo.py::test_a": "passed",
            }
        return {
            "tests/v1/foo/test_e2.py::test_new": "failed",
            "tests/v1/foo/test_uses_bar.py::test_b": "passed",
            "tests/v1/foo/test_bar.py::test_kept": "error",
        }

    results = prefixes.check_prefixes(
        two_entries,
        tmp_path / "out",
        scope=SCOPE,
        builder=builder,
        runner=runner,
        baseline=BASELINE,
    )
    assert built == fake_materialize == [["e1"], ["e1", "e2"]]
    first, second = results
    assert first.ok and first.line().startswith("entry 1 e1: ok (1 own test files")
    assert not second.ok
    assert second.regressions == [
        ("tests/v1/foo/test_bar.py::test_kept", "error"),
        ("tests/v1/foo/test_e2.py::test_new", "failed"),
    ]
    assert second.retired == 1
    assert second.line().startswith("entry 2 e2: 2 regressions")


def test_a_prefix_that_does_not_build_is_reported_and_the_rest_still_run(
    two_entries: stack.Stack, fake_materialize: list[list[str]], tmp_path: Path
):
    def builder(prefix: stack.Stack, where: Path) -> Path:
        if len(prefix.entries) == 1:
            raise WorkbenchError("entry e1 does not apply to the CPU wheel:\n...")
        return where / "python"

    results = prefixes.check_prefixes(
        two_entries,
        tmp_path,
        scope=SCOPE,
        builder=builder,
        runner=lambda *args: {"tests/v1/foo/test_e2.py::t": "passed"},
        baseline=set(),
    )
    assert results[0].line() == (
        "entry 1 e1: FAILED: entry e1 does not apply to the CPU wheel:"
    )
    assert results[1].ok


def test_only_named_prefixes_run_and_unknown_names_are_refused(
    two_entries: stack.Stack, fake_materialize: list[list[str]], tmp_path: Path
):
    results = prefixes.check_prefixes(
        two_entries,
        tmp_path,
        only=["e2"],
        scope=SCOPE,
        builder=lambda prefix, where: where / "python",
        runner=lambda *args: {},
        baseline=set(),
    )
    assert [r.plan.entry for r in results] == ["e2"]
    with pytest.raises(WorkbenchError, match="no entry e9 in patches/series"):
        prefixes.check_prefixes(
            two_entries,
            tmp_path,
            only=["e9"],
            builder=lambda prefix, where: where / "python",
            baseline=set(),
        )


def test_a_failing_test_an_entry_adds_to_an_upstream_file_is_a_regression(
    two_entries: stack.Stack, tmp_path: Path
):
    """No baseline holds a test the entry adds to test_bar.py; its failure is
    the entry's, as in ``wb regress``."""

    def make_tree(prefix: stack.Stack, tree: Path) -> None:
        _write(tree, TREE)
        for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "r"]):
            git(tree, *args)
        git(tree, "update-ref", "refs/kvlc/base", "HEAD")
        with (tree / "tests/v1/foo/test_bar.py").open("a") as bar:
            bar.write("\ndef test_added():\n    pass\n")

    (result,) = prefixes.check_prefixes(
        two_entries,
        tmp_path / "out",
        only=["e2"],
        scope=SCOPE,
        builder=lambda prefix, where: where / "python",
        runner=lambda *args: {
            "tests/v1/foo/test_e2.py::test_new": "passed",
            "tests/v1/foo/test_uses_bar.py::test_b": "passed",
            "tests/v1/foo/test_bar.py::test_kept": "passed",
            "tests/v1/foo/test_bar.py::test_added": "failed",
        },
        baseline=BASELINE,
        make_tree=make_tree,
    )
    assert result.regressions == [("tests/v1/foo/test_bar.py::test_added", "failed")]

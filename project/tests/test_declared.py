"""What an entry declares: the upstream tests it edits, and its PR text."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from workbench import edited, prtext, stack
from workbench.errors import WorkbenchError

TEMPLATE = """<!-- markdownlint-disable -->

## Overview

<!-- Summarize -->

## Claims

## Validation

## Details

---
<details>
- [ ] AI assistance was used during the creation of this PR.
</details>
"""

GOOD_MESSAGE = """[KVConnector] Do a thing

## Overview

Does the thing, because of vllm-project/vllm#12345.

## Claims

- the thing

## Validation

```
pytest tests/v1/kv_connector/unit/test_thing.py
```

## Details

Why. AI assistance was used (Claude); the submitter reviewed every line.
Signed-off-by as the DCO asks.
"""


def _diff(path: str) -> str:
    return (
        f"diff --git a/{path} b/{path}\n"
        f"--- a/{path}\n+++ b/{path}\n"
        "@@ -1 +1 @@\n-a = 1\n+a = 2\n"
    )


def _root(tmp_path: Path, edits: str | None) -> Path:
    """A one-entry stack editing an upstream test and a helper, adding a test."""
    root = tmp_path / "root"
    entry = root / "patches" / "e1"
    entry.mkdir(parents=True)
    (root / "patches" / "series").write_text("e1\n")
    (entry / "message.md").write_text(GOOD_MESSAGE)
    (entry / "upstream.patch").write_text(
        _diff("tests/v1/foo/test_a.py")
        + _diff("tests/v1/foo/utils.py")
        + _diff("vllm/foo.py")
    )
    (entry / "owned-files").write_text("tests/v1/foo/test_new.py\n")
    (root / "tests" / "v1" / "foo").mkdir(parents=True)
    (root / "tests" / "v1" / "foo" / "test_new.py").write_text("")
    if edits is not None:
        (entry / edited.EDITED).write_text(edits)
    return root


FULL = "# a reason\ntests/v1/foo/test_a.py\n\n# the mocks\ntests/v1/foo/utils.py\n"


def test_edited_tests_must_match_the_diff(tmp_path: Path):
    assert edited.edited_problems(stack.load(_root(tmp_path / "a", FULL))) == []

    missing = edited.edited_problems(stack.load(_root(tmp_path / "b", None)))
    assert len(missing) == 2
    assert "edits upstream test file tests/v1/foo/utils.py" in missing[1]
    assert "patches/e1/edited-tests does not declare it" in missing[1]

    extra = FULL + "\n# not edited\ntests/v1/foo/test_b.py\n"
    problems = edited.edited_problems(stack.load(_root(tmp_path / "c", extra)))
    assert problems == [
        "patches/e1/edited-tests line 8: entry e1 does not edit "
        "tests/v1/foo/test_b.py; drop the line"
    ]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("tests/v1/foo/test_a.py\n", "has no reason"),
        ("# r\ntests/v1/foo/test_a.py::test_x\n", "is not a file under tests/"),
        ("# r\nvllm/foo.py\n", "is not a file under tests/"),
        ("# r\ntests/a.py\ntests/a.py\n", "listed twice"),
    ],
)
def test_edited_tests_parse_errors_name_the_line(text: str, error: str):
    with pytest.raises(WorkbenchError, match=error):
        edited.parse_edited("e1", text)


def test_pristine_failures_are_declared_through_test_imports(tmp_path: Path):
    root = _root(tmp_path, FULL)
    tree = tmp_path / "pristine"
    foo = tree / "tests" / "v1" / "foo"
    foo.mkdir(parents=True)
    (foo / "__init__.py").write_text("")
    (foo / "utils.py").write_text("a = 1\n")
    (foo / "test_a.py").write_text("def test_x(): pass\n")
    (foo / "test_uses_mocks.py").write_text("from .utils import a\n")
    (foo / "test_via_helper.py").write_text("from tests.v1.foo.helper import b\n")
    (foo / "helper.py").write_text("import tests.v1.foo.utils\nb = 1\n")
    (foo / "test_other.py").write_text("import os\n")
    failures = [
        ("tests/v1/foo/test_a.py::test_x", "failed"),
        ("tests/v1/foo/test_uses_mocks.py::test_y[1]", "failed"),
        ("tests/v1/foo/test_via_helper.py::TestC::test_z", "error"),
        ("tests/v1/foo/test_other.py::test_w", "failed"),
    ]
    explained, rest = edited.split_declared(failures, tree, stack.load(root))
    assert explained == [
        ("tests/v1/foo/test_a.py::test_x", "failed", "e1"),
        ("tests/v1/foo/test_uses_mocks.py::test_y[1]", "failed", "e1"),
        ("tests/v1/foo/test_via_helper.py::TestC::test_z", "error", "e1"),
    ]
    assert rest == [("tests/v1/foo/test_other.py::test_w", "failed")]
    (line,) = edited.per_entry_lines(explained, stack.load(root))
    assert line.startswith("entry e1: 3 pristine tests fail")


def _entry(message: str) -> stack.Entry:
    return stack.Entry("e1", message, "", ())


def test_pr_text_follows_the_release_template(tmp_path: Path):
    (tmp_path / ".github").mkdir()
    (tmp_path / prtext.TEMPLATE).write_text(TEMPLATE)
    headings = prtext.template_headings(tmp_path)
    assert headings == ["Overview", "Claims", "Validation", "Details"]
    assert prtext.message_problems(_entry(GOOD_MESSAGE), headings) == []

    old_layout = "T\n\n## Purpose\n\nx\n\n## Test Plan\n\ny AI assistance\n"
    (problem,) = prtext.message_problems(_entry(old_layout), headings)
    assert "sections are ['Purpose', 'Test Plan']" in problem

    swapped = GOOD_MESSAGE.replace("## Claims", "## Tmp").replace(
        "## Validation", "## Claims"
    )
    assert prtext.message_problems(_entry(swapped), headings)
    silent = GOOD_MESSAGE.replace("AI assistance was used (Claude)", "We")
    (problem,) = prtext.message_problems(_entry(silent), headings)
    assert "AI assistance" in problem


@pytest.mark.parametrize(
    "line",
    [
        "    ./wb regress --python .venv/bin/python",
        "see project/docs/benchmarks.md",
        "the table in `patches/e1/retired-tests`",
        "run pytest in build/vllm",
        "wb check passes",
    ],
)
def test_pr_text_names_no_project_only_path(line: str):
    message = GOOD_MESSAGE.replace("Why.", f"Why.\n{line}\n")
    problems = prtext.message_problems(
        _entry(message), prtext.template_headings_of(TEMPLATE)
    )
    assert len(problems) == 1 and "which a vLLM checkout does not have" in problems[0]


def test_pr_text_may_link_upstream():
    message = GOOD_MESSAGE.replace(
        "Why.", "See https://github.com/vllm-project/vllm/pull/1 and docs/design/x.md."
    )
    assert (
        prtext.message_problems(_entry(message), prtext.template_headings_of(TEMPLATE))
        == []
    )


def _padded(words: int) -> str:
    """GOOD_MESSAGE padded inside a code block to exactly ``words`` words."""
    padding = words - len(GOOD_MESSAGE.split())
    return GOOD_MESSAGE.replace("```\n", "```\n" + "x " * padding + "\n", 1)


def test_pr_text_has_at_most_400_words(tmp_path: Path):
    headings = prtext.template_headings_of(TEMPLATE)
    assert prtext.message_problems(_entry(_padded(400)), headings) == []
    (problem,) = prtext.message_problems(_entry(_padded(401)), headings)
    assert "401 words (wc -w), over the 400" in problem
    path = tmp_path / "message.md"
    path.write_text(_padded(401))
    wc = subprocess.run(["wc", "-w", str(path)], capture_output=True, text=True)
    assert int(wc.stdout.split()[0]) == prtext.word_count(_padded(401)) == 401


def test_the_pristine_template_is_found(pristine: Path):
    assert prtext.template_headings(pristine)[0] == "Overview"

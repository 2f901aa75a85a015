"""Edited tests: the upstream test files an entry changes, each with its reason.

``patches/<entry>/edited-tests`` lists every file under ``tests/`` that the
entry's ``upstream.patch`` changes and that no entry of the stack adds (so:
upstream's own test files and helpers). Editing a test that asserts on
internals the entry replaces is normal in a PR, but a reviewer must see it: the
``#`` lines above a block of paths are the reason, as in ``retired-tests``::

    # The scheduler's block pool is reached through the SchedulerContext now.
    tests/v1/kv_connector/unit/test_mooncake_store_scheduler.py

``./wb check`` requires the list to match the entry's diff exactly. Upstream's
pristine tests run against a stack build then fail where the entry changed
what they assert on; ``wb regress`` reports each such failure with the entry
that declared the edit, and keeps every other one a regression.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from workbench.stack import Stack, parse_reasoned, split_patch

EDITED = "edited-tests"


@dataclass(frozen=True)
class EditedTest:
    """An upstream file under tests/ an entry changes, and why."""

    path: str
    reason: str
    line: int


def _bad_edited_line(line: str) -> str | None:
    if (
        not line.startswith("tests/")
        or "::" in line
        or ".." in Path(line).parts
        or any(c.isspace() for c in line)
    ):
        return (
            f"{line!r} is not a file under tests/; "
            "write one path a line, e.g. tests/v1/core/test_scheduler.py "
            "(a test the entry removes goes in retired-tests as well)"
        )
    return None


def parse_edited(name: str, text: str) -> tuple[EditedTest, ...]:
    """The paths of an entry's ``edited-tests``, each with its ``#`` reason."""
    where = f"patches/{name}/{EDITED}"
    return tuple(
        EditedTest(path, reason, lineno)
        for path, reason, lineno in parse_reasoned(
            where, text, "edits", _bad_edited_line
        )
    )


def declared(stack: Stack) -> dict[str, tuple[EditedTest, ...]]:
    """Entry name -> its declared edited tests (empty without the file)."""
    found = {}
    for entry in stack.entries:
        path = stack.patches_dir / entry.name / EDITED
        text = path.read_text() if path.is_file() else ""
        found[entry.name] = parse_edited(entry.name, text)
    return found


def edited_in_diff(stack: Stack) -> dict[str, list[str]]:
    """Entry name -> the files under tests/ its patch changes that no entry adds."""
    added = set(stack.owner_of())
    return {
        entry.name: sorted(
            {
                s.path
                for s in split_patch(entry.patch)
                if s.path.startswith("tests/") and s.path not in added
            }
        )
        for entry in stack.entries
    }


def edited_problems(stack: Stack) -> list[str]:
    """Where an entry's ``edited-tests`` and its diff disagree."""
    problems = []
    actual = edited_in_diff(stack)
    for name, listed in declared(stack).items():
        where = f"patches/{name}/{EDITED}"
        paths = {t.path for t in listed}
        for path in actual[name]:
            if path not in paths:
                problems.append(
                    f"entry {name} edits upstream test file {path} but {where} "
                    "does not declare it; add it under a '# why' line"
                )
        for test in listed:
            if test.path not in actual[name]:
                problems.append(
                    f"{where} line {test.line}: entry {name} does not edit "
                    f"{test.path}; drop the line"
                )
    return problems


def _module_path(module: str, tree: Path) -> str | None:
    """The tests/ file a dotted module name under ``tests`` resolves to."""
    rel = module.replace(".", "/")
    for candidate in (f"{rel}.py", f"{rel}/__init__.py"):
        if (tree / candidate).is_file():
            return candidate
    return None


def imported_test_modules(path: str, tree: Path) -> set[str]:
    """The files under tests/ that test file ``path`` of ``tree`` imports."""
    try:
        body = ast.parse((tree / path).read_text())
    except (OSError, SyntaxError):
        return set()
    package = Path(path).parent.as_posix().replace("/", ".")
    found = set()
    for node in ast.walk(body):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            modules = [base] + [f"{base}.{a.name}" for a in node.names]
        for module in modules:
            if module.startswith("tests.") and (hit := _module_path(module, tree)):
                found.add(hit)
    return found


def _conftests(path: str, tree: Path) -> set[str]:
    """The conftest.py files pytest loads for ``path``."""
    found = set()
    for parent in Path(path).parents:
        candidate = (parent / "conftest.py").as_posix()
        if candidate.startswith("tests/") and (tree / candidate).is_file():
            found.add(candidate)
    return found


def declaring_entry(
    node_id: str,
    tree: Path,
    edits: Mapping[str, Sequence[EditedTest]],
    _seen: dict[str, set[str]] | None = None,
) -> str | None:
    """The entry whose declared edit explains a failure of pristine ``node_id``.

    That is an entry that edits the test's own file or a tests/ module it
    imports (directly or through other tests/ modules), such as a mock
    connector in a shared helper, or a conftest.py pytest loads for it. The
    last such entry of the stack wins.
    """
    path = node_id.split("::", 1)[0]
    seen = _seen if _seen is not None else {}
    reach = {path}
    frontier = [path]
    while frontier:
        current = frontier.pop()
        if current not in seen:
            seen[current] = imported_test_modules(current, tree) | _conftests(
                current, tree
            )
        for imported in seen[current] - reach:
            reach.add(imported)
            frontier.append(imported)
    owner = None
    for entry, tests in edits.items():
        if any(t.path in reach for t in tests):
            owner = entry
    return owner


def split_declared(
    failures: Sequence[tuple[str, str]], tree: Path, stack: Stack
) -> tuple[list[tuple[str, str, str]], list[tuple[str, str]]]:
    """Split pristine tests that fail on a stack build into those an entry's
    declared edit explains, as (node id, outcome, entry), and the rest.

    ``tree`` holds the pristine tests/ the run used.
    """
    edits = declared(stack)
    seen: dict[str, set[str]] = {}
    explained, rest = [], []
    for node, outcome in failures:
        entry = declaring_entry(node, tree, edits, seen)
        if entry is None:
            rest.append((node, outcome))
        else:
            explained.append((node, outcome, entry))
    return explained, rest


def per_entry_lines(
    explained: Sequence[tuple[str, str, str]], stack: Stack
) -> list[str]:
    """One line per entry: how many pristine tests fail in what it declares."""
    lines = []
    for entry in stack.entries:
        nodes = [n for n, _, e in explained if e == entry.name]
        files = sorted({n.split("::", 1)[0] for n in nodes})
        lines.append(
            f"entry {entry.name}: {len(nodes)} pristine tests fail, all in "
            f"declared edits ({', '.join(files) or 'none'})"
        )
    return lines

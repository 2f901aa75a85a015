"""The stack on disk: ``patches/series``, one directory per entry, added files.

Layout (one entry per future upstream PR)::

    patches/series                  quilt grammar: entry names in order, '#' comments
    patches/<entry>/message.md      the PR: title, blank line, body (commit message)
    patches/<entry>/upstream.patch  changes to files existing before the entry (-p1)
    patches/<entry>/owned-files     the files the entry adds, one path a line
    patches/<entry>/retired-tests   upstream tests the entry removes or renames, and why
    patches/<entry>/on-<release>.patch  the entry on the newest release (derive.py)
    vllm/ tests/ docs/ <path>       each added file's content, at its upstream path

Files an entry adds are stored whole at their upstream path and owned by that
entry alone; a later entry that changes one carries the change in its own
``upstream.patch``.

``retired-tests`` lists upstream tests the entry deliberately removes, renames
or rewrites under another name (its behaviour change makes them wrong), so
``wb regress`` does not count them as regressions. One node id, or a prefix of
node ids (a file, a class, a test function for all its parametrizations), a
line; the ``#`` lines above a block of ids are its reason, which a PR
description can quote as it is::

    # With the explicit lifecycle a lookup is never pending across a reset.
    tests/v1/simple_kv_offload/test_scheduler.py::test_reset_releases_pending_cpu_hits
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from workbench.errors import WorkbenchError
from workbench.upstream import NEXT_RELEASE

ADDED_FILE_ROOTS = ("vllm", "tests", "docs")
MESSAGE = "message.md"
PATCH = "upstream.patch"
OWNED = "owned-files"
RETIRED = "retired-tests"
# The entry's delta from git's pick of it to its form on the newest release.
RELEASE_DELTA = f"on-{NEXT_RELEASE}.patch"

_ENTRY_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
# git am ends the commit message at these lines; a PR body must not hold them.
_MESSAGE_BREAKERS = re.compile(r"^(---|diff -|Index: )", re.MULTILINE)


@dataclass(frozen=True)
class RetiredTest:
    """An upstream node id, or node-id prefix, an entry retires, and why."""

    node: str
    reason: str
    line: int

    @property
    def path(self) -> str:
        return self.node.split("::", 1)[0]

    @property
    def names(self) -> list[str]:
        """The classes and function the node id names, without parameters."""
        names = self.node.split("::")[1:]
        if names:
            names[-1] = names[-1].split("[", 1)[0]
        return names

    def covers(self, node_id: str) -> bool:
        """Whether ``node_id`` is this test, one of its parametrizations, or
        lies under this file, directory or class."""
        return node_id == self.node or node_id.startswith(
            tuple(self.node + sep for sep in ("[", "::", "/"))
        )


@dataclass(frozen=True)
class Entry:
    name: str
    message: str
    patch: str
    owned: tuple[str, ...]
    retired: tuple[RetiredTest, ...] = ()

    @property
    def title(self) -> str:
        return self.message.split("\n", 1)[0]


@dataclass(frozen=True)
class Stack:
    root: Path
    entries: tuple[Entry, ...]

    @property
    def patches_dir(self) -> Path:
        return self.root / "patches"

    def owner_of(self) -> dict[str, str]:
        """Map each added file to the entry that owns it."""
        return {path: e.name for e in self.entries for path in e.owned}

    def added_file(self, path: str) -> bytes:
        return (self.root / path).read_bytes()


def parse_series(text: str) -> list[str]:
    """Entry names in order; '#' comments and blank lines are ignored."""
    names = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name = line.split()[0]
        if not _ENTRY_NAME.match(name):
            raise WorkbenchError(
                f"patches/series line {lineno}: {name!r} is not an entry name "
                "(lowercase letters, digits, '.', '_' and '-')"
            )
        if name in names:
            raise WorkbenchError(f"patches/series lists {name!r} twice")
        names.append(name)
    return names


def validate_message(name: str, message: str) -> None:
    title, _, body = message.partition("\n")
    if not title.strip():
        raise WorkbenchError(f"entry {name}: {MESSAGE} has no title line")
    if not body.startswith("\n") or not body.strip():
        raise WorkbenchError(
            f"entry {name}: {MESSAGE} needs a blank line after the title and a "
            "body (what, why, tests run, AI assistance)"
        )
    if m := _MESSAGE_BREAKERS.search(message):
        raise WorkbenchError(
            f"entry {name}: {MESSAGE} has a line starting with {m.group(1)!r}, "
            "which git am takes as the end of the message; indent it"
        )


def validate_owned_path(name: str, path: str) -> None:
    parts = Path(path).parts
    if (
        not parts
        or parts[0] not in ADDED_FILE_ROOTS
        or ".." in parts
        or Path(path).is_absolute()
    ):
        raise WorkbenchError(
            f"entry {name}: owned file {path!r} must be a relative path under "
            f"{', '.join(r + '/' for r in ADDED_FILE_ROOTS)}"
        )


def parse_reasoned(
    where: str, text: str, kind: str, bad_line: Callable[[str], str | None]
) -> list[tuple[str, str, int]]:
    """The lines of a ``retired-tests``-style file: (line, reason, line number).

    A block of ``#`` lines gives the reason for the lines right below it; a
    blank line or the next ``#`` block ends it. ``bad_line`` returns an error
    message for a line it refuses; ``kind`` names what the file's lines are
    about ("retires", "edits") in the missing-reason error.
    """
    items: list[tuple[str, str, int]] = []
    reason: list[str] = []
    after_items = False
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            reason, after_items = [], False
            continue
        if line.startswith("#"):
            if after_items:
                reason, after_items = [], False
            reason.append(line[1:].strip())
            continue
        problem = bad_line(line)
        if problem:
            raise WorkbenchError(f"{where} line {lineno}: {problem}")
        why = " ".join(reason).strip()
        if not why:
            raise WorkbenchError(
                f"{where} line {lineno}: {line} has no reason; put '# why the "
                f"entry {kind} it' lines right above it"
            )
        if any(item == line for item, _, _ in items):
            raise WorkbenchError(f"{where} line {lineno}: {line} is listed twice")
        items.append((line, why, lineno))
        after_items = True
    return items


def _bad_retired_line(line: str) -> str | None:
    path = line.split("::", 1)[0]
    if (
        not path.startswith("tests/")
        or ".." in Path(path).parts
        or any(c.isspace() for c in line)
    ):
        return (
            f"{line!r} is not a node id under tests/; "
            "write one node id or node-id prefix a line, e.g. "
            "tests/v1/core/test_scheduler.py::test_name"
        )
    return None


def parse_retired(name: str, text: str) -> tuple[RetiredTest, ...]:
    """The node ids of an entry's ``retired-tests``, each with its reason."""
    where = f"patches/{name}/{RETIRED}"
    return tuple(
        RetiredTest(node, reason, lineno)
        for node, reason, lineno in parse_reasoned(
            where, text, "retires", _bad_retired_line
        )
    )


def load(root: Path) -> Stack:
    """Read and validate the stack under ``root`` (the repository root)."""
    patches = root / "patches"
    series = patches / "series"
    if not series.is_file():
        raise WorkbenchError(f"{series} is missing; create it (it may be empty)")
    entries = []
    for name in parse_series(series.read_text()):
        entry_dir = patches / name
        message_file = entry_dir / MESSAGE
        if not message_file.is_file():
            raise WorkbenchError(
                f"entry {name} is listed in patches/series but "
                f"patches/{name}/{MESSAGE} does not exist"
            )
        message = message_file.read_text()
        validate_message(name, message)
        patch_file = entry_dir / PATCH
        patch = patch_file.read_text() if patch_file.exists() else ""
        owned_file = entry_dir / OWNED
        owned = (
            tuple(line for line in owned_file.read_text().splitlines() if line)
            if owned_file.exists()
            else ()
        )
        for path in owned:
            validate_owned_path(name, path)
            if not (root / path).is_file():
                raise WorkbenchError(
                    f"entry {name} owns {path}, but that file does not exist"
                )
        if not patch and not owned:
            raise WorkbenchError(
                f"entry {name} changes nothing: no {PATCH}, no {OWNED}"
            )
        retired_file = entry_dir / RETIRED
        retired = (
            parse_retired(name, retired_file.read_text())
            if retired_file.exists()
            else ()
        )
        entries.append(Entry(name, message, patch, owned, retired))
    stack = Stack(root, tuple(entries))
    _check_single_owner(stack)
    return stack


def _check_single_owner(stack: Stack) -> None:
    seen: dict[str, str] = {}
    for entry in stack.entries:
        for path in entry.owned:
            if path in seen:
                raise WorkbenchError(
                    f"{path} is owned by both {seen[path]} and {entry.name}; "
                    f"remove it from one entry's {OWNED}"
                )
            seen[path] = entry.name


def unowned_added_files(stack: Stack) -> list[str]:
    """Files under vllm/, tests/, docs/ at the repository root that no entry owns."""
    owned = stack.owner_of()
    found = []
    for top in ADDED_FILE_ROOTS:
        base = stack.root / top
        if not base.exists():
            continue
        for path in base.rglob("*"):
            if path.is_dir() or "__pycache__" in path.parts:
                continue
            rel = path.relative_to(stack.root).as_posix()
            if rel not in owned:
                found.append(rel)
    return sorted(found)


def patch_files(patch: str) -> list[str]:
    """The -p1 paths a unified diff touches, in order."""
    return [section.path for section in split_patch(patch)]


@dataclass(frozen=True)
class FileSection:
    path: str
    text: str

    def hunk(self, number: int) -> str:
        """The text of hunk ``number`` (1-based) of this file section."""
        hunks = re.split(r"(?m)^(?=@@ )", self.text)[1:]
        return hunks[number - 1] if 0 < number <= len(hunks) else ""


_DIFF_HEADER = re.compile(r"(?m)^diff --git a/(\S+) b/(\S+)$")


def split_patch(patch: str) -> list[FileSection]:
    """Split a git-style unified diff into per-file sections."""
    starts = [m.start() for m in _DIFF_HEADER.finditer(patch)]
    sections = []
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else len(patch)
        text = patch[start:end]
        header = _DIFF_HEADER.match(text)
        assert header is not None
        sections.append(FileSection(header.group(2), text))
    if patch.strip() and not sections:
        raise WorkbenchError("patch holds no 'diff --git' sections")
    return sections

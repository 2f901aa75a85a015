"""Refresh: write the commits of a materialized repository back into the stack.

Each commit on top of ``refs/kvlc/base`` is one entry, named by its
``Kvlc-Entry:`` trailer. A path the commit adds becomes an owned file, stored
whole at its upstream path; every other change goes into ``upstream.patch``.
The whole new state is computed before anything is written, and files whose
content did not change are not rewritten: refresh right after materialize
changes no byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from workbench.edited import EDITED
from workbench.errors import WorkbenchError
from workbench.gitutil import BASE_REF, ENTRY_TRAILER, git, git_text, split_trailer
from workbench.stack import (
    MESSAGE,
    OWNED,
    PATCH,
    RELEASE_DELTA,
    RETIRED,
    Stack,
    parse_series,
    validate_message,
    validate_owned_path,
)


@dataclass(frozen=True)
class EntryState:
    name: str
    message: str
    patch: str
    owned: dict[str, bytes]


def diff_for_patch(repo: Path, parent: str, commit: str, paths: list[str]) -> str:
    """The canonical text of ``upstream.patch``: plain -p1 diff, full blob ids."""
    if not paths:
        return ""
    raw = git(
        repo,
        "diff",
        "--full-index",
        "--no-color",
        "--no-ext-diff",
        "--no-textconv",
        "--no-renames",
        "--src-prefix=a/",
        "--dst-prefix=b/",
        parent,
        commit,
        "--",
        *paths,
    )
    text = raw.decode("utf-8", errors="strict")
    if "\nBinary files " in text or text.startswith("Binary files "):
        raise WorkbenchError(
            f"commit {commit[:12]} changes a binary file; the stack carries text only"
        )
    return text


def read_entries(repo: Path) -> list[EntryState]:
    """Read every entry commit of a materialized repository, bottom to top."""
    try:
        base = git_text(repo, "rev-parse", "--verify", BASE_REF).strip()
    except WorkbenchError as e:
        raise WorkbenchError(f"{repo} is not a materialized repository: {e}") from e
    merges = git_text(repo, "rev-list", "--merges", f"{base}..HEAD").split()
    if merges:
        raise WorkbenchError(
            f"{repo}: merge commit {merges[0][:12]} in the stack; rebase it"
        )
    if git_text(repo, "merge-base", base, "HEAD").strip() != base:
        raise WorkbenchError(f"{repo}: HEAD does not descend from {BASE_REF}")
    dirty = git_text(repo, "status", "--porcelain", "--untracked-files=all")
    if dirty.strip():
        raise WorkbenchError(
            f"{repo} has uncommitted changes; commit them into the entry they "
            f"belong to (git commit --fixup, then git rebase -i --autosquash):\n"
            + dirty.rstrip()
        )
    entries: list[EntryState] = []
    for commit in git_text(repo, "rev-list", "--reverse", f"{base}..HEAD").split():
        parent = f"{commit}^"
        raw_message = (
            git(repo, "cat-file", "commit", commit).decode().split("\n\n", 1)[1]
        )
        message, name = split_trailer(raw_message)
        subject = message.split("\n", 1)[0]
        if name is None:
            raise WorkbenchError(
                f"commit {commit[:12]} ({subject!r}) has no '{ENTRY_TRAILER}: <name>' "
                "trailer. Fold it into an entry (git commit --fixup + git rebase -i "
                f"--autosquash), or end its message with '{ENTRY_TRAILER}: <new-name>' "
                "to start a new entry."
            )
        if any(e.name == name for e in entries):
            raise WorkbenchError(
                f"two commits carry '{ENTRY_TRAILER}: {name}'; squash them"
            )
        parse_series(name)
        validate_message(name, message)
        added: list[str] = []
        changed: list[str] = []
        for line in git_text(
            repo, "diff", "--no-renames", "--name-status", parent, commit
        ).splitlines():
            status, path = line.split("\t", 1)
            (added if status == "A" else changed).append(path)
        owned = {}
        for path in added:
            validate_owned_path(name, path)
            owned[path] = git(repo, "show", f"{commit}:{path}")
        patch = diff_for_patch(repo, parent, commit, changed)
        if not patch and not owned:
            raise WorkbenchError(
                f"entry {name} (commit {commit[:12]}) changes nothing; drop it"
            )
        entries.append(EntryState(name, message, patch, owned))
    return entries


def _write_if_changed(path: Path, data: bytes, log: list[str]) -> None:
    if path.exists() and path.read_bytes() == data:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    log.append(f"wrote {path}")


def _remove(path: Path, log: list[str]) -> None:
    if path.exists():
        path.unlink()
        log.append(f"removed {path}")


def write_stack(old: Stack, entries: list[EntryState]) -> list[str]:
    """Make the stack on disk equal ``entries``; return what was changed."""
    log: list[str] = []
    root = old.root
    new_owned = {path for e in entries for path in e.owned}
    for e in entries:
        entry_dir = old.patches_dir / e.name
        _write_if_changed(entry_dir / MESSAGE, e.message.encode(), log)
        if e.patch:
            _write_if_changed(entry_dir / PATCH, e.patch.encode(), log)
        else:
            _remove(entry_dir / PATCH, log)
        if e.owned:
            listing = "".join(f"{p}\n" for p in sorted(e.owned))
            _write_if_changed(entry_dir / OWNED, listing.encode(), log)
        else:
            _remove(entry_dir / OWNED, log)
        for path, data in e.owned.items():
            _write_if_changed(root / path, data, log)
    kept = {e.name for e in entries}
    for old_entry in old.entries:
        for path in old_entry.owned:
            if path not in new_owned:
                _remove(root / path, log)
        if old_entry.name not in kept:
            # An entry's retired and edited tests go with it: the upstream
            # tests it removed or changed are back once it is dropped.
            for name in (MESSAGE, PATCH, OWNED, RETIRED, EDITED, RELEASE_DELTA):
                _remove(old.patches_dir / old_entry.name / name, log)
            entry_dir = old.patches_dir / old_entry.name
            if entry_dir.exists() and not any(entry_dir.iterdir()):
                entry_dir.rmdir()
    names = [e.name for e in entries]
    if names != [e.name for e in old.entries]:
        series = old.patches_dir / "series"
        header = [
            line for line in series.read_text().splitlines() if line.startswith("#")
        ]
        _write_if_changed(
            series, "".join(f"{x}\n" for x in header + names).encode(), log
        )
    return log


def refresh(stack: Stack, repo: Path) -> list[str]:
    """Write ``repo``'s entry commits back into ``stack``; return what changed."""
    entries = read_entries(repo)
    log = write_stack(stack, entries)
    head = git_text(repo, "rev-parse", "HEAD").strip()
    git(repo, "update-ref", "refs/kvlc/materialized", head)
    return log

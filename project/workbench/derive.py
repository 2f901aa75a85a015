"""Derive: the stack on the newest release, from the stack on the pinned one.

The series stays one: ``patches/`` is written against the pinned release, and
each entry's form on the newest release (``upstream.NEXT_RELEASE``) is

1. git's cherry-pick of the entry's commit onto the entries below it on the
   new release (``git merge-tree`` with the entry's parent as merge base, as
   ``rebase-report`` does), a conflict taken on the entry's side; then
2. ``patches/<entry>/on-<release>.patch``, when the entry has one: the diff
   from that pick to the entry as it must be on the new release (a conflict
   resolved, an API that moved upstream), under a header that says why. It is
   the record of what the entry had to learn, reviewed like any patch, and
   applied with ``git apply --3way``, so a change to the entry below it does
   not break it.

A second full series would repeat every line of every entry and drift from
the first; the delta is the few lines a release costs, beside the entry.

``./wb derive`` builds ``build/vllm-<release>`` like ``materialize`` builds
``build/vllm`` (base commit ``refs/kvlc/base``, one commit per entry, each with
its ``Kvlc-Entry`` trailer). Edit there with ``git commit --fixup`` and
``git rebase -i --autosquash refs/kvlc/base``; ``./wb derive --refresh``
writes each entry's delta back (and removes an empty one).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from workbench import upstream
from workbench.errors import WorkbenchError
from workbench.gitutil import (
    BASE_REF,
    git,
    git_status,
    git_text,
    with_trailer,
)
from workbench.materialize import MATERIALIZED_REF, build_repo, unrefreshed_work
from workbench.rebase import (
    commit_tree_of,
    commit_whole_tree,
    merge_entry,
    take_entry_sides,
)
from workbench.refresh import read_entries
from workbench.stack import RELEASE_DELTA, Stack

# Where --refresh fetches the derived tree's commits into its scratch repository.
DERIVED_REF = "refs/kvlc/derived"


def default_tree(root: Path) -> Path:
    return root / "build" / f"vllm-{upstream.NEXT_RELEASE}"


def _base_message(tree: Path) -> str:
    return (
        f"vLLM {upstream.NEXT_RELEASE}: pristine upstream source\n\n"
        f"The release sdist ({tree.name}), unpacked, unchanged.\n"
    )


def pick(repo: Path, head: str, entry_commit: str) -> tuple[str, list[str]]:
    """The tree of ``entry_commit`` cherry-picked onto ``head``, each conflict
    taken on the entry's side, and git's conflict messages (empty: clean)."""
    tree, clean, messages = merge_entry(repo, head, entry_commit)
    if clean:
        return tree, []
    details, _hunks, carried = take_entry_sides(repo, tree, messages)
    return carried, details


def _apply_delta(repo: Path, tree: str, delta: Path) -> tuple[str, str]:
    """``tree`` with the entry's delta applied (three-way where context
    moved), and git's complaint when it does not apply (``tree`` unchanged)."""
    git(repo, "read-tree", tree)
    applied = git_status(repo, "apply", "--cached", "--3way", str(delta))
    if applied.returncode != 0:
        return tree, applied.stderr.decode(errors="replace").strip()
    return git_text(repo, "write-tree").strip(), ""


@contextmanager
def _source_stack(stack: Stack) -> Iterator[tuple[Path, list[str]]]:
    """A scratch repository holding the pinned release's stack: (repo, the
    entry commits bottom to top)."""
    with tempfile.TemporaryDirectory(prefix="kvlc-derive-") as tmp:
        repo = Path(tmp) / "source"
        # Only git's plumbing reads or writes it after GNU patch.
        build_repo(stack, repo, sparse=True)
        commits = git_text(repo, "rev-list", "--reverse", f"{BASE_REF}..HEAD").split()
        yield repo, commits


def build_derived(
    stack: Stack, repo: Path, *, trailers: bool = True, link: bool = False
) -> tuple[str, list[str]]:
    """Create ``repo`` (must not exist) holding the stack on ``NEXT_RELEASE``:
    base commit, one commit per entry, checked out on branch ``stack``.
    ``link``: as for ``materialize.init_base`` (the files the two releases
    share stay links to the pinned one's: for a repository nobody edits).

    Returns the top commit and what needs a person: an entry that conflicts
    and has no delta, or whose delta no longer applies, is committed as git's
    pick alone (a conflict taken on the entry's side)."""
    build_repo(stack, repo, link=link)
    commits = git_text(repo, "rev-list", "--reverse", f"{BASE_REF}..HEAD").split()
    release = upstream.next_pristine_tree()
    head = commit_whole_tree(repo, release, _base_message(release))
    git(repo, "update-ref", BASE_REF, head)
    unresolved: list[str] = []
    for entry, commit in zip(stack.entries, commits, strict=True):
        tree, conflicts = pick(repo, head, commit)
        delta = stack.patches_dir / entry.name / RELEASE_DELTA
        note = ""
        if delta.is_file():
            tree, failure = _apply_delta(repo, tree, delta)
            note = " (+ its delta)"
            if failure:
                unresolved += [f"{entry.name}: {delta.name} does not apply:", failure]
        elif conflicts:
            unresolved.append(f"{entry.name}: conflicts, and no {delta.name}:")
            unresolved += conflicts
        message = with_trailer(entry.message, entry.name) if trailers else entry.message
        head = commit_tree_of(repo, tree, head, message)
        print(f"  derived {entry.name}{note}")
    git(repo, "update-ref", "refs/heads/stack", head)
    git(repo, "update-ref", MATERIALIZED_REF, head)
    git(repo, "checkout", "--quiet", "--force", "stack")
    git(repo, "clean", "--quiet", "-fdx")
    return head, unresolved


def derive(stack: Stack, dest: Path, *, force: bool = False) -> str:
    """Build the stack on ``NEXT_RELEASE`` at ``dest``; return its top commit.

    The old ``dest`` is replaced only after the build, and not while it holds
    edits ``--refresh`` has not written back (unless ``force``). What needs a
    person (``build_derived``) is raised once ``dest`` is in place, to be
    resolved there."""
    problem = unrefreshed_work(dest) if dest.exists() and not force else None
    if problem:
        raise WorkbenchError(
            f"{problem}\nRun ./wb derive --refresh to keep that work, or --force "
            "to discard it."
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}-") as tmp:
        repo = Path(tmp) / "repo"
        head, unresolved = build_derived(stack, repo)
        if dest.exists():
            shutil.rmtree(dest)
        repo.rename(dest)
    if unresolved:
        raise WorkbenchError(
            f"the stack on vLLM {upstream.NEXT_RELEASE} needs a person:\n"
            + "\n".join(unresolved)
            + f"\n{dest} holds git's pick of each such entry (a conflict taken on "
            "the entry's side): fix the entry's commit there (git commit --fixup, "
            "git rebase -i --autosquash refs/kvlc/base), then ./wb derive --refresh"
        )
    return head


def delta_header(path: Path) -> bytes:
    """The text above a delta's first ``diff --git`` line: why the entry
    changed on the new release (DEP-3 style). Refresh keeps it; git apply
    skips it."""
    if not path.is_file():
        return b""
    text = path.read_bytes()
    cut = text.find(b"diff --git ")
    return text if cut < 0 else text[:cut]


def refresh(stack: Stack, dest: Path) -> list[str]:
    """Write each entry's delta back from ``dest``'s commits; return the
    files changed."""
    edited = read_entries(dest)
    names = [e.name for e in edited]
    series = [e.name for e in stack.entries]
    if names != series:
        raise WorkbenchError(
            f"{dest} holds entries {names}, the series {series}; add, drop or "
            "reorder entries in build/vllm (./wb materialize), then derive again"
        )
    log: list[str] = []
    with _source_stack(stack) as (repo, commits):
        git(repo, "fetch", "--quiet", str(dest.resolve()), f"HEAD:{DERIVED_REF}")
        base = f"{DERIVED_REF}~{len(commits)}"
        mine = git_text(repo, "rev-list", "--reverse", f"{base}..{DERIVED_REF}").split()
        parent = base
        picks = zip(stack.entries, commits, mine, strict=True)
        for entry, commit, edited_commit in picks:
            tree, _ = pick(repo, parent, commit)
            diff = git(repo, "diff", "--full-index", tree, f"{edited_commit}^{{tree}}")
            path = stack.patches_dir / entry.name / RELEASE_DELTA
            text = delta_header(path) + diff if diff else b""
            if text and (not path.is_file() or path.read_bytes() != text):
                path.write_bytes(text)
                log.append(f"wrote {path.relative_to(stack.root)}")
            elif not diff and path.is_file():
                path.unlink()
                log.append(f"removed {path.relative_to(stack.root)}")
            parent = edited_commit
    git(dest, "update-ref", MATERIALIZED_REF, "HEAD")
    return log

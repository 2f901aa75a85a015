"""Rebase report: how the stack fares on a newer vLLM, entry by entry.

The target is a vLLM sdist (``.tar.gz``), a source directory, or a git
repository (bare or not) at a revision (``--rev``, default ``HEAD``). Each
entry is tried on top of the ones before it, on the target, the way a
maintainer would carry it: first its diff as it is (``git apply``), then
git's own three-way merge of the entry's commit (``git merge-tree``, what
``git cherry-pick`` and ``git am -3`` do), with the pristine release as the
merge base. Each entry is classified:

- ``clean``: its diff applies as it is (hunks may have moved);
- ``merged``: the diff does not apply, but the three-way merge resolves it
  with no conflict (review the result, no hand work);
- ``upstream``: merging changes nothing (the change is already there: drop the
  entry);
- ``conflict``: the merge leaves conflicts, listed per file with the lines of
  each conflicting hunk: the hand work a release costs.

A conflicting entry is carried on with its own side of each conflict taken,
so the entries above it are assessed with it, as they will be once a person
resolved it: their conflicts are their own, not echoes of the one below.
"""

from __future__ import annotations

import io
import re
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from workbench.errors import WorkbenchError
from workbench.gitutil import BASE_REF, commit_tree, git, git_status, git_text
from workbench.materialize import build_repo, copy_tree
from workbench.stack import Stack
from workbench.upstream import unpack_sdist


@dataclass(frozen=True)
class ConflictHunk:
    path: str
    start: int
    ours: int
    theirs: int

    def __str__(self) -> str:
        end = self.start + self.ours + self.theirs + 2
        return (
            f"{self.path} lines {self.start}-{end}: {self.ours} upstream lines "
            f"against {self.theirs} of the entry"
        )


@dataclass
class EntryDrift:
    name: str
    status: str
    details: list[str] = field(default_factory=list)
    hunks: list[ConflictHunk] = field(default_factory=list)

    @property
    def conflict_lines(self) -> int:
        """Lines inside conflict markers: what a person has to read and decide."""
        return sum(h.ours + h.theirs for h in self.hunks)


@dataclass(frozen=True)
class Target:
    """The tree the stack is tried on, and how to name it in a report."""

    tree: Path
    label: str


def is_git_dir(path: Path) -> bool:
    return (path / ".git").exists() or (
        (path / "HEAD").is_file() and (path / "objects").is_dir()
    )


def resolve_target(target: Path, rev: str | None, scratch: Path) -> Target:
    """Unpack or export ``target`` (sdist, git repository, tree) under ``scratch``."""
    dest = scratch / "target"
    if target.is_file():
        if rev:
            raise WorkbenchError(f"--rev is for a git repository, {target} is a file")
        return Target(unpack_sdist(target, dest), target.name)
    if not target.is_dir():
        raise WorkbenchError(
            f"{target} does not exist; pass a vLLM sdist (.tar.gz), a git "
            "repository (with --rev), or a source directory"
        )
    if is_git_dir(target):
        commit = git_text(
            target, "rev-parse", "--verify", f"{rev or 'HEAD'}^{{commit}}"
        )
        commit = commit.strip()
        archive = git(target, "archive", "--format=tar", commit)
        dest.mkdir(parents=True)
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(dest, filter="data")
        return Target(dest, f"{target.name} at {rev or 'HEAD'} ({commit})")
    if rev:
        raise WorkbenchError(f"--rev is for a git repository, {target} is not one")
    copy_tree(target, dest)
    return Target(dest, target.name)


_MARKERS = re.compile(r"(?ms)^<{7}(?: [^\n]*)?\n(.*?)^={7}\n(.*?)^>{7}(?: [^\n]*)?$")


def take_entry_side(text: str) -> str:
    """``text`` with each conflict region replaced by the entry's side."""
    return re.sub(_MARKERS.pattern + "\n?", lambda m: m.group(2), text)


def conflict_hunks(path: str, text: str) -> list[ConflictHunk]:
    """The conflict-marker regions git wrote into ``text``."""
    hunks = []
    for m in _MARKERS.finditer(text):
        start = text.count("\n", 0, m.start()) + 1
        ours, theirs = m.group(1).count("\n"), m.group(2).count("\n")
        hunks.append(ConflictHunk(path, start, ours, theirs))
    return hunks


def merge_entry(repo: Path, head: str, entry_commit: str) -> tuple[str, bool, str]:
    """Three-way merge of ``entry_commit`` onto ``head`` with the entry's parent
    as base: (result tree, clean, git's messages)."""
    parent = git_text(repo, "rev-parse", f"{entry_commit}^").strip()
    # merge-tree takes the merge base from history: hang head's tree on the
    # entry's parent, which makes that parent the base (a cherry-pick).
    ours = commit_tree_of(repo, f"{head}^{{tree}}", parent)
    proc = git_status(
        repo, "merge-tree", "--write-tree", "--no-messages", ours, entry_commit
    )
    if proc.returncode not in (0, 1):
        raise WorkbenchError(
            "git merge-tree failed: " + proc.stderr.decode(errors="replace")
        )
    tree = proc.stdout.decode().split("\n", 1)[0].strip()
    messages = ""
    if proc.returncode == 1:
        messages = git_status(
            repo, "merge-tree", "--write-tree", "--name-only", ours, entry_commit
        ).stdout.decode()
    return tree, proc.returncode == 0, messages


def commit_whole_tree(repo: Path, tree: Path, message: str) -> str:
    """Commit every file under ``tree``, and nothing else, as a parentless
    commit in ``repo`` (a release to carry the stack onto)."""
    git(repo, "read-tree", "--empty")
    # All of ``tree``, also where ``repo`` is a sparse checkout (build_repo's
    # ``sparse``), whose git would leave out what its work tree does not hold.
    stage = ("--work-tree", str(tree), "add", "--all", "--force")
    git(repo, "-c", "core.sparseCheckout=false", *stage)
    return commit_tree(repo, message, None)


def commit_tree_of(
    repo: Path, tree: str, parent: str, message: str = "target\n"
) -> str:
    return (
        git(repo, "commit-tree", tree, "-p", parent, input=message.encode())
        .decode()
        .strip()
    )


def take_entry_sides(
    repo: Path, tree: str, messages: str
) -> tuple[list[str], list[ConflictHunk], str]:
    """Git's conflict messages, the marker regions in the merged tree, and that
    tree with the entry's side of each region taken."""
    head, _, info = messages.partition("\n\n")
    paths = [p for p in head.splitlines()[1:] if p]
    details = [line for line in info.splitlines() if line.startswith("CONFLICT")]
    hunks: list[ConflictHunk] = []
    git(repo, "read-tree", tree)
    for path in dict.fromkeys(paths):
        listing = git_text(repo, "ls-tree", tree, "--", path).split()
        if not listing or listing[1] != "blob":
            continue
        text = git(repo, "show", f"{tree}:{path}").decode(errors="replace")
        found = conflict_hunks(path, text)
        if found:
            hunks += found
            resolved = take_entry_side(text).encode()
            blob = git(repo, "hash-object", "-w", "--stdin", input=resolved).decode()
            cacheinfo = f"{listing[0]},{blob.strip()},{path}"
            git(repo, "update-index", "--cacheinfo", cacheinfo)
    return details, hunks, git_text(repo, "write-tree").strip()


def _applies(repo: Path, head: str, entry_commit: str) -> bool:
    """Whether the entry's diff applies to ``head`` as it is (no merge)."""
    diff = git(
        repo, "diff", "--full-index", "--binary", f"{entry_commit}^", entry_commit
    )
    git(repo, "read-tree", head)
    return git_status(repo, "apply", "--cached", "--check", input=diff).returncode == 0


def assess(stack: Stack, target: Target, scratch: Path) -> list[EntryDrift]:
    """Classify each entry of ``stack`` on ``target`` (see the module docstring)."""
    repo = scratch / "stack"
    # After GNU patch only git's index and objects change here, never the
    # work tree: it need hold only the files the stack patches.
    build_repo(stack, repo, trailers=False, sparse=True)
    commits = git_text(repo, "rev-list", "--reverse", f"{BASE_REF}..HEAD").split()
    head = commit_whole_tree(repo, target.tree, f"upstream: {target.label}\n")
    drifts = []
    for entry, commit in zip(stack.entries, commits, strict=True):
        clashes = [
            f"added file now exists upstream: {p}"
            for p in entry.owned
            if git_text(repo, "ls-tree", head, "--", p).strip()
        ]
        tree, clean, messages = merge_entry(repo, head, commit)
        if not clean:
            details, hunks, carried = take_entry_sides(repo, tree, messages)
            drifts.append(EntryDrift(entry.name, "conflict", clashes + details, hunks))
            head = commit_tree_of(repo, carried, head)
            continue
        if tree == git_text(repo, "rev-parse", f"{head}^{{tree}}").strip():
            drifts.append(
                EntryDrift(entry.name, "upstream", ["already applied upstream"])
            )
            continue
        status = "clean" if _applies(repo, head, commit) else "merged"
        drifts.append(EntryDrift(entry.name, status, clashes))
        head = commit_tree_of(repo, tree, head)
    return drifts


def rebase_report(
    stack: Stack, target: Path, rev: str | None = None
) -> tuple[str, list[EntryDrift]]:
    """Try the stack on ``target``; return its label and each entry's drift."""
    with tempfile.TemporaryDirectory(prefix="kvlc-rebase-") as tmp:
        resolved = resolve_target(target, rev, Path(tmp))
        return resolved.label, assess(stack, resolved, Path(tmp))


def format_report(label: str, drifts: list[EntryDrift]) -> str:
    lines = [f"# Rebase report: the stack on {label}", ""]
    lines += [
        "| entry | status | conflicting hunks | lines in conflict |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {d.name} | {d.status} | {len(d.hunks)} | {d.conflict_lines} |"
        for d in drifts
    ]
    for d in drifts:
        if d.details or d.hunks:
            lines += ["", f"## {d.name}: {d.status}", "", "```"]
            lines += d.details + [str(h) for h in d.hunks]
            lines.append("```")
    return "\n".join(lines) + "\n"

"""Materialize: the pristine release plus the stack, as a git repository.

The result has a base commit holding the pristine sdist tree (``refs/kvlc/base``)
and one commit per entry in series order on branch ``stack``. Commits use a
fixed identity and date, so the same stack always gives the same hashes.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from workbench import upstream
from workbench.errors import WorkbenchError
from workbench.gitutil import (
    BASE_REF,
    PatchResult,
    commit_tree,
    git,
    git_text,
    run_patch,
    with_trailer,
)
from workbench.stack import Entry, Stack, split_patch

MATERIALIZED_REF = "refs/kvlc/materialized"


def base_message(source: Path) -> str:
    return (
        f"vLLM {upstream.RELEASE}: pristine upstream source\n\n"
        f"The release sdist ({source.name}), unpacked, unchanged.\n"
    )


def init_base(repo: Path, source: Path) -> str:
    """Create ``repo`` holding a copy of ``source`` as its base commit."""
    shutil.copytree(source, repo, symlinks=True)
    git(repo, "init", "--quiet", "--initial-branch=stack")
    # Edits made here are PR messages in markdown: keep '#' lines.
    git(repo, "config", "commit.cleanup", "whitespace")
    # -f: the sdist ships .gitignore files that would hide some of its own files.
    git(repo, "add", "--all", "--force")
    base = commit_tree(repo, base_message(source), None)
    git(repo, "update-ref", BASE_REF, base)
    git(repo, "update-ref", "refs/heads/stack", base)
    return base


def apply_entry(
    repo: Path, stack: Stack, entry: Entry, parent: str, trailers: bool
) -> str:
    """Commit ``entry`` on top of ``parent``; on failure nothing in ``repo`` changes."""
    for path in entry.owned:
        if (repo / path).exists():
            raise WorkbenchError(
                f"entry {entry.name}: owned file {path} already exists in the tree "
                "below it; move its change into upstream.patch instead"
            )
    if entry.patch:
        check = run_patch(repo, entry.patch, dry_run=True)
        if not check.ok:
            raise WorkbenchError(describe_failure(entry, check.output))
    for path in entry.owned:
        target = repo / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(stack.added_file(path))
    if entry.patch:
        applied = run_patch(repo, entry.patch, dry_run=False)
        if not applied.ok:
            raise WorkbenchError(describe_failure(entry, applied.output))
        for line in applied.offsets:
            print(f"  warning: {entry.name}: {line} (run refresh to update the patch)")
    git(repo, "add", "--all", "--force")
    message = with_trailer(entry.message, entry.name) if trailers else entry.message
    commit = commit_tree(repo, message, parent)
    git(repo, "update-ref", "refs/heads/stack", commit)
    return commit


def describe_failure(entry: Entry, patch_output: str) -> str:
    """Name the entry, quote GNU patch, and show each failing hunk."""
    result = PatchResult(False, patch_output)
    sections = {s.path: s for s in split_patch(entry.patch)}
    lines = [f"entry {entry.name} does not apply:", patch_output.rstrip()]
    for path, number in result.failed_hunks():
        section = sections.get(path)
        if section:
            lines.append(f"--- failing hunk #{number} of {path}:")
            lines.append(section.hunk(number).rstrip())
    return "\n".join(lines)


def build_repo(
    stack: Stack, repo: Path, *, source: Path | None = None, trailers: bool = True
) -> str:
    """Create ``repo`` (must not exist): base commit, then one commit per entry."""
    source = source or upstream.pristine_tree()
    head = init_base(repo, source)
    for entry in stack.entries:
        head = apply_entry(repo, stack, entry, head, trailers)
        print(f"  applied {entry.name}")
    git(repo, "update-ref", MATERIALIZED_REF, head)
    git(repo, "reset", "--quiet", "--hard", "stack")
    return head


def unrefreshed_work(repo: Path) -> str | None:
    """Describe edits in a materialized repo that refresh has not written back."""
    if not (repo / ".git").exists():
        return f"{repo} exists but is not a materialized repository"
    status = git_text(repo, "status", "--porcelain", "--untracked-files=all")
    if status.strip():
        return f"{repo} has uncommitted changes:\n{status.rstrip()}"
    head = git_text(repo, "rev-parse", "HEAD").strip()
    try:
        recorded = git_text(repo, "rev-parse", MATERIALIZED_REF).strip()
    except WorkbenchError:
        return f"{repo} was not made by materialize"
    if head != recorded:
        return (
            f"{repo} has commits that refresh has not written back (HEAD {head[:12]})"
        )
    return None


def materialize(stack: Stack, dest: Path, *, force: bool = False) -> str:
    """Build the patched tree at ``dest``; the old one is replaced only on success."""
    problem = unrefreshed_work(dest) if dest.exists() and not force else None
    if problem:
        raise WorkbenchError(
            f"{problem}\nRun refresh to keep that work, or --force to discard it."
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}-") as tmp:
        staging = Path(tmp) / "repo"
        head = build_repo(stack, staging)
        if dest.exists():
            shutil.rmtree(dest)
        staging.rename(dest)
    return head

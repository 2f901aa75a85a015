"""Materialize: the pristine release plus the stack, as a git repository.

The result has a base commit holding the pristine sdist tree (``refs/kvlc/base``)
and one commit per entry in series order on branch ``stack``. Commits use a
fixed identity and date, so the same stack always gives the same hashes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Collection
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
from workbench.stack import Entry, Stack, patch_files, split_patch

MATERIALIZED_REF = "refs/kvlc/materialized"


def base_message(source: Path) -> str:
    return (
        f"vLLM {upstream.RELEASE}: pristine upstream source\n\n"
        f"The release sdist ({source.name}), unpacked, unchanged.\n"
    )


def init_base(
    repo: Path,
    source: Path,
    *,
    link: bool = False,
    only: Collection[str] | None = None,
) -> str:
    """Create ``repo`` holding a copy of ``source`` as its base commit.

    ``link``: hard-link the files instead of copying them, for a throwaway
    repository nobody edits (``export``'s): GNU patch and git replace a file
    they change instead of writing into it, so ``source`` stays as it was,
    but an editor may write into a linked file.

    ``only``: put just these paths in the work tree (a sparse checkout; the
    index and the commits hold the whole tree), for a throwaway repository
    where only GNU patch and git read or write files, and only these. The
    base is then staged from ``source`` where it is, with no copy or link of
    its ~7,700 files and, for a pristine tree, no hashing of them either
    (``_stage_in_place``)."""
    if only is None:
        copy_tree(source, repo, link=link)
    else:
        repo.mkdir(parents=True)
    git(repo, "init", "--quiet", "--initial-branch=stack")
    seeded = seed_objects(repo, source)
    # Edits made here are PR messages in markdown: keep '#' lines.
    git(repo, "config", "commit.cleanup", "whitespace")
    if only is None:
        # -f: the sdist ships .gitignore files that would hide some of its
        # own files.
        git(repo, "add", "--all", "--force")
    else:
        _stage_in_place(repo, source, seeded)
    base = commit_tree(repo, base_message(source), None)
    git(repo, "update-ref", BASE_REF, base)
    git(repo, "update-ref", "refs/heads/stack", base)
    if only is not None:
        _check_out_only(repo, only)
    if not seeded:
        remember_objects(repo, source)
    return base


def _stage_in_place(repo: Path, source: Path, seeded: bool) -> None:
    """Stage every file of ``source`` in ``repo``'s index, ``source`` being
    the work tree for this once.

    A pristine tree's index is kept beside its objects (``seed_objects``):
    from it git only compares each file's stat with what it recorded, as in
    any work tree, and hashes the files that differ. ctime is left out of
    that comparison: linking the tree's files elsewhere (``link``) changes
    it, while an edit changes the mtime too. The kept index is replaced only
    by one whose every blob is in the kept pack (no loose object written),
    so the pair always agrees."""
    index = repo / ".git" / "index"
    kept = _index_cache(source) if seeded else None
    if kept is not None and kept.is_file():
        shutil.copyfile(kept, index)
    stage = ("--work-tree", str(source), "add", "--all", "--force")
    git(repo, "-c", "core.trustctime=false", *stage)
    if kept is None or (kept.is_file() and kept.read_bytes() == index.read_bytes()):
        return
    loose = git_text(repo, "count-objects").split(" ", 1)[0]
    if loose == "0":
        staging = kept.with_name(f".{kept.name}-{os.getpid()}")
        shutil.copyfile(index, staging)
        staging.replace(kept)


def _check_out_only(repo: Path, paths: Collection[str]) -> None:
    """Make ``repo`` a sparse checkout of ``paths`` (git's classic sparse
    checkout, which every git has) and write those of them that exist."""
    # One anchored gitignore pattern per path, its wildcards escaped.
    patterns = "".join(
        "/" + re.sub(r"([\\*?\[])", r"\\\1", p) + "\n" for p in sorted(paths)
    )
    (repo / ".git" / "info").mkdir(exist_ok=True)
    (repo / ".git" / "info" / "sparse-checkout").write_text(patterns)
    git(repo, "config", "core.sparseCheckout", "true")
    git(repo, "reset", "--quiet", "--hard")


def stack_paths(stack: Stack) -> set[str]:
    """Every path an entry of ``stack`` adds or patches."""
    return {p for e in stack.entries for p in (*e.owned, *patch_files(e.patch))}


def copy_tree(source: Path, dest: Path, *, link: bool = False) -> None:
    """``cp -a`` (``-al`` to hard-link): faster than ``shutil.copytree``, a
    Python loop of copy2 and copystat over the release's ~15,000 files."""
    dest.mkdir(parents=True)
    flags = "-al" if link else "-a"
    result = subprocess.run(
        ["cp", flags, f"{source}/.", str(dest)], capture_output=True, text=True
    )
    if result.returncode != 0:
        raise WorkbenchError(f"copying {source} to {dest}: {result.stderr.strip()}")


def _index_cache(source: Path) -> Path | None:
    """Where the index of ``source``'s files is kept (``_stage_in_place``):
    beside the pack of its objects."""
    kept = _objects_cache(source)
    return None if kept is None else kept.with_name(f"{kept.name}.index")


def _objects_cache(source: Path) -> Path | None:
    """Where the pack of ``source``'s objects is kept: for trees in the
    workbench's cache (the pristine release) only."""
    cache = upstream.cache_dir().resolve()
    source = source.resolve()
    if not source.is_relative_to(cache):
        return None
    return (
        cache / "git-objects" / source.relative_to(cache).as_posix().replace("/", "_")
    )


def seed_objects(repo: Path, source: Path) -> bool:
    """Hard-link the kept pack of ``source``'s objects into ``repo``, so
    ``git add`` finds every file's blob there instead of writing ~15,000
    loose objects (most of a base commit's time). The pack only saves work:
    a file it lacks (the tree changed) is written as usual. False if none is
    kept."""
    kept = _objects_cache(source)
    if kept is None or not kept.is_dir():
        return False
    pack_dir = repo / ".git" / "objects" / "pack"
    for f in kept.iterdir():
        try:
            os.link(f, pack_dir / f.name)
        except OSError:  # another file system
            shutil.copy2(f, pack_dir / f.name)
    return True


def remember_objects(repo: Path, source: Path) -> None:
    """Keep the pack of ``repo``'s base commit for ``seed_objects``."""
    kept = _objects_cache(source)
    if kept is None or kept.exists():
        return
    git(repo, "repack", "-a", "-d", "-q")
    kept.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{kept.name}-", dir=kept.parent))
    for f in (repo / ".git" / "objects" / "pack").iterdir():
        shutil.copy2(f, staging / f.name)
    try:
        staging.rename(kept)
    except OSError:  # another process kept it first
        shutil.rmtree(staging)


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
    stack: Stack,
    repo: Path,
    *,
    source: Path | None = None,
    trailers: bool = True,
    link: bool = False,
    sparse: bool = False,
) -> str:
    """Create ``repo`` (must not exist): base commit, then one commit per
    entry. ``link``: as for ``init_base``; ``sparse``: its work tree holds
    only the files the stack adds or patches (``init_base``'s ``only``)."""
    source = source or upstream.pristine_tree()
    only = stack_paths(stack) if sparse else None
    head = init_base(repo, source, link=link, only=only)
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

"""Rebase report: how the stack fares on a newer vLLM sdist, entry by entry.

Each entry is tried on top of the ones before it, on the new release, and
classified (after Brave's drift classes):

- ``clean``: applies exactly;
- ``offset``: applies, hunks moved (refresh will fix it);
- ``fuzz``: applies only with fuzz (context changed: review it);
- ``upstream``: the change is already in the new release (drop the entry);
- ``conflict``: some hunks do not apply (listed), or an added file now exists
  upstream, or a patched file is gone.

A conflicting entry is left out, so the ones above it are assessed without it.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from workbench.errors import WorkbenchError
from workbench.gitutil import run_patch
from workbench.materialize import describe_failure
from workbench.stack import Entry, Stack
from workbench.upstream import unpack_sdist


@dataclass
class EntryDrift:
    name: str
    status: str
    details: list[str] = field(default_factory=list)


def _assess(entry: Entry, stack: Stack, tree: Path) -> EntryDrift:
    clashes = [p for p in entry.owned if (tree / p).exists()]
    if clashes:
        return EntryDrift(
            entry.name,
            "conflict",
            [f"added file now exists upstream: {p}" for p in clashes],
        )
    if entry.patch:
        exact = run_patch(tree, entry.patch, dry_run=True)
        if not exact.ok:
            if run_patch(tree, entry.patch, dry_run=True, reverse=True).ok:
                return EntryDrift(entry.name, "upstream", ["already applied upstream"])
            fuzzy = run_patch(tree, entry.patch, dry_run=True, fuzz=2)
            if not fuzzy.ok:
                return EntryDrift(
                    entry.name, "conflict", [describe_failure(entry, exact.output)]
                )
            status, details = "fuzz", fuzzy.fuzzed + fuzzy.offsets
            applied = run_patch(tree, entry.patch, dry_run=False, fuzz=2)
        else:
            status, details = ("offset" if exact.offsets else "clean"), exact.offsets
            applied = run_patch(tree, entry.patch, dry_run=False)
        if not applied.ok:
            raise WorkbenchError(f"entry {entry.name}: dry run passed, apply failed")
    else:
        status, details = "clean", []
    for path in entry.owned:
        target = tree / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(stack.added_file(path))
    return EntryDrift(entry.name, status, details)


def rebase_report(stack: Stack, sdist: Path) -> list[EntryDrift]:
    """Try the stack on ``sdist`` (any vLLM source tarball) and classify each entry."""
    if not sdist.is_file():
        raise WorkbenchError(f"{sdist} is not a file; pass a vLLM sdist (.tar.gz)")
    with tempfile.TemporaryDirectory(prefix="kvlc-rebase-") as tmp:
        tree = unpack_sdist(sdist, Path(tmp) / "tree")
        return [_assess(entry, stack, tree) for entry in stack.entries]


def format_report(sdist: Path, drifts: list[EntryDrift]) -> str:
    lines = [f"# Rebase report: the stack on {sdist.name}", ""]
    lines += ["| entry | status |", "|---|---|"]
    lines += [f"| {d.name} | {d.status} |" for d in drifts]
    for d in drifts:
        if d.details:
            lines += ["", f"## {d.name}: {d.status}", "", "```"]
            lines += [line for detail in d.details for line in detail.splitlines()]
            lines.append("```")
    return "\n".join(lines) + "\n"

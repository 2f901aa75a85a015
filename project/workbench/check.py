"""Check: everything a reviewer of the stack would otherwise check by hand.

1. ``patches/series`` and every entry parse; each added file has one owner.
2. No entry touches a file the CPU wheel cannot take.
3. The entries apply in series order, each on the ones before it (no fuzz).
4. The stored patches are exactly what refresh writes (nothing stale).
5. The export, ``git am``-ed onto the pristine tree, reproduces the stack.
6. No added line carries a new ``# type: ignore``.
7. Upstream's own hooks (ruff, ruff-format, mypy, ...) pass on every touched file.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from workbench import lint, upstream
from workbench.build import refuse_cpu_divergent
from workbench.errors import WorkbenchError
from workbench.export import am_onto_base, format_patches
from workbench.gitutil import git_text
from workbench.materialize import build_repo
from workbench.refresh import read_entries
from workbench.stack import Stack, split_patch, unowned_added_files

_TYPE_IGNORE = re.compile(r"#\s*type:\s*ignore")


def added_lines(stack: Stack) -> list[tuple[str, str, str]]:
    """(entry, path, line) for every line the stack adds."""
    found = []
    for entry in stack.entries:
        for section in split_patch(entry.patch):
            for line in section.text.splitlines():
                if line.startswith("+") and not line.startswith("+++"):
                    found.append((entry.name, section.path, line[1:]))
        for path in entry.owned:
            text = stack.added_file(path).decode(errors="replace")
            found += [(entry.name, path, line) for line in text.splitlines()]
    return found


def touched_files(stack: Stack) -> list[str]:
    paths = {p for e in stack.entries for p in e.owned}
    paths |= {s.path for e in stack.entries for s in split_patch(e.patch)}
    return sorted(paths)


def check(stack: Stack, *, run_lint: bool = True) -> list[str]:
    """Run every check; return the problems found (empty: all good)."""
    problems: list[str] = []
    print(f"stack: {len(stack.entries)} entries")
    for path in unowned_added_files(stack):
        problems.append(
            f"{path} is not owned by any entry; list it in one entry's owned-files"
        )
    try:
        refuse_cpu_divergent(stack)
    except WorkbenchError as e:
        problems.append(str(e))
    for entry, path, line in added_lines(stack):
        if _TYPE_IGNORE.search(line):
            problems.append(
                f"entry {entry}: new '# type: ignore' in {path}: {line.strip()}"
            )
    source = upstream.pristine_tree()
    with tempfile.TemporaryDirectory(prefix="kvlc-check-") as tmp:
        repo = Path(tmp) / "stack"
        build_repo(stack, repo, source=source)
        print("ok: every entry applies on the ones before it")
        for old, new in zip(stack.entries, read_entries(repo), strict=False):
            stored_owned = {p: stack.added_file(p) for p in old.owned}
            if (old.message, old.patch, stored_owned) != (
                new.message,
                new.patch,
                new.owned,
            ):
                problems.append(
                    f"entry {old.name} is stale: its files are not what refresh "
                    "writes; run materialize then refresh"
                )
        tree = git_text(repo, "rev-parse", "HEAD^{tree}").strip()
        if am_onto_base(format_patches(repo), source, Path(tmp)) != tree:
            problems.append("git am of the export does not reproduce the stack")
        else:
            print("ok: export round trip (git am onto pristine) reproduces the stack")
        if run_lint:
            problems += lint.run_upstream_hooks(repo, touched_files(stack))
    return problems

"""Check: everything a reviewer of the stack would otherwise check by hand.

1. ``patches/series`` and every entry parse; each added file has one owner.
2. No entry touches a file the CPU wheel cannot take.
3. The entries apply in series order, each on the ones before it (no fuzz).
4. The stored patches are exactly what refresh writes (nothing stale).
5. The export, ``git am``-ed onto the pristine tree, reproduces the stack.
6. No added line carries a new ``# type: ignore``.
7. Every retired test exists in the pristine sdist and is gone after its entry.
8. Every upstream test file an entry edits is declared in its edited-tests.
9. Every PR message has the sections of the release's PR template, discloses AI
   assistance, names no path only this repository has and has at most 400
   words (``wc -w``); every over-long message is reported, not just the first.
10. Upstream's own hooks (ruff, ruff-format, mypy, ...) pass on every touched file.
"""

from __future__ import annotations

import ast
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

from workbench import edited, lint, prtext, upstream
from workbench.build import BUILDS, refuse_divergent
from workbench.errors import WorkbenchError
from workbench.export import am_onto_base, format_patches
from workbench.gitutil import BASE_REF, git_text
from workbench.materialize import build_repo
from workbench.refresh import read_entries
from workbench.stack import (
    RETIRED,
    RetiredTest,
    Stack,
    split_patch,
    unowned_added_files,
)

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


def defines(source: str, names: Sequence[str]) -> bool:
    """Whether a module defines ``names``: a function, or classes down to one."""
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return False
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for name in names:
        found = [n for n in body if isinstance(n, kinds) and n.name == name]
        if not found:
            return False
        body = found[-1].body
    return True


def has_test(repo: Path, commit: str, test: RetiredTest) -> bool:
    """Whether the tree of ``commit`` holds what ``test`` names.

    Parametrizations are pytest's doing: a parametrized id is matched by its
    function's name.
    """
    listing = git_text(repo, "ls-tree", commit, "--", test.path).split()
    if not listing:
        return False
    if not test.names:
        return True
    if listing[1] != "blob":
        return False
    return defines(git_text(repo, "show", f"{commit}:{test.path}"), test.names)


def retired_test_problems(stack: Stack, repo: Path) -> list[str]:
    """Retired tests that retire nothing real, or that their entry did not remove.

    ``repo`` is the materialized stack: the base commit, one commit per entry.
    """
    problems = []
    commits = git_text(repo, "rev-list", "--reverse", f"{BASE_REF}..HEAD").split()
    for entry, commit in zip(stack.entries, commits, strict=True):
        where = f"patches/{entry.name}/{RETIRED}"
        for test in entry.retired:
            if not has_test(repo, BASE_REF, test):
                problems.append(
                    f"{where} line {test.line}: {test.node} names no test of the "
                    "pristine sdist; fix the node id, or drop the line (only "
                    "upstream's tests are retired)"
                )
            elif has_test(repo, commit, test):
                problems.append(
                    f"{where} line {test.line}: {test.node} still exists after "
                    f"entry {entry.name}; drop the line (a test the entry keeps "
                    "runs and must pass), or remove or rename the test in the entry"
                )
    return problems


def _declared_and_pr_text(stack: Stack, source: Path) -> list[str]:
    problems = []
    try:
        declared = edited.edited_problems(stack)
    except WorkbenchError as e:
        declared = [str(e)]
    if not declared:
        count = sum(len(paths) for paths in edited.edited_in_diff(stack).values())
        print(f"ok: {count} edited upstream test files, each declared by its entry")
    problems += declared
    headings = prtext.template_headings(source)
    text = [p for e in stack.entries for p in prtext.message_problems(e, headings)]
    if not text:
        print(f"ok: every PR message has the template's sections {headings}")
    return problems + text


def check(stack: Stack, *, run_lint: bool = True) -> list[str]:
    """Run every check; return the problems found (empty: all good)."""
    problems: list[str] = []
    print(f"stack: {len(stack.entries)} entries")
    for path in unowned_added_files(stack):
        problems.append(
            f"{path} is not owned by any entry; list it in one entry's owned-files"
        )
    for target in BUILDS.values():
        try:
            refuse_divergent(stack, target)
        except WorkbenchError as e:
            problems.append(str(e))
    for entry, path, line in added_lines(stack):
        if _TYPE_IGNORE.search(line):
            problems.append(
                f"entry {entry}: new '# type: ignore' in {path}: {line.strip()}"
            )
    source = upstream.pristine_tree()
    problems += _declared_and_pr_text(stack, source)
    with tempfile.TemporaryDirectory(prefix="kvlc-check-") as tmp:
        repo = Path(tmp) / "stack"
        # Only GNU patch and git change this tree, and they replace a file
        # they change: the release's ~7,700 files are hard links where the
        # hooks read them (mypy follows imports; lint gives the files it
        # checks inodes of their own), else left out (a sparse checkout of
        # what the stack touches). Copying them was most of a check's time.
        build_repo(stack, repo, source=source, link=True, sparse=not run_lint)
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
        retired = retired_test_problems(stack, repo)
        if not retired:
            count = sum(len(e.retired) for e in stack.entries)
            print(f"ok: {count} retired tests, each gone after its entry")
        problems += retired
        tree = git_text(repo, "rev-parse", "HEAD^{tree}").strip()
        if am_onto_base(repo, format_patches(repo)) != tree:
            problems.append("git am of the export does not reproduce the stack")
        else:
            print("ok: export round trip (git am onto pristine) reproduces the stack")
        if run_lint:
            problems += lint.run_upstream_hooks(repo, touched_files(stack))
    return problems

"""Prefix check: every prefix of the stack builds and passes its top entry's tests.

A stacked PR is merged one at a time, so entry k must work on entries 1..k
alone. For each prefix of the series this builds the patched vLLM of that
prefix (the CPU repack ``./wb build`` does) into its own environment,
``build/prefix/NN-<entry>/venv``, and runs from that prefix's materialized
tree:

- the entry's own tests (the test files it adds), which must pass;
- upstream's tests of what it touches: the upstream test files it edits, and
  the test files of the regress selection that import a module it changes.

Outcomes are compared with the unpatched baseline as ``wb regress`` does (a
test an entry up to k retires is not a regression). The report has one line
per entry.

A prefix environment holds only the prefix's vLLM wheel (``--no-deps``); its
dependencies come from the project's ``.venv`` through a ``.pth`` file. The
environment's own site-packages comes first on ``sys.path``, so ``import
vllm`` is the prefix's build (``regress`` prints where it imports it from).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from workbench import build, devenv, regress
from workbench.errors import WorkbenchError
from workbench.materialize import materialize
from workbench.stack import Entry, Stack, split_patch

PREFIX_DIR = Path("build") / "prefix"


def _is_test_file(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return (
        path.startswith("tests/") and name.startswith("test_") and name.endswith(".py")
    )


def module_name(path: str) -> str | None:
    """The dotted import name of a vllm source file; None for other paths."""
    if path.startswith("vllm/") and path.endswith(".py"):
        return path[: -len(".py")].removesuffix("/__init__").replace("/", ".")
    return None


def changed_modules(entry: Entry) -> list[str]:
    """Dotted names of the existing vllm modules the entry's patch changes."""
    names = (module_name(section.path) for section in split_patch(entry.patch))
    return sorted(name for name in names if name)


def imported_modules(source: str) -> set[str]:
    """Every absolute module name ``source`` imports, with ``from m import x``
    giving both ``m`` and ``m.x``."""
    try:
        body = ast.parse(source)
    except SyntaxError:
        return set()
    found: set[str] = set()
    for node in ast.walk(body):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


@dataclass(frozen=True)
class PrefixPlan:
    """What runs for the prefix ending at ``entry`` (1-based ``index``)."""

    index: int
    entry: str
    own_tests: list[str]
    upstream_tests: list[str]

    @property
    def label(self) -> str:
        return f"{self.index:02d}-{self.entry}"

    @property
    def selection(self) -> list[str]:
        return [*self.own_tests, *self.upstream_tests]


def plan(
    stack: Stack, index: int, tree: Path, scope: Sequence[str] = regress.SELECTION
) -> PrefixPlan:
    """The tests of the prefix ending at entry ``index`` (1-based), found in
    ``tree`` (that prefix's materialized tree); upstream's tests only under
    ``scope``."""
    entry = stack.entries[index - 1]
    added = set(stack.owner_of())
    own = sorted(p for p in entry.owned if _is_test_file(p))
    edited = {
        s.path
        for s in split_patch(entry.patch)
        if _is_test_file(s.path) and s.path not in added
    }
    modules = set(changed_modules(entry))
    importing = set()
    for root in scope:
        base = tree / root
        files = [base] if base.is_file() else sorted(base.rglob("test_*.py"))
        for path in files:
            rel = path.relative_to(tree).as_posix()
            if rel in added or not _is_test_file(rel):
                continue
            if imported_modules(path.read_text()) & modules:
                importing.add(rel)
    upstream = sorted(
        p for p in edited | importing if regress.in_selection(p, scope)
    ) + sorted(p for p in edited if not regress.in_selection(p, scope))
    return PrefixPlan(index, entry.name, own, upstream)


@dataclass
class PrefixResult:
    plan: PrefixPlan
    counts: dict[str, int] = field(default_factory=dict)
    regressions: list[tuple[str, str]] = field(default_factory=list)
    retired: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and not self.regressions

    def line(self) -> str:
        name = f"entry {self.plan.index} {self.plan.entry}"
        if self.error:
            return f"{name}: FAILED: {self.error}"
        tally = ", ".join(f"{n} {o}" for o, n in self.counts.items() if n)
        verdict = "ok" if self.ok else f"{len(self.regressions)} regressions"
        return (
            f"{name}: {verdict} ({len(self.plan.own_tests)} own test files, "
            f"{len(self.plan.upstream_tests)} upstream; {tally or 'nothing ran'}"
            f"{f', {self.retired} retired' if self.retired else ''})"
        )


def prefix_digest(prefix: Stack) -> str:
    """A digest of what goes into a prefix's wheel."""
    digest = hashlib.sha256()
    for module in devenv.BUILD_MODULES:
        digest.update((Path(__file__).parent / f"{module}.py").read_bytes())
    for entry in prefix.entries:
        digest.update(entry.name.encode() + b"\0" + entry.patch.encode() + b"\0")
        for path in entry.owned:
            digest.update(path.encode() + b"\0" + prefix.added_file(path) + b"\0")
    return digest.hexdigest()


def site_packages(python: Path) -> Path:
    out = subprocess.run(
        [
            str(python),
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


def overlay_env(
    env_dir: Path, deps_python: Path, install: Callable[[Path], None]
) -> Path:
    """A fresh environment at ``env_dir`` whose own site-packages, filled by
    ``install(site_packages)``, comes before ``deps_python``'s packages (a
    ``.pth`` file), so its vllm shadows theirs. Returns its python."""
    subprocess.run(
        [str(deps_python), "-m", "venv", "--clear", "--without-pip", str(env_dir)],
        check=True,
    )
    python = env_dir / "bin" / "python"
    target = site_packages(python)
    install(target)
    # After the environment's own site-packages, which Python reads first.
    (target / "kvlc-deps.pth").write_text(f"{site_packages(deps_python)}\n")
    return python


def ensure_prefix_env(prefix: Stack, where: Path, deps_python: Path) -> Path:
    """The python of ``where/venv``: the prefix's CPU build over ``deps_python``'s
    packages; rebuilt only when the prefix changed."""
    env_dir = where / "venv"
    python = env_dir / "bin" / "python"
    marker = env_dir / "kvlc-prefix"
    digest = prefix_digest(prefix)
    if marker.is_file() and marker.read_text() == digest:
        print(f"{env_dir}: up to date", flush=True)
        return python
    wheel = build.build_cpu(prefix, where / "dist")

    def install(target: Path) -> None:
        pip = [str(deps_python), "-m", "pip", "install", "--quiet", "--no-deps"]
        if subprocess.call([*pip, "--no-compile", "--target", str(target), str(wheel)]):
            raise WorkbenchError(f"installing {wheel.name} into {env_dir} failed")

    overlay_env(env_dir, deps_python, install)
    marker.write_text(digest)
    return python


Builder = Callable[[Stack, Path], Path]
TreeMaker = Callable[[Stack, Path], object]
Runner = Callable[[Path, Path, list[str], Path], dict[str, str]]


def _run_tests(
    python: Path, tree: Path, selection: list[str], junit: Path
) -> dict[str, str]:
    return regress.run_tests(python, tree, selection, junit=junit).outcomes


def check_prefixes(
    stack: Stack,
    root: Path,
    *,
    only: Sequence[str] = (),
    scope: Sequence[str] = regress.SELECTION,
    builder: Builder,
    runner: Runner = _run_tests,
    baseline: set[str] | None = None,
    make_tree: TreeMaker = lambda prefix, tree: materialize(prefix, tree, force=True),
    prefix_dir: Path = PREFIX_DIR,
) -> list[PrefixResult]:
    """Build and test every prefix (or those ending at an entry in ``only``),
    each in the tree ``make_tree`` makes (default: materialized on the pinned
    release), under ``root / prefix_dir``."""
    unknown = set(only) - {e.name for e in stack.entries}
    if unknown:
        raise WorkbenchError(
            f"no entry {', '.join(sorted(unknown))} in patches/series; "
            f"the entries are {', '.join(e.name for e in stack.entries)}"
        )
    if baseline is None:
        baseline = regress.read_baseline(regress.BASELINE)
    results = []
    for index, entry in enumerate(stack.entries, 1):
        if only and entry.name not in only:
            continue
        prefix = replace(stack, entries=stack.entries[:index])
        where = root / prefix_dir / f"{index:02d}-{entry.name}"
        tree = where / "tree"
        print(f"=== prefix {index}: {entry.name}", flush=True)
        make_tree(prefix, tree)
        prefix_plan = plan(prefix, index, tree, scope)
        result = PrefixResult(prefix_plan)
        try:
            python = builder(prefix, where)
            outcomes = runner(python, tree, prefix_plan.selection, where / "junit.xml")
        except WorkbenchError as e:
            result.error = str(e).splitlines()[0]
            results.append(result)
            print(result.line(), flush=True)
            continue
        retired = [(e.name, t) for e in prefix.entries for t in e.retired]
        must_pass = prefix_plan.own_tests + regress.stack_added_tests(
            tree, prefix_plan.upstream_tests
        )
        comparison = regress.compare(
            baseline, outcomes, prefix_plan.selection, must_pass, retired
        )
        result.counts = regress.counts(outcomes)
        result.regressions = comparison.regressions
        result.retired = len(comparison.retired)
        results.append(result)
        print(result.line(), flush=True)
    return results


def main(stack: Stack, root: Path, argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="wb prefix-check", description=__doc__)
    p.add_argument(
        "--entry",
        action="append",
        default=[],
        help="only the prefix ending at this entry (repeatable)",
    )
    p.add_argument(
        "--fast", action="store_true", help="upstream's tests from the CI subset only"
    )
    args = p.parse_args(argv)
    deps_python = devenv.ensure(root)
    scope = regress.FAST_SELECTION if args.fast else regress.SELECTION
    results = check_prefixes(
        stack,
        root,
        only=args.entry,
        scope=scope,
        builder=lambda prefix, where: ensure_prefix_env(prefix, where, deps_python),
    )
    return report(results)


def report(results: Sequence[PrefixResult]) -> int:
    """Print one line per prefix and its regressions; the exit status."""
    print("=== prefix check, per entry")
    for result in results:
        print(result.line())
        for node, outcome in result.regressions:
            print(f"  REGRESSION: {node} ({outcome})")
    failed = [r for r in results if not r.ok]
    print(f"prefix-check: {len(results) - len(failed)} of {len(results)} prefixes ok")
    sys.stdout.flush()
    return 1 if failed else 0

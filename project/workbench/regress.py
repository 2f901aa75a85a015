"""Regress: upstream's own tests against an installed vLLM build, compared with
the tests that pass on the unpatched release.

The tests come from the pristine sdist (or, with ``--tests-from``, from another
tree of the same layout, e.g. a materialized stack, to run the stack's own tests
too). They run under the interpreter of the build under test (``--python``),
from a scratch root directory that mirrors the tree *without* its ``vllm/``
package, so ``import vllm`` resolves to the installed build; that is checked
before the run. They run offline against a small Hugging Face cache
(``hf_fixture``). Outcomes are read from pytest's JUnit XML.

Every test in the baseline (``data/baseline-vllm-<release>-cpu.txt``: the node
ids that pass on the unpatched build) that is part of the selection and does
not pass now is a regression, printed by node id; the exit status is then 1.
Tests that pass now but are not in the baseline are only counted.
``--record`` writes the baseline from a run instead of comparing.

``--stack`` tests the stack itself: the tests come from a freshly
materialized tree, the test files the stack adds or changes join the
selection, and every test in a file the stack adds must pass (a skip is
allowed; a failure or error is a regression like any other).

A baseline test an entry retires (``patches/<entry>/retired-tests``: removed,
renamed or rewritten on purpose) is not a regression when the stack is under
test: with ``--stack`` (the test is gone from the tree), or when the installed
build is a stack build (version ``+kvlc``; upstream's test of the old
behaviour may fail against it). Such tests are counted and listed with their
entry. The retirements are this checkout's stack's.

Upstream's pristine tests run against a stack build may also fail where an
entry changed what they assert on: such a failure is not a regression when
the entry declares the edit of the test's file, or of a tests/ module or
conftest.py it imports (``patches/<entry>/edited-tests``, see ``edited.py``).
It is listed (``EDITED:``) and counted per entry; an undeclared one stays a
regression.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from workbench import edited, stack, upstream
from workbench.build import LOCAL_LABEL
from workbench.errors import WorkbenchError
from workbench.gitutil import git_status
from workbench.hf_fixture import write_hf_cache
from workbench.materialize import copy_tree, materialize

ROOT = Path(__file__).resolve().parents[2]
# A throwaway tree: --stack rebuilds it every run, so it never holds work.
STACK_TREE = Path("build") / "regress-tree"
BASELINE = Path(__file__).parent / "data" / f"baseline-vllm-{upstream.RELEASE}-cpu.txt"

# The scheduler, prefix caching, KV cache sizing, and every KV connector's unit
# tests (SimpleCPUOffload's live apart): what the stack's entries change
# behaviour for.
SELECTION = (
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/core/test_kv_cache_utils.py",
    "tests/v1/kv_connector/unit",
    "tests/v1/simple_kv_offload",
)
# The CI subset (--fast), about a third of the full run's time on 2 cores: the
# scheduler's tests and the KV connector unit tests, minus the slowest files of
# connectors the stack does not touch (NIXL, Mooncake, MoRIIO descriptor and
# worker sweeps) and the offloading connector's scheduler sweep. Chosen from the
# per-file durations of the baseline run (`--file-durations`).
FAST_SELECTION = (
    "tests/v1/core/test_scheduler.py",
    "tests/v1/kv_connector/unit/test_cache_pollution_prevention.py",
    "tests/v1/kv_connector/unit/test_config.py",
    "tests/v1/kv_connector/unit/test_decode_bench_connector.py",
    "tests/v1/kv_connector/unit/test_error_propagation.py",
    "tests/v1/kv_connector/unit/test_example_connector.py",
    "tests/v1/kv_connector/unit/test_hma_auto_config.py",
    "tests/v1/kv_connector/unit/test_invalid_blocks_correctness.py",
    "tests/v1/kv_connector/unit/test_kv_connector_lifecycle.py",
    "tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py",
    "tests/v1/kv_connector/unit/test_lmcache_connector.py",
    "tests/v1/kv_connector/unit/test_lmcache_integration.py",
    "tests/v1/kv_connector/unit/test_multi_connector.py",
    "tests/v1/kv_connector/unit/test_offloading_connector.py",
    "tests/v1/kv_connector/unit/test_output_aggregator.py",
    "tests/v1/kv_connector/unit/test_remote_decode_lifecycle.py",
    "tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py",
    "tests/v1/kv_connector/unit/test_scheduler_kv_connector_override.py",
    "tests/v1/kv_connector/unit/test_simple_cpu_offload_connector.py",
    "tests/v1/kv_connector/unit/test_simple_cpu_offload_metrics.py",
    "tests/v1/kv_connector/unit/offloading_connector/test_config.py",
    "tests/v1/kv_connector/unit/offloading_connector/test_events.py",
    "tests/v1/kv_connector/unit/offloading_connector/test_metrics.py",
    "tests/v1/kv_connector/unit/offloading_connector/test_worker.py",
    "tests/v1/kv_connector/unit/offloading_connector/test_worker_metadata.py",
    # Under a minute; SimpleCPUOffload is migrated by the scheduler-context entry.
    "tests/v1/simple_kv_offload",
)
# Loaded into every run (``-p``) from its own folder, so that no other
# workbench module becomes importable by the tests.
PYTEST_PLUGINS = Path(__file__).parent / "pytest_plugins"
CPU_UNIT_PLUGIN = "kvlc_cpu_unit_tests"
# A hang must fail one test, not the run; the slowest test of the baseline run
# takes about 40 s on 2 cores.
TEST_TIMEOUT_S = 300
# What the scratch root leaves out of the tree: the source package (the point of
# the exercise) and its metadata, which would make importlib.metadata report
# the tree as an installed vllm.
_NOT_MIRRORED = ("vllm", "vllm.egg-info", "tests", "pyproject.toml")

# Run by the target interpreter, from the scratch root, like pytest will be.
_LOCATE = """
import importlib.metadata as md, json, sys
name = sys.argv[1]
module = __import__(name)
dists = md.packages_distributions().get(name, [])
version = getattr(module, "__version__", None)
dist = dists[0] if dists else None
print(json.dumps({"file": module.__file__, "version": version, "dist": dist}))
"""


@dataclass(frozen=True)
class Installed:
    """Where the target interpreter imports the package under test from."""

    file: Path
    version: str | None
    dist: str | None


@dataclass(frozen=True)
class Run:
    """One pytest run: node id -> outcome, the build tested, wall time."""

    outcomes: dict[str, str]
    installed: Installed | None
    seconds: float


@dataclass(frozen=True)
class Comparison:
    """A run against a baseline: regressions as (node id, outcome now), and
    the baseline tests the stack retires as (node id, outcome now, entry)."""

    regressions: list[tuple[str, str]]
    new_passes: list[str]
    retired: list[tuple[str, str, str]] = field(default_factory=list)


def mirror_tree(tests_root: Path, dest: Path) -> None:
    """Make ``dest`` a pytest root like ``tests_root`` but without ``vllm/``.

    ``tests/`` is copied (pytest may write bytecode next to it; the pristine
    tree stays read-only) and so is ``pyproject.toml`` (pytest's markers and
    options); every other top-level entry is symlinked, because some tests read
    files such as ``examples/`` relative to the repository root.
    """
    if not (tests_root / "tests").is_dir():
        raise WorkbenchError(f"{tests_root} has no tests/ directory")
    dest.mkdir(parents=True, exist_ok=True)
    copy_tree(tests_root / "tests", dest / "tests")
    if (tests_root / "pyproject.toml").is_file():
        shutil.copyfile(tests_root / "pyproject.toml", dest / "pyproject.toml")
    for entry in sorted(tests_root.iterdir()):
        if entry.name not in _NOT_MIRRORED and not entry.name.endswith(".egg-info"):
            (dest / entry.name).symlink_to(entry.resolve())


def locate(python: Path, module: str, cwd: Path, env: Mapping[str, str]) -> Installed:
    """Where ``python`` started in ``cwd`` imports ``module`` from."""
    found = subprocess.run(
        [str(python), "-c", _LOCATE, module],
        cwd=cwd,
        env=dict(env),
        capture_output=True,
        text=True,
        check=False,
    )
    if found.returncode != 0:
        raise WorkbenchError(
            f"{python} cannot import {module}:\n{found.stderr[-2000:]}"
        )
    info = json.loads(found.stdout.strip().splitlines()[-1])
    return Installed(Path(info["file"]).resolve(), info["version"], info["dist"])


def offline_env(hf_home: Path) -> dict[str, str]:
    """The environment upstream's tests run in: offline, CPU-sized."""
    return {
        **os.environ,
        "HF_HOME": str(write_hf_cache(hf_home)),
        # Without it each lookup of a model that is not in the fixture retries
        # for about 30 s before failing.
        "HF_HUB_OFFLINE": "1",
        # Otherwise an engine a test starts sizes its KV cache from a share of
        # the machine's memory.
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        # Keep the output's tracebacks and summary lines readable in CI logs.
        "COLUMNS": os.environ.get("COLUMNS", "160"),
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(PYTEST_PLUGINS), os.environ.get("PYTHONPATH")) if p
        ),
    }


def pytest_command(
    python: Path, selection: Sequence[str], junit: Path, extra: Sequence[str] = ()
) -> list[str]:
    """The pytest invocation of a regress run, run from the scratch root."""
    return [
        str(python),
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-p",
        CPU_UNIT_PLUGIN,
        "--rootdir=.",
        f"--junitxml={junit}",
        f"--timeout={TEST_TIMEOUT_S}",
        # A module that cannot be imported here (ray, GPU-only dependencies)
        # must not stop the run: it is one error, its tests are not run.
        "--continue-on-collection-errors",
        "-q",
        "-rfE",
        *extra,
        *selection,
    ]


def run_tests(
    python: Path,
    tests_root: Path,
    selection: Sequence[str],
    *,
    junit: Path,
    extra: Sequence[str] = (),
    module: str | None = "vllm",
) -> Run:
    """Run ``selection`` (paths relative to ``tests_root``) under ``python``.

    Before running, checks that ``module`` imports from outside both the
    scratch root and ``tests_root`` (``None`` skips the check). Writes pytest's
    JUnit XML to ``junit``; the outcomes are ``passed``, ``failed``, ``error``
    or ``skipped`` by node id. Raises ``WorkbenchError`` when pytest
    did not complete a run (usage error, interrupted, nothing collected).
    """
    with tempfile.TemporaryDirectory(prefix="kvlc-regress-") as tmp:
        work = Path(tmp) / "root"
        mirror_tree(tests_root, work)
        env = offline_env(Path(tmp) / "hf")
        installed = None
        if module is not None:
            installed = locate(python, module, work, env)
            # The scratch root has no vllm/; a hit there or in the tree's own
            # package means the run would test sources, not the build.
            sources = (work.resolve(), tests_root.resolve() / module)
            if any(installed.file.is_relative_to(s) for s in sources):
                raise WorkbenchError(
                    f"{module} resolves to {installed.file}, a source tree, "
                    "not the installed build"
                )
            print(
                f"testing {installed.dist or module} {installed.version} "
                f"imported from {installed.file}",
                flush=True,
            )
        junit.parent.mkdir(parents=True, exist_ok=True)
        junit.unlink(missing_ok=True)
        cmd = pytest_command(python, selection, junit.resolve(), extra)
        print(f"$ {shlex.join(cmd)}", flush=True)
        started = time.monotonic()
        status = subprocess.run(cmd, cwd=work, env=env, check=False).returncode
        seconds = time.monotonic() - started
        # 0: all passed, 1: some failed; anything else is not a complete run.
        if status not in (0, 1) or not junit.exists():
            raise WorkbenchError(
                f"pytest did not complete a run (exit status {status})"
            )
        return Run(read_junit(junit, work), installed, seconds)


def _node_id(classname: str, name: str, tree: Path) -> str:
    """Undo pytest's JUnit mangling of a node id (``/`` -> ``.``, no ``.py``).

    The module part is the longest dotted prefix of ``classname`` that names a
    ``.py`` file under ``tree``; the rest are class names. A collection report
    has an empty classname and the dotted path of a module or directory as name.
    """
    if not classname:
        path = name.replace(".", "/")
        return f"{path}.py" if (tree / f"{path}.py").is_file() else path
    parts = classname.split(".")
    for k in range(len(parts), 0, -1):
        module = "/".join(parts[:k]) + ".py"
        if (tree / module).is_file():
            return "::".join([module, *parts[k:], name])
    return f"{classname}::{name}"


def read_junit(junit: Path, tree: Path) -> dict[str, str]:
    """Node id -> outcome from pytest's JUnit XML of a run rooted at ``tree``.

    A test passed when its testcase has no failure, error or skipped child; a
    failure and an error (e.g. in teardown) together count as ``failed``.
    """
    outcomes: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        node = _node_id(case.get("classname", ""), case.get("name", ""), tree)
        if "failure" in tags:
            outcomes[node] = "failed"
        elif "error" in tags:
            outcomes[node] = "error"
        elif "skipped" in tags:
            outcomes[node] = "skipped"
        else:
            outcomes[node] = "passed"
    return outcomes


def file_durations(junit: Path, tree: Path) -> list[tuple[str, float, int]]:
    """(test file, seconds, test cases) per file of a JUnit XML, slowest first.

    The seconds are each test's setup + call + teardown (pytest's default
    ``junit_duration_report``); collection time is not included.
    """
    totals: dict[str, tuple[float, int]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        node = _node_id(case.get("classname", ""), case.get("name", ""), tree)
        path = node.split("::", 1)[0]
        seconds, count = totals.get(path, (0.0, 0))
        totals[path] = (seconds + float(case.get("time", 0)), count + 1)
    rows = [(path, s, n) for path, (s, n) in totals.items()]
    return sorted(rows, key=lambda row: (-row[1], row[0]))


def format_durations(rows: Iterable[tuple[str, float, int]]) -> str:
    rows = list(rows)
    total = sum(seconds for _, seconds, _ in rows)
    lines = [f"# seconds  tests  file  (total {total:.1f} s)"]
    lines += [f"{seconds:9.1f}  {count:5d}  {path}" for path, seconds, count in rows]
    return "\n".join(lines) + "\n"


def counts(outcomes: Mapping[str, str]) -> dict[str, int]:
    values = list(outcomes.values())
    return {o: values.count(o) for o in ("passed", "failed", "error", "skipped")}


def read_baseline(path: Path) -> set[str]:
    """The node ids of a baseline file (``#`` lines are comments)."""
    if not path.is_file():
        raise WorkbenchError(f"no baseline at {path}; record one with --record")
    lines = path.read_text().splitlines()
    return {line for line in lines if line and not line.startswith("#")}


def write_baseline(
    path: Path, outcomes: Mapping[str, str], header: Sequence[str]
) -> None:
    """Write the passing node ids, sorted, after ``header`` as ``#`` comments."""
    passed = sorted(n for n, o in outcomes.items() if o == "passed")
    path.write_text(
        "".join(f"# {line}\n" for line in header) + "\n".join(passed) + "\n"
    )


def in_selection(node_id: str, selection: Sequence[str]) -> bool:
    """Whether ``node_id`` lies under one of the selected paths or node ids
    (a test's parametrizations included)."""
    for chosen in selection:
        chosen = chosen.rstrip("/")
        if node_id == chosen or node_id.startswith(
            (chosen + "/", chosen + "::", chosen + "[")
        ):
            return True
    return False


def _test_names(source: str) -> set[str]:
    """The tests a test module's ``source`` defines, as pytest names them
    after the file's path: ``test_x`` or ``TestY::test_x``."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if node.name.startswith("test"):
                names.add(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            names |= {
                f"{node.name}::{method.name}"
                for method in node.body
                if isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef)
                and method.name.startswith("test")
            }
    return names


def stack_added_tests(tree: Path, changed: Sequence[str]) -> list[str]:
    """The tests the stack adds to the upstream test files ``changed``, by
    node id: those of ``tree`` (a materialized stack) that the release
    (``refs/kvlc/base`` there) does not define. They must pass: not being in
    the baseline does not make their failures the release's."""
    if git_status(tree, "rev-parse", "--verify", "-q", "refs/kvlc/base").returncode:
        raise WorkbenchError(
            f"{tree} has no refs/kvlc/base: materialize the stack there first"
        )
    added: list[str] = []
    for path in changed:
        ours = tree / path
        if not ours.is_file():
            continue
        theirs = git_status(tree, "show", f"refs/kvlc/base:{path}")
        release = theirs.stdout.decode() if theirs.returncode == 0 else ""
        new = _test_names(ours.read_text()) - _test_names(release)
        added += [f"{path}::{name}" for name in sorted(new)]
    return added


def stack_test_files(root: Path) -> tuple[list[str], list[str]]:
    """The test files the stack at ``root`` adds, and the upstream ones it changes."""
    entries = stack.load(root).entries

    def is_test(path: str) -> bool:
        name = path.rsplit("/", 1)[-1]
        return path.startswith("tests/") and name.startswith("test_")

    added = [p for e in entries for p in e.owned if is_test(p) and p.endswith(".py")]
    changed = {p for e in entries for p in stack.patch_files(e.patch) if is_test(p)}
    return added, sorted(changed - set(added))


def stack_retired(root: Path) -> list[tuple[str, stack.RetiredTest]]:
    """(entry, retired test) for every test the stack at ``root`` retires."""
    return [(e.name, t) for e in stack.load(root).entries for t in e.retired]


def is_stack_build(installed: Installed | None) -> bool:
    version = installed.version if installed else None
    return f"+{LOCAL_LABEL}" in (version or "")


def compare(
    baseline: set[str],
    outcomes: Mapping[str, str],
    selection: Sequence[str],
    must_pass: Sequence[str] = (),
    retired: Sequence[tuple[str, stack.RetiredTest]] = (),
) -> Comparison:
    """The baseline tests in ``selection`` that did not pass, and new passes.

    A baseline test missing from ``outcomes`` is a regression ``not run``
    (renamed, removed, or its module no longer imports), unless an entry
    retires it (``retired``: (entry, test)); so is one that failed. So is every
    test under ``must_pass`` that failed or errored.
    """
    expected = sorted(n for n in baseline if in_selection(n, selection))
    regressions = []
    excused = []
    for n in expected:
        outcome = outcomes.get(n, "not run")
        if outcome == "passed":
            continue
        entry = next((e for e, test in retired if test.covers(n)), None)
        if entry is None:
            regressions.append((n, outcome))
        else:
            excused.append((n, outcome, entry))
    regressions += sorted(
        (n, o)
        for n, o in outcomes.items()
        if o in ("failed", "error") and n not in baseline and in_selection(n, must_pass)
    )
    new_passes = sorted(
        n for n, o in outcomes.items() if o == "passed" and n not in baseline
    )
    return Comparison(regressions, new_passes, excused)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="wb regress",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Arguments after -- go to pytest as they are.",
    )
    p.add_argument(
        "--python",
        type=Path,
        default=ROOT / ".venv" / "bin" / "python",
        help="interpreter of the build under test (default: .venv)",
    )
    p.add_argument("--fast", action="store_true", help="the CI subset")
    p.add_argument(
        "--tests-from",
        type=Path,
        help="take tests/ from this tree (default: the pristine sdist)",
    )
    p.add_argument(
        "--stack",
        action="store_true",
        help="test the stack: tests from a fresh materialized tree, plus the "
        "stack's own test files, which must pass",
    )
    p.add_argument(
        "--stack-tree",
        type=Path,
        help="as --stack, with the stack in this tree (./wb derive's) instead "
        "of a freshly materialized one",
    )
    p.add_argument("--baseline", type=Path, default=BASELINE)
    p.add_argument(
        "--record",
        action="store_true",
        help="write the baseline from this run (use the unpatched build)",
    )
    p.add_argument(
        "--made-by",
        metavar="COMMAND",
        help="with --record: the command the baseline's header names "
        "(default: this wb regress command)",
    )
    p.add_argument("--junit", type=Path, help="keep pytest's JUnit XML here")
    p.add_argument(
        "--file-durations", type=Path, help="write seconds per test file here"
    )
    p.add_argument(
        "--summary-json",
        type=Path,
        help="write the verdict's counts here (passed, regressions, "
        "known_failures, retired, skipped), for ./wb test",
    )
    p.add_argument(
        "paths", nargs="*", help="test paths (default: the standard selection)"
    )
    return p


def main(argv: Sequence[str]) -> int:
    """``wb regress``: run, then compare with (or ``--record``) the baseline.

    Returns 1 when a baseline test regressed, else 0.
    """
    argv = list(argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    args = _parser().parse_args(argv)
    selection = args.paths or list(FAST_SELECTION if args.fast else SELECTION)
    must_pass: list[str] = []
    args.stack = args.stack or args.stack_tree is not None
    if args.stack:
        if args.tests_from or args.record:
            raise WorkbenchError(
                "--stack takes its tests from the stack itself; "
                "drop --tests-from / --record"
            )
        tree = args.stack_tree or ROOT / STACK_TREE
        if args.stack_tree is None:
            materialize(stack.load(ROOT), tree, force=True)
        must_pass, changed = stack_test_files(ROOT)
        selection += [p for p in [*must_pass, *changed] if p not in selection]
        must_pass += stack_added_tests(tree, changed)
        args.tests_from = tree
    tests_root = (args.tests_from or upstream.pristine_tree()).resolve()
    with tempfile.TemporaryDirectory(prefix="kvlc-junit-") as tmp:
        junit = args.junit or Path(tmp) / "junit.xml"
        # Absolute, not resolved: pytest runs from the scratch root, and a venv's
        # python is a symlink that must stay one to find its site-packages.
        python = args.python.absolute()
        run = run_tests(python, tests_root, selection, junit=junit, extra=extra)
        if args.file_durations:
            durations = format_durations(file_durations(junit, tests_root))
            args.file_durations.write_text(durations)
    tally = ", ".join(f"{n} {o}" for o, n in counts(run.outcomes).items())
    print(f"regress: pytest outcomes: {tally} in {run.seconds / 60:.1f} min")
    if args.record:
        if "passed" not in run.outcomes.values():
            raise WorkbenchError("no test passed; not recording an empty baseline")
        build = run.installed or Installed(Path(), None, None)
        name, version = build.dist or "vllm", build.version or "?"
        header = [
            f"Upstream tests that pass on the unpatched {name} {version} build,",
            "offline, on CPU, from the pristine sdist's tests/.",
            f"Selection: {' '.join(selection)}",
            f"Outcomes: {tally} ({run.seconds / 60:.0f} min on {os.cpu_count()} cores)",
        ]
        if args.made_by:
            header.append(f"Command: {args.made_by}")
        else:
            command = ["./wb", "regress", "--record", "--python", "<python>"]
            command += ["--fast"] if args.fast else []
            command += args.paths
            header += [
                f"Command: {shlex.join(command)}",
                f"  (<python>: an interpreter with {name}=={version} and "
                "project/requirements-test.txt)",
            ]
        write_baseline(args.baseline, run.outcomes, header)
        passed = counts(run.outcomes)["passed"]
        print(f"recorded {passed} passing tests in {args.baseline}")
        return 0
    stack_under_test = args.stack or is_stack_build(run.installed)
    retired = stack_retired(ROOT) if stack_under_test else []
    result = compare(
        read_baseline(args.baseline), run.outcomes, selection, must_pass, retired
    )
    explained: list[tuple[str, str, str]] = []
    if stack_under_test and args.tests_from is None:
        explained, kept = edited.split_declared(
            result.regressions, tests_root, stack.load(ROOT)
        )
        result = replace(result, regressions=kept)
        for line in edited.per_entry_lines(explained, stack.load(ROOT)):
            print(line)
    print(f"{len(result.new_passes)} tests pass that are not in the baseline")
    for node, outcome, entry in explained:
        print(f"EDITED: {node} ({outcome}) by {entry}, declared in its edited-tests")
    for node, outcome, entry in result.retired:
        print(f"RETIRED: {node} ({outcome}) by {entry}")
    for node, outcome in result.regressions:
        print(f"REGRESSION: {node} ({outcome})")
    accounted = (
        {n for n, _ in result.regressions}
        | {n for n, *_ in result.retired}
        | {n for n, *_ in explained}
    )
    known = [
        n
        for n, o in run.outcomes.items()
        if o in ("failed", "error") and n not in accounted
    ]
    # pytest's own "N failed" above counts these too: say they are not news.
    print(
        f"regress: {len(known)} of pytest's failures and errors are known: "
        f"not in {args.baseline.name}, they fail on the unpatched release too"
    )
    summary = f"{len(result.regressions)} regressions against {args.baseline.name}"
    if stack_under_test:
        summary += f", {len(result.retired)} retired by the stack"
    if explained:
        summary += f", {len(explained)} in upstream tests the stack declares edited"
    verdict = "FAIL" if result.regressions else "PASS"
    if args.summary_json:
        tallies = counts(run.outcomes)
        args.summary_json.write_text(
            json.dumps(
                {
                    "passed": tallies["passed"],
                    "regressions": len(result.regressions),
                    "known_failures": len(known),
                    "retired": len(result.retired),
                    "edited": len(explained),
                    "skipped": tallies["skipped"],
                }
            )
        )
    print(f"regress: {verdict}: {summary}")
    return 1 if result.regressions else 0

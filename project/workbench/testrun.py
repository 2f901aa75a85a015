"""``./wb test``: everything CI runs, from a fresh clone, with one verdict.

First the system packages the end-to-end tests need (``project/ci/
system-packages``: installed when possible, else it stops at once with one
line); then the jobs, shared among lanes that run side by side by the
times a clean-clone run measured (``workbench.lanes``): the project's hooks,
upstream's and the stack's tests (``wb regress``), the same on the newest
release (``wb release-test --fast``), and each test file of the project, the
workbench's own (``WORKBENCH_TESTS``) among them. ``.venv`` is made beside
the lanes, which meanwhile run the jobs that do not use it (the newest
release's tests, the workbench's own in an environment of pytest alone).
Lane 0 first makes the side environments (the unpatched release's,
LMCache's, the newest release's; kept in the cache folder and remade only
when their inputs change), which the end-to-end tests wait for. Each job's
output is held in a log and printed at the end, each step with one verdict
line; the last line counts tests in the form CI runners read (``N passed, M
failed``), where a failure of the unpatched release that the patched build
shares is not counted: only regressions are. A time table closes the run:
the machine, the CPU time spent, each step's wall time and the slowest test
files (from the steps' JUnit XML, kept in the logs' folder), slowest first;
the times measured go to ``build/wb-test/test-times.json``.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from bench import machine

from workbench import derive, devenv, lanes, regress, release_test, syspkgs, upstream
from workbench.errors import WorkbenchError
from workbench.tools import tools_python


@dataclass
class Verdict:
    """One step's outcome: tests passed and failed, and its verdict line."""

    name: str
    passed: int
    failed: int
    detail: str
    seconds: float = 0.0  # its wall time, set by ``_timed``

    def line(self) -> str:
        word = "FAIL" if self.failed else "PASS"
        return f"=== {self.name}: {word}: {self.detail}"


def _timed(step: Callable[[], Verdict]) -> Verdict:
    """``step``'s verdict, with its wall time."""
    start = time.monotonic()
    verdict = step()
    verdict.seconds = time.monotonic() - start
    return verdict


@contextmanager
def _clock(times: list[tuple[str, float]], name: str) -> Iterator[None]:
    """Add ``(name, wall time)`` of the ``with`` block to ``times``."""
    start = time.monotonic()
    try:
        yield
    finally:
        times.append((name, time.monotonic() - start))


def _call(
    cmd: list[str],
    root: Path,
    env: dict[str, str] | None = None,
    out: TextIO | None = None,
) -> int:
    """Run ``cmd``; it and its output go to ``out`` (a file; default: stdout)."""
    print(f"$ {' '.join(cmd)}", file=out or sys.stdout, flush=True)
    return subprocess.call(
        cmd,
        cwd=root,
        env={**os.environ, **(env or {})},
        stdout=out,
        stderr=None if out is None else subprocess.STDOUT,
    )


def _hooks(root: Path, tools: Path, out: TextIO | None = None) -> Verdict:
    """pre-commit's hooks; each hook is one test. The command and its output
    go to ``out`` (default: stdout)."""
    out = out or sys.stdout
    # mypy with no cache is most of the hooks' time: a clean clone's uses the
    # cache folder's, which mypy checks against each file's content before
    # it trusts an entry.
    cache = root / ".mypy_cache"
    if not cache.exists() and not cache.is_symlink():
        shared = upstream.cache_dir() / "mypy-cache"
        shared.mkdir(parents=True, exist_ok=True)
        cache.symlink_to(shared, target_is_directory=True)
    cmd = [str(tools), "-m", "pre_commit", "run", "--all-files", "--color", "never"]
    print(f"$ {' '.join(cmd)}", file=out, flush=True)
    proc = subprocess.run(
        cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    print(proc.stdout, end="", file=out, flush=True)
    results = re.findall(r"^(.*?)\.{3,}(?:\(.*\))?(Passed|Failed|Skipped)$",
                         proc.stdout, re.MULTILINE)  # fmt: skip
    failed = [name.strip() for name, result in results if result == "Failed"]
    passed = sum(result == "Passed" for _, result in results)
    if proc.returncode != 0 and not failed:
        failed = [f"pre-commit exited {proc.returncode}"]
    detail = f"{passed} hooks passed"
    if failed:
        detail += f", {len(failed)} failed: {', '.join(failed)}"
    return Verdict("project hooks", passed, len(failed), detail)


def _project_tests(
    root: Path,
    python: Path,
    env: dict[str, str],
    rest: list[str],
    paths: tuple[str, ...] = ("project/tests",),
    name: str = "project tests",
    out: TextIO | None = None,
    junit: Path | None = None,
) -> Verdict:
    """The project's pytest suite (``paths``), counted from
    its JUnit XML (kept at ``junit`` if given); its output goes to ``out``
    (a file; default: stdout)."""
    with tempfile.TemporaryDirectory(prefix="kvlc-test-") as tmp:
        junit = junit or Path(tmp) / "junit.xml"
        # Not the report of an earlier run, if this one writes none.
        junit.unlink(missing_ok=True)
        cmd = [str(python), "-m", "pytest", "-p", "no:cacheprovider"]
        # A passed test's files go at the session's end: the workbench's
        # tests alone leave 1.6 GB of trees and wheels, pytest keeps three
        # sessions, and a CI runner's disk is not much larger than that.
        cmd += ["-o", "tmp_path_retention_policy=failed"]
        # Every CI log shows where the time goes.
        cmd += ["--durations=25", f"--junitxml={junit}", *paths]
        cmd += rest
        status = _call(cmd, root, env, out)
        if not junit.exists():
            return Verdict(name, 0, 1, f"pytest exited {status}, no report")
        suites = ET.parse(junit).getroot().iter("testsuite")
        total = {k: 0 for k in ("tests", "failures", "errors", "skipped")}
        for suite in suites:
            for key in total:
                total[key] += int(suite.get(key, 0))
    failed = total["failures"] + total["errors"]
    passed = total["tests"] - failed - total["skipped"]
    # 5: pytest collected nothing (``rest`` selected no test of these paths).
    if status not in (0, 5) and not failed:
        failed = 1  # pytest itself failed (usage error, interrupted)
    detail = f"{passed} passed, {failed} failed, {total['skipped']} skipped"
    return Verdict(name, passed, failed, detail)


def _regress_step(
    root: Path,
    name: str,
    args: list[str],
    out: TextIO | None = None,
    junit: Path | None = None,
) -> Verdict:
    """``wb <args> --summary-json``, a ``wb regress`` run: only regressions
    count as failures. Its output goes to ``out`` (a file; default: stdout),
    its JUnit XML to ``junit`` if given."""
    with tempfile.TemporaryDirectory(prefix="kvlc-test-") as tmp:
        summary = Path(tmp) / "summary.json"
        cmd = [sys.executable, str(root / "wb"), *args, "--summary-json", str(summary)]
        if junit is not None:
            cmd += ["--junit", str(junit)]
        status = _call(cmd, root, out=out)
        if not summary.exists():
            return Verdict(name, 0, 1, f"wb {args[0]} exited {status} with no verdict")
        counts = json.loads(summary.read_text())
    detail = (
        f"{counts['regressions']} regressions, {counts['passed']} passed, "
        f"{counts['retired']} retired by the stack; {counts['known_failures']} "
        "failures the unpatched release has too are not counted"
    )
    return Verdict(name, counts["passed"], counts["regressions"], detail)


def _upstream_tests(
    root: Path, python: Path, out: TextIO | None = None, junit: Path | None = None
) -> Verdict:
    """``wb regress --fast --stack`` on the pinned release."""
    args = ["regress", "--python", str(python), "--fast", "--stack"]
    return _regress_step(root, "upstream and stack tests", args, out, junit)


def _release_tests(
    root: Path, out: TextIO | None = None, junit: Path | None = None
) -> Verdict:
    """``wb release-test --fast``: the stack on the newest release."""
    name = f"upstream and stack tests on vLLM {upstream.NEXT_RELEASE}"
    return _regress_step(root, name, ["release-test", "--fast"], out, junit)


# The workbench's own tests: no engine, mostly git, zip and file copies (the
# CUDA wheel's repack, the trial stack's checks); they need none of the side
# environments, and not vLLM: they run in an environment of pytest alone
# (``workbench_test_python``) while ``.venv`` is made. ``test_build_cuda.py``
# is not among them: it imports the CUDA wheel's stack against .venv's torch.
WORKBENCH_TESTS = tuple(
    f"project/tests/{name}"
    for name in (
        "test_workbench.py",
        "test_derive.py",
        "test_prefixes.py",
        "test_regress.py",
        "test_declared.py",
        "test_tools_env.py",
    )
)
# The steps that are not test files, by their names in ``lanes.TIMES``.
HOOKS, UPSTREAM, RELEASE = "hooks", "upstream", "release"
# A lane keeps about half a core busy: an engine's start keeps one busy, then
# the test waits on servers, stores and timeouts. Three lanes on 2 cores kept
# 1.48 busy (a clean-clone run: 53.6 min, 2 lanes before: 56); four left
# upstream's tests, one process among an engine's three or four per lane, a
# quarter of a core (42 min for them alone, against 15): the cores plus one,
# as memory allows (a lane may hold two served engines, about 2.5 GB each).
LANES_VAR = "KVLC_TEST_LANES"
LANE_MEMORY = 5 * 1024**3


def lane_count() -> int:
    """The lanes ``./wb test`` runs: ``KVLC_TEST_LANES``, else the cores
    plus one, at most one per ``LANE_MEMORY`` of the memory available."""
    if value := os.environ.get(LANES_VAR):
        if not value.isdigit() or int(value) < 1:
            raise WorkbenchError(
                f"{LANES_VAR}={value!r}: give a whole number of at least 1"
            )
        return int(value)
    lanes_by_memory = available_memory() // LANE_MEMORY
    return max(1, min((os.cpu_count() or 1) + 1, lanes_by_memory))


def available_memory() -> int:
    """Bytes of memory available to new processes (``MemAvailable``)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise WorkbenchError("/proc/meminfo has no MemAvailable line")


def jobs(root: Path, times: dict[str, float]) -> list[lanes.Job]:
    """Every job of ``./wb test`` with its measured seconds: the three
    steps and each test file under ``project/tests``."""
    files = sorted(
        p.relative_to(root).as_posix()
        for p in (root / "project" / "tests").glob("test_*.py")
    )
    # mypy reads .venv's vLLM for the connectors (a hook).
    found = [lanes.Job(HOOKS, times.get(HOOKS, lanes.UNMEASURED_S), needs_venv=True)]
    found.append(
        lanes.Job(UPSTREAM, times.get(UPSTREAM, lanes.UNMEASURED_S), needs_venv=True)
    )
    # The newest release's environment is one of the side environments.
    found.append(lanes.Job(RELEASE, times.get(RELEASE, lanes.UNMEASURED_S), True))
    for name in files:
        seconds = times.get(name, lanes.UNMEASURED_S)
        project = name not in WORKBENCH_TESTS
        found.append(lanes.Job(name, seconds, needs_envs=project, needs_venv=project))
    return found


def workbench_test_python(root: Path) -> Path:
    """The python of an environment holding the test requirements' pytest
    and pytest-timeout only (made once per machine), for the workbench's
    own tests."""
    pins = {}
    for line in (root / devenv.TEST_REQUIREMENTS).read_text().splitlines():
        name, _, version = line.partition("==")
        if version:
            pins[name.strip()] = line.strip()
    wanted = {"pytest": ("pytest",), "pytest-timeout": ("pytest_timeout",)}
    return tools_python("workbench-tests", {pins[n]: m for n, m in wanted.items()})


@dataclass
class Ran:
    """What one lane ran: a verdict, its log and its JUnit XML (if pytest)."""

    verdict: Verdict
    log: Path
    junit: Path | None = None


@dataclass
class Pythons:
    """The interpreters a lane's jobs run in: the tools', the workbench
    tests', and ``.venv``'s once it is made."""

    tools: Path
    workbench_tests: Path
    venv: Future[Path]


def _lane(
    index: int,
    share: list[lanes.Job],
    root: Path,
    pythons: Pythons,
    rest: list[str],
    logs: Path,
    envs: Future[dict[str, str]],
    make_envs: Callable[[], dict[str, str]] | None = None,
) -> list[Ran]:
    """Run one lane's ``share`` of the jobs in the order ``lanes.Job.needs``
    gives, each once what it needs is there (``envs`` holding the side
    environments' variables, ``pythons.venv`` ``.venv``'s python): steps one
    by one, its test files in one pytest run per kind, each with its output
    in its log. With ``make_envs``, the lane first makes the environments and
    sets ``envs`` (or its exception, so that no lane waits forever)."""
    names = [job.name for job in share]
    ran: list[Ran] = []
    if make_envs is not None:
        try:
            envs.set_result(make_envs())
        except BaseException as e:
            envs.set_exception(e)
            raise

    def step(name: str, run: Callable[[TextIO, Path], Verdict]) -> None:
        log, junit = logs / f"{name}.log", logs / f"{name}.xml"
        with log.open("w") as out:
            verdict = _timed(lambda: run(out, junit))
        print(f"{verdict.line()} (lane {index})", flush=True)
        ran.append(Ran(verdict, log, junit))

    def tests(kind: str, python: Path, files: list[str], env: dict[str, str]) -> None:
        if files:
            name = f"{kind} tests, lane {index}"
            step(
                name.replace(" ", "-").replace(",", ""),
                lambda out, junit: _project_tests(
                    root,
                    python,
                    env,
                    rest,
                    tuple(files),
                    name=name,
                    out=out,
                    junit=junit,
                ),
            )

    workbench = [name for name in names if name in WORKBENCH_TESTS]
    tests("workbench", pythons.workbench_tests, workbench, {"KVLC_REQUIRE_E2E": "1"})
    if RELEASE in names:
        envs.result()
        step(RELEASE, lambda out, junit: _release_tests(root, out, junit))
    if HOOKS in names:
        pythons.venv.result()
        step(HOOKS, lambda out, junit: _hooks(root, pythons.tools, out))
    if UPSTREAM in names:
        python = pythons.venv.result()
        step(UPSTREAM, lambda out, junit: _upstream_tests(root, python, out, junit))
    project = [
        n for n in names if n not in (*WORKBENCH_TESTS, HOOKS, UPSTREAM, RELEASE)
    ]
    if project:
        python, env = pythons.venv.result(), envs.result()
        tests("project", python, project, env)
    return ran


def _side_envs(root: Path, times: list[tuple[str, float]]) -> dict[str, str]:
    """Make the side environments: the unpatched release's and LMCache's
    (the end-to-end tests compare with the release and must not skip in CI),
    and the newest release's; the project tests' variables."""
    with _clock(times, "environment of the unpatched release"):
        unpatched = devenv.ensure_unpatched(root)
    with _clock(times, "environment of LMCache"):
        devenv.ensure_lmcache(root)
    with _clock(times, f"environment of vLLM {upstream.NEXT_RELEASE}"):
        release_test.ensure_env(root)
    return {"KVLC_REQUIRE_E2E": "1", "KVLC_UPSTREAM_PYTHON": str(unpatched)}


def _envs_ready(root: Path) -> bool:
    """Whether the side environments are made for today's inputs."""
    return devenv.side_envs_ready(root) and release_test.env_ready(root)


def run(root: Path, rest: list[str]) -> int:
    """The whole of ``./wb test``; ``rest`` goes to the project's pytest."""
    start = time.monotonic()
    counters_at_start = cpu_counters()
    # The environments' steps (each takes time where it makes its venv).
    times: list[tuple[str, float]] = []
    # Seconds, not minutes after the install, when it cannot go on.
    with _clock(times, "system packages"):
        ready = syspkgs.ensure(root)
    if not ready:
        return 1
    with _clock(times, "environment of the tools"):
        tools = tools_python()
    with _clock(times, "environment of the workbench's tests"):
        workbench_tests = workbench_test_python(root)
    # The lanes and .venv's build read the pristine tree; its unpack must
    # not race.
    with _clock(times, "pristine tree"):
        upstream.pristine_tree()
    # Each process of the lanes computes on one thread (unless the caller
    # says otherwise): the lanes keep the cores busy, and each engine's
    # OpenMP threads would spin against the other lanes' (a served test
    # file: 16% less CPU with one, on a quiet 2-core machine).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Every process writes the bytecode of what it imports: the installs do
    # not compile ahead (pip --no-compile), and an engine start imports vLLM
    # three times, each compiling about 5,000 modules where no bytecode was
    # written (39 s of CPU instead of 16 here). An image that sets
    # PYTHONDONTWRITEBYTECODE would have every start pay that.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    measured = lanes.load(root)
    envs_ready = _envs_ready(root)
    envs_s = 0.0 if envs_ready else measured.get(lanes.ENVIRONMENTS, 900.0)
    venv_s = 0.0 if devenv.is_current(root) else measured.get(lanes.VENV, 240.0)
    shares = lanes.plan(jobs(root, measured), lane_count(), envs_s, venv_s)
    logs = root / "build" / "wb-test"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"=== {len(shares)} lanes, by the times in {lanes.TIMES}; logs in {logs}")
    for index, share in enumerate(shares):
        expected = sum(job.seconds for job in share) + (envs_s if index == 0 else 0)
        names = ", ".join(Path(job.name).name for job in share)
        print(f"  lane {index} (~{expected / 60:.0f} min): {names}", flush=True)
    envs: Future[dict[str, str]] = Future()
    envs_made: list[tuple[str, float]] = []
    pythons = Pythons(tools, workbench_tests, Future())

    def make_envs() -> dict[str, str]:
        if not envs_ready:
            # Their files are hard links to .venv's where they are the same.
            pythons.venv.result()
        return _side_envs(root, envs_made)

    venv_made: list[tuple[str, float]] = []
    with ThreadPoolExecutor(len(shares)) as pool:
        futures = [
            pool.submit(
                _lane, i, share, root, pythons, rest, logs, envs,
                make_envs if i == 0 else None,
            )
            for i, share in enumerate(shares)
        ]  # fmt: skip
        try:
            with _clock(venv_made, "environment .venv (the patched vLLM)"):
                pythons.venv.set_result(devenv.ensure(root))
        except BaseException as e:
            print(f"=== .venv could not be made ({e}); the lanes stop", flush=True)
            pythons.venv.set_exception(e)
        ran = [r for future in futures for r in future.result()]
    times += venv_made + envs_made
    for r in ran:
        print(f"=== {r.verdict.name} ({r.log})", flush=True)
        print(r.log.read_text(), end="", flush=True)
        print(r.verdict.line(), flush=True)
    lines, status = summary([r.verdict for r in ran])
    print("\n".join(lines), flush=True)
    times += [(r.verdict.name, r.verdict.seconds) for r in ran]
    wall_s = time.monotonic() - start
    times += [("./wb test, in all", wall_s)]
    reports = [(r.junit, _tree(root, r.log.stem)) for r in ran if r.junit is not None]
    counters_at_end = cpu_counters()
    counters = None
    if counters_at_start is not None and counters_at_end is not None:
        counters = (counters_at_start, counters_at_end)
    table = timetable(
        machine.describe(), times, reports, root, wall_s=wall_s, counters=counters
    )
    print("\n".join(table), flush=True)
    envs_made_s = sum(seconds for _, seconds in envs_made) if envs_s else None
    venv_made_s = venv_made[0][1] if venv_s else None
    fresh = measured_times(ran, reports, root, envs_made_s, venv_made_s)
    lanes.write(logs / "test-times.json", {**measured, **fresh})
    print(
        f"=== the times measured: {logs / 'test-times.json'} "
        f"(copied to {lanes.TIMES}, the lanes are balanced by them)"
    )
    return status


def _tree(root: Path, step: str) -> Path:
    """The tree a step's tests ran from, which its JUnit XML names files by."""
    if step == UPSTREAM:
        return root / regress.STACK_TREE
    if step == RELEASE:
        return derive.default_tree(root)
    return root


def measured_times(
    ran: list[Ran],
    reports: list[tuple[Path, Path]],
    root: Path,
    envs_s: float | None,
    venv_s: float | None = None,
) -> dict[str, float]:
    """Each job's seconds in this run: a step's wall time, a project test
    file's from its JUnit report; the side environments' and ``.venv``'s if
    they were made."""
    fresh: dict[str, float] = {}
    for r in ran:
        if r.log.stem in (HOOKS, UPSTREAM, RELEASE):
            fresh[r.log.stem] = r.verdict.seconds
    for junit, tree in reports:
        if tree != root or not junit.exists():
            continue
        for path, seconds, _ in regress.file_durations(junit, tree):
            fresh[path] = seconds
    if envs_s is not None:
        fresh[lanes.ENVIRONMENTS] = envs_s
    if venv_s is not None:
        fresh[lanes.VENV] = venv_s
    return fresh


def summary(verdicts: list[Verdict]) -> tuple[list[str], int]:
    """The closing lines (each step's verdict, then the count) and the exit status."""
    passed = sum(v.passed for v in verdicts)
    failed = sum(v.failed for v in verdicts)
    lines = ["=== summary", *(v.line() for v in verdicts)]
    lines.append(f"=== {passed} passed, {failed} failed ===")
    return lines, 1 if failed else 0


def cpu_counters(stat: Path = Path("/proc/stat")) -> tuple[float, float] | None:
    """The machine's CPU seconds so far, busy and in all (every core), from
    the kernel's counters; None where there are none (not Linux). Unlike the
    CPU time of waited-for children, this counts an engine's processes,
    which are killed with their group and never waited for."""
    try:
        fields = stat.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is in user).
    ticks = [int(f) for f in fields[1:9]]
    hz = os.sysconf("SC_CLK_TCK")
    idle = ticks[3] + ticks[4]
    return (sum(ticks) - idle) / hz, sum(ticks) / hz


def timetable(
    cpu: str,
    steps: list[tuple[str, float]],
    junits: list[tuple[Path, Path]],
    root: Path,
    top: int = 20,
    wall_s: float | None = None,
    counters: tuple[tuple[float, float], tuple[float, float]] | None = None,
) -> list[str]:
    """The time table: the machine ``cpu``, each of ``steps`` (name, wall
    seconds), then the ``top`` slowest test files of the (JUnit XML, test
    tree) pairs ``junits`` (a missing report is skipped), each the sum of its
    tests' setup, call and teardown; slowest first. A file's path is relative
    to ``root``. With ``wall_s`` (the run's wall time), the CPU time of the
    child processes it waited for, and the cores that kept busy; with
    ``counters`` (``cpu_counters()`` at the start and the end), the whole
    machine's busy time."""
    lines = [f"=== time table: {cpu}"]
    if wall_s is not None:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        busy = usage.ru_utime + usage.ru_stime
        lines.append(
            f"=== CPU time of the processes it waited for: {busy:.0f} s, "
            f"{busy / wall_s:.2f} of {os.cpu_count()} cores busy on average"
        )
    if counters is not None:
        (busy_0, all_0), (busy_1, all_1) = counters
        share = (busy_1 - busy_0) / max(all_1 - all_0, 1e-9)
        lines.append(
            f"=== the machine's CPU time (/proc/stat): {busy_1 - busy_0:.0f} s "
            f"busy of {all_1 - all_0:.0f} s, {share:.0%}"
        )
    lines.append("=== steps, slowest first (wall time)")
    for name, seconds in sorted(steps, key=lambda step: -step[1]):
        lines.append(f"{seconds:8.1f} s  {name}")
    files: dict[Path, tuple[float, int]] = {}
    for junit, tree in junits:
        if not junit.exists():
            continue
        for path, seconds, count in regress.file_durations(junit, tree):
            file = tree / path
            file = file.relative_to(root) if file.is_relative_to(root) else file
            total, tests = files.get(file, (0.0, 0))
            files[file] = (total + seconds, tests + count)
    slowest = sorted(files.items(), key=lambda row: (-row[1][0], row[0]))[:top]
    lines.append(
        f"=== the {len(slowest)} slowest of {len(files)} test files "
        "(their tests' setup + call + teardown)"
    )
    for file, (seconds, tests) in slowest:
        lines.append(f"{seconds:8.1f} s  {tests:4d} tests  {file}")
    return lines

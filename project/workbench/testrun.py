"""``./wb test``: everything CI runs, from a fresh clone, with one verdict.

First the system packages the end-to-end tests need (``project/ci/
system-packages``: installed when possible, else it stops at once with one
line), then the environments, then the steps: the project's hooks, the
project's end-to-end tests, the workbench's own tests (``WORKBENCH_TESTS``),
upstream's and the stack's tests (``wb regress``), and the same on the newest
release (``wb release-test --fast``). The end-to-end tests
leave one of a 2-core runner's cores idle most of the time (pytest and an
engine's start keep one busy; the rest is waiting on servers and stores), so
the other steps run beside them, then a share of the end-to-end tests
(``BESIDE_E2E_TESTS``) once those steps are done; their output is held in
logs and printed after the end-to-end tests (pytest's ``--durations``
reports show where time went). Each step ends with one verdict line; the
last line counts tests in the form CI runners read (``N passed, M failed``),
where a failure of the unpatched release that the patched build shares is
not counted: only regressions are. A time table closes the run: the
machine, each step's wall time and the slowest test files (from the steps'
JUnit XML, kept in the logs' folder), slowest first.
"""

from __future__ import annotations

import json
import os
import re
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

from workbench import derive, devenv, regress, syspkgs, upstream
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
    ignore: tuple[str, ...] = (),
    name: str = "project tests",
    out: TextIO | None = None,
    junit: Path | None = None,
) -> Verdict:
    """The project's pytest suite (``paths`` less ``ignore``), counted from
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
        cmd += [f"--ignore={path}" for path in ignore] + rest
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
# CUDA wheel's repack, the trial stack's checks). They run beside the
# end-to-end tests.
WORKBENCH_TESTS = tuple(
    f"project/tests/{name}"
    for name in (
        "test_workbench.py",
        "test_derive.py",
        "test_build_cuda.py",
        "test_prefixes.py",
        "test_regress.py",
        "test_declared.py",
        "test_tools_env.py",
    )
)
# The end-to-end test files the lane beside runs after its own steps: the
# end-to-end tests are CI's longest step, so the two lanes share them, none
# needing Redis. By the time table of a clean-clone run (docs/
# working-on-the-stack.md: main lane 56 min, the other 47 min with the first
# two files here), the store's shared-store tests (3.2 min) move too, so the
# lanes end within about two minutes of each other.
BESIDE_E2E_TESTS = tuple(
    f"project/tests/{name}"
    for name in (
        "test_before_update_states_e2e.py",
        "test_aibrix_e2e.py",
        "test_store_shared_e2e.py",
    )
)
# Each step run beside the project's end-to-end tests, and its log.
BESIDE_LOGS = (
    "hooks.log",
    "workbench-tests.log",
    "upstream.log",
    "release.log",
    "e2e-beside.log",
)


def junit_reports(root: Path, logs: Path) -> dict[str, tuple[Path, Path]]:
    """Each pytest step's JUnit XML in ``logs``, with the tree its tests
    ran from: the project's (both lanes), the workbench's, ``wb regress``'s
    (its stack tree) and ``wb release-test``'s (the derived tree)."""
    return {
        "project": (logs / "project-tests.xml", root),
        "workbench": (logs / "workbench-tests.xml", root),
        "upstream": (logs / "upstream.xml", root / regress.STACK_TREE),
        "release": (logs / "release.xml", derive.default_tree(root)),
        "e2e-beside": (logs / "e2e-beside.xml", root),
    }


def _beside(
    root: Path,
    tools: Path,
    python: Path,
    rest: list[str],
    logs: Path,
    e2e_env: Future[dict[str, str]],
) -> list[Verdict]:
    """The hooks, the workbench's tests, upstream's and the stack's tests,
    then ``BESIDE_E2E_TESTS`` in ``e2e_env`` (once the other lane has made
    the environments they need): the steps that run beside the project's
    end-to-end tests, each with its output in its log (``BESIDE_LOGS``)."""
    hooks, workbench, upstream_log, release, e2e = (logs / name for name in BESIDE_LOGS)
    junits = {name: junit for name, (junit, _) in junit_reports(root, logs).items()}
    with hooks.open("w") as out:
        verdicts = [_timed(lambda: _hooks(root, tools, out))]
    with workbench.open("w") as out:
        env = {"KVLC_REQUIRE_E2E": "1"}
        verdicts.append(
            _timed(
                lambda: _project_tests(
                    root,
                    python,
                    env,
                    rest,
                    WORKBENCH_TESTS,
                    name="workbench tests",
                    out=out,
                    junit=junits["workbench"],
                )
            )
        )
    with upstream_log.open("w") as out:
        verdicts.append(
            _timed(lambda: _upstream_tests(root, python, out, junit=junits["upstream"]))
        )
    with release.open("w") as out:
        verdicts.append(
            _timed(lambda: _release_tests(root, out, junit=junits["release"]))
        )
    # Its wall time, not its wait for the other lane's environments.
    env = e2e_env.result()
    with e2e.open("w") as out:
        verdicts.append(
            _timed(
                lambda: _project_tests(
                    root,
                    python,
                    env,
                    rest,
                    BESIDE_E2E_TESTS,
                    name="project tests, beside",
                    out=out,
                    junit=junits["e2e-beside"],
                )
            )
        )
    return verdicts


def run(root: Path, rest: list[str]) -> int:
    """The whole of ``./wb test``; ``rest`` goes to the project's pytest."""
    start = time.monotonic()
    # The environments' steps (each takes time where it makes its venv).
    times: list[tuple[str, float]] = []
    # Seconds, not minutes after the install, when it cannot go on.
    with _clock(times, "system packages"):
        ready = syspkgs.ensure(root)
    if not ready:
        return 1
    with _clock(times, "environment .venv (the patched vLLM)"):
        python = devenv.ensure(root)
    with _clock(times, "environment of the tools"):
        tools = tools_python()
    # Both lanes below read the pristine tree; its unpack must not race.
    with _clock(times, "pristine tree"):
        upstream.pristine_tree()
    # pytest keeps one core busy, and an engine's start mostly one: the
    # end-to-end tests leave the second core of a 2-core runner idle most of
    # the time. The hooks, the workbench's tests (I/O more than CPU) and
    # upstream's tests run there, beside the other environments' installs
    # and the end-to-end tests; their output waits for those.
    logs = root / "build" / "wb-test"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"=== hooks, workbench and upstream tests: running beside, logs in {logs}")
    e2e_env: Future[dict[str, str]] = Future()
    with ThreadPoolExecutor(1) as pool:
        beside = pool.submit(_beside, root, tools, python, rest, logs, e2e_env)
        try:
            # The end-to-end tests compare with the release and must not
            # skip in CI.
            with _clock(times, "environment of the unpatched release"):
                unpatched = devenv.ensure_unpatched(root)
            with _clock(times, "environment of LMCache"):
                devenv.ensure_lmcache(root)
        except BaseException as e:
            # Or the lane beside would wait for the environments forever.
            e2e_env.set_exception(e)
            raise
        e2e_env.set_result(
            {"KVLC_REQUIRE_E2E": "1", "KVLC_UPSTREAM_PYTHON": str(unpatched)}
        )
        print("=== project tests", flush=True)
        tests = _timed(
            lambda: _project_tests(
                root,
                python,
                e2e_env.result(),
                rest,
                ignore=WORKBENCH_TESTS + BESIDE_E2E_TESTS,
                junit=junit_reports(root, logs)["project"][0],
            )
        )
        print(tests.line(), flush=True)
        if not beside.done():
            print("=== waiting for the steps beside", flush=True)
        steps = beside.result()
    for verdict, log in zip(steps, BESIDE_LOGS, strict=True):
        print(f"=== {verdict.name} (ran beside; {logs / log})", flush=True)
        print((logs / log).read_text(), end="", flush=True)
        print(verdict.line(), flush=True)
    lines, status = summary([steps[0], tests, *steps[1:]])
    print("\n".join(lines), flush=True)
    times += [(tests.name, tests.seconds)]
    times += [(f"{v.name} (beside)", v.seconds) for v in steps]
    times += [("./wb test, in all", time.monotonic() - start)]
    reports = list(junit_reports(root, logs).values())
    table = timetable(machine.describe(), times, reports, root)
    print("\n".join(table), flush=True)
    return status


def summary(verdicts: list[Verdict]) -> tuple[list[str], int]:
    """The closing lines (each step's verdict, then the count) and the exit status."""
    passed = sum(v.passed for v in verdicts)
    failed = sum(v.failed for v in verdicts)
    lines = ["=== summary", *(v.line() for v in verdicts)]
    lines.append(f"=== {passed} passed, {failed} failed ===")
    return lines, 1 if failed else 0


def timetable(
    cpu: str,
    steps: list[tuple[str, float]],
    junits: list[tuple[Path, Path]],
    root: Path,
    top: int = 20,
) -> list[str]:
    """The time table: the machine ``cpu``, each of ``steps`` (name, wall
    seconds), then the ``top`` slowest test files of the (JUnit XML, test
    tree) pairs ``junits`` (a missing report is skipped), each the sum of its
    tests' setup, call and teardown; slowest first. A file's path is relative
    to ``root``."""
    lines = [f"=== time table: {cpu}", "=== steps, slowest first (wall time)"]
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

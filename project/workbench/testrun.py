"""``./wb test``: everything CI runs, from a fresh clone, with one verdict.

First the system packages the end-to-end tests need (``project/ci/
system-packages``: installed when possible, else it stops at once with one
line), then the environments, then three steps: the project's hooks, the
project's tests, upstream's and the stack's tests (``wb regress``). The
project's tests leave one of a 2-core runner's cores idle most of the time
(pytest and an engine's start keep one busy; the rest is waiting on servers
and stores), so the hooks and then upstream's tests run beside them, with
their output held in logs and printed after the project's tests (pytest's
``--durations`` report shows where their time went). Each step ends with one
verdict line; the last line counts tests in the form CI
runners read (``N passed, M failed``), where a failure of the unpatched
release that the patched build shares is not counted: only regressions are.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from workbench import devenv, syspkgs, upstream
from workbench.tools import tools_python


@dataclass
class Verdict:
    """One step's outcome: tests passed and failed, and its verdict line."""

    name: str
    passed: int
    failed: int
    detail: str

    def line(self) -> str:
        word = "FAIL" if self.failed else "PASS"
        return f"=== {self.name}: {word}: {self.detail}"


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
    root: Path, python: Path, env: dict[str, str], rest: list[str]
) -> Verdict:
    """The project's pytest suite, counted from its JUnit XML."""
    with tempfile.TemporaryDirectory(prefix="kvlc-test-") as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [str(python), "-m", "pytest", "-p", "no:cacheprovider"]
        # Every CI log shows where the time goes.
        cmd += ["--durations=25", f"--junitxml={junit}", "project/tests", *rest]
        status = _call(cmd, root, env)
        if not junit.exists():
            return Verdict("project tests", 0, 1, f"pytest exited {status}, no report")
        suites = ET.parse(junit).getroot().iter("testsuite")
        total = {k: 0 for k in ("tests", "failures", "errors", "skipped")}
        for suite in suites:
            for key in total:
                total[key] += int(suite.get(key, 0))
    failed = total["failures"] + total["errors"]
    passed = total["tests"] - failed - total["skipped"]
    if status != 0 and not failed:
        failed = 1  # pytest itself failed (usage error, interrupted)
    detail = f"{passed} passed, {failed} failed, {total['skipped']} skipped"
    return Verdict("project tests", passed, failed, detail)


def _upstream_tests(root: Path, python: Path, out: TextIO | None = None) -> Verdict:
    """``wb regress --fast --stack``: only regressions count as failures. Its
    output goes to ``out`` (a file; default: stdout)."""
    name = "upstream and stack tests"
    with tempfile.TemporaryDirectory(prefix="kvlc-test-") as tmp:
        summary = Path(tmp) / "summary.json"
        cmd = [sys.executable, str(root / "wb"), "regress", "--python", str(python)]
        cmd += ["--fast", "--stack", "--summary-json", str(summary)]
        status = _call(cmd, root, out=out)
        if not summary.exists():
            return Verdict(name, 0, 1, f"wb regress exited {status} with no verdict")
        counts = json.loads(summary.read_text())
    detail = (
        f"{counts['regressions']} regressions, {counts['passed']} passed, "
        f"{counts['retired']} retired by the stack; {counts['known_failures']} "
        "failures the unpatched release has too are not counted"
    )
    return Verdict(name, counts["passed"], counts["regressions"], detail)


def _beside(root: Path, tools: Path, python: Path, logs: Path) -> list[Verdict]:
    """The hooks, then upstream's and the stack's tests: the steps that run
    beside the project's tests, each with its output in its log."""
    with (logs / "hooks.log").open("w") as out:
        hooks = _hooks(root, tools, out)
    with (logs / "upstream.log").open("w") as out:
        return [hooks, _upstream_tests(root, python, out)]


def run(root: Path, rest: list[str]) -> int:
    """The whole of ``./wb test``; ``rest`` goes to the project's pytest."""
    # Seconds, not minutes after the install, when it cannot go on.
    if not syspkgs.ensure(root):
        return 1
    python = devenv.ensure(root)
    tools = tools_python()
    # Both lanes below read the pristine tree; its unpack must not race.
    upstream.pristine_tree()
    # pytest keeps one core busy, and an engine's start mostly one: the
    # project's tests (engines, waits on servers and stores) leave the
    # second core of a 2-core runner idle most of the time. The hooks and
    # upstream's tests run there, beside the other environments' installs
    # and the project's tests; their output waits for the project's.
    logs = root / "build" / "wb-test"
    logs.mkdir(parents=True, exist_ok=True)
    print(
        f"=== project hooks, upstream and stack tests: running beside, logs in {logs}"
    )
    with ThreadPoolExecutor(1) as pool:
        beside = pool.submit(_beside, root, tools, python, logs)
        # The end-to-end tests compare with the release and must not skip in CI.
        unpatched = devenv.ensure_unpatched(root)
        devenv.ensure_lmcache(root)
        e2e_env = {"KVLC_REQUIRE_E2E": "1", "KVLC_UPSTREAM_PYTHON": str(unpatched)}
        print("=== project tests", flush=True)
        tests = _project_tests(root, python, e2e_env, rest)
        print(tests.line(), flush=True)
        if not beside.done():
            print("=== waiting for the hooks and upstream's tests", flush=True)
        hooks, upstream_tests = beside.result()
    for verdict, log in ((hooks, "hooks.log"), (upstream_tests, "upstream.log")):
        print(f"=== {verdict.name} (ran beside; {logs / log})", flush=True)
        print((logs / log).read_text(), end="", flush=True)
        print(verdict.line(), flush=True)
    lines, status = summary([hooks, tests, upstream_tests])
    print("\n".join(lines), flush=True)
    return status


def summary(verdicts: list[Verdict]) -> tuple[list[str], int]:
    """The closing lines (each step's verdict, then the count) and the exit status."""
    passed = sum(v.passed for v in verdicts)
    failed = sum(v.failed for v in verdicts)
    lines = ["=== summary", *(v.line() for v in verdicts)]
    lines.append(f"=== {passed} passed, {failed} failed ===")
    return lines, 1 if failed else 0

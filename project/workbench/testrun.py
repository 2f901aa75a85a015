"""``./wb test``: everything CI runs, from a fresh clone, with one verdict.

First the system packages the end-to-end tests need (``project/ci/
system-packages``: installed when possible, else it stops at once with one
line), then the environments, then three steps: the project's hooks, the
project's tests, upstream's and the stack's tests (``wb regress``). Each step
ends with one verdict line; the last line counts tests in the form CI
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
from dataclasses import dataclass
from pathlib import Path

from workbench import devenv, syspkgs
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


def _call(cmd: list[str], root: Path, env: dict[str, str] | None = None) -> int:
    print(f"$ {' '.join(cmd)}", flush=True)
    return subprocess.call(cmd, cwd=root, env={**os.environ, **(env or {})})


def _hooks(root: Path, tools: Path) -> Verdict:
    """pre-commit's hooks; each hook is one test."""
    cmd = [str(tools), "-m", "pre_commit", "run", "--all-files", "--color", "never"]
    print(f"$ {' '.join(cmd)}", flush=True)
    proc = subprocess.run(
        cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    print(proc.stdout, end="", flush=True)
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
        cmd += [f"--junitxml={junit}", "project/tests", *rest]
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


def _upstream_tests(root: Path, python: Path) -> Verdict:
    """``wb regress --fast --stack``: only regressions count as failures."""
    name = "upstream and stack tests"
    with tempfile.TemporaryDirectory(prefix="kvlc-test-") as tmp:
        summary = Path(tmp) / "summary.json"
        cmd = [sys.executable, str(root / "wb"), "regress", "--python", str(python)]
        cmd += ["--fast", "--stack", "--summary-json", str(summary)]
        status = _call(cmd, root)
        if not summary.exists():
            return Verdict(name, 0, 1, f"wb regress exited {status} with no verdict")
        counts = json.loads(summary.read_text())
    detail = (
        f"{counts['regressions']} regressions, {counts['passed']} passed, "
        f"{counts['retired']} retired by the stack; {counts['known_failures']} "
        "failures the unpatched release has too are not counted"
    )
    return Verdict(name, counts["passed"], counts["regressions"], detail)


def run(root: Path, rest: list[str]) -> int:
    """The whole of ``./wb test``; ``rest`` goes to the project's pytest."""
    # Seconds, not minutes after the install, when it cannot go on.
    if not syspkgs.ensure(root):
        return 1
    python = devenv.ensure(root)
    tools = tools_python()
    # The end-to-end tests compare with the release and must not skip in CI.
    unpatched = devenv.ensure_unpatched(root)
    devenv.ensure_lmcache(root)
    e2e_env = {"KVLC_REQUIRE_E2E": "1", "KVLC_UPSTREAM_PYTHON": str(unpatched)}
    verdicts = []
    print("=== project hooks", flush=True)
    verdicts.append(_hooks(root, tools))
    print(verdicts[-1].line(), flush=True)
    print("=== project tests", flush=True)
    verdicts.append(_project_tests(root, python, e2e_env, rest))
    print(verdicts[-1].line(), flush=True)
    print("=== upstream and stack tests", flush=True)
    verdicts.append(_upstream_tests(root, python))
    print(verdicts[-1].line(), flush=True)
    lines, status = summary(verdicts)
    print("\n".join(lines), flush=True)
    return status


def summary(verdicts: list[Verdict]) -> tuple[list[str], int]:
    """The closing lines (each step's verdict, then the count) and the exit status."""
    passed = sum(v.passed for v in verdicts)
    failed = sum(v.failed for v in verdicts)
    lines = ["=== summary", *(v.line() for v in verdicts)]
    lines.append(f"=== {passed} passed, {failed} failed ===")
    return lines, 1 if failed else 0

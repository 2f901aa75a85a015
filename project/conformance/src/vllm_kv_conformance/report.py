"""The table of a run: one line per scenario, for a terminal or for Markdown.

``cli.main`` prints ``table`` for each connector it ran and, with
``--markdown OUT``, writes ``markdown`` of all of them (the machine line, the
vLLM version and the git commit first: a table that does not say where and on
what it ran cannot be compared with another).
"""

from __future__ import annotations

import datetime
import subprocess
from pathlib import Path

from vllm_kv_conformance import machine
from vllm_kv_conformance.results import Report


def table(report: Report) -> str:
    width = max((len(r.name) for r in report.results), default=8)
    lines = [
        f"{report.connector} on vLLM {report.vllm_version} "
        f"({'with' if report.lifecycle else 'without'} the external-match lifecycle)"
    ]
    for r in report.results:
        lines.append(f"  {r.status.value:<4}  {r.name:<{width}}  {r.reason}")
    passed = sum(r.status.value == "PASS" for r in report.results)
    lines.append(
        f"  {passed} passed, {len(report.failed)} failed, "
        f"{len(report.results) - passed - len(report.failed)} not applicable"
    )
    return "\n".join(lines)


def git_commit(start: Path | None = None) -> str:
    """The commit of the checkout the kit runs from (or the current directory's),
    with ``-dirty`` when it has uncommitted changes; "unknown" outside git."""
    cwd = str(start or Path.cwd())
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=cwd,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("-dirty" if dirty else "")


def markdown(
    reports: list[tuple[str, Report]],
    command: str,
    commit: str | None = None,
    notes: list[str] | None = None,
) -> str:
    """``reports``: (label, report) pairs, one per connector configuration;
    ``notes``: paragraphs after the machine and commit lines."""
    out = [
        "# KV connector conformance",
        "",
        f"Written on {datetime.date.today().isoformat()} by the conformance kit "
        "(project/conformance), from the repository root:",
        "",
        "```",
        command,
        "```",
        "",
        f"- machine: {machine.describe()}",
        f"- commit: `{commit or git_commit()}`",
        "",
    ]
    for note in notes or []:
        out += [note, ""]
    for label, report in reports:
        out += [
            f"## {label}",
            "",
            f"{report.connector} on vLLM {report.vllm_version}, "
            f"{'with' if report.lifecycle else 'without'} the external-match "
            "lifecycle.",
            "",
            "| scenario | result | why |",
            "|---|---|---|",
        ]
        for r in report.results:
            why = r.reason.replace("|", "\\|")
            out.append(f"| {r.name} | {r.status.value} | {why} |")
        out.append("")
    return "\n".join(out)

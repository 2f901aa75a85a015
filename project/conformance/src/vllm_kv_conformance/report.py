"""The table of a run: one line per scenario, for a terminal or for Markdown.

``cli.main`` prints ``table`` for each connector it ran and, with
``--markdown OUT``, writes ``markdown`` of all of them (the machine line, the
vLLM version and the git commit first: a table that does not say where and on
what it ran cannot be compared with another).
"""

from __future__ import annotations

import dataclasses
import datetime
import subprocess
from pathlib import Path
from typing import Any

from vllm_kv_conformance import machine
from vllm_kv_conformance.results import Report, ScenarioResult, Status


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


# A run as JSON (``--json OUT``): what ``merged_markdown`` renders, so that runs
# of the kit in several environments (each its own vLLM, one process each) make
# one document. ``./wb conformance`` writes project/docs/conformance.md so.
RUN_FORMAT = 1


def report_to_dict(report: Report) -> dict[str, Any]:
    """``report`` as JSON-able data (``report_from_dict`` reads it back)."""
    data = dataclasses.asdict(report)
    data["results"] = [
        {"name": r.name, "status": r.status.value, "reason": r.reason}
        for r in report.results
    ]
    return data


def report_from_dict(data: dict[str, Any]) -> Report:
    results = [
        ScenarioResult(r["name"], Status(r["status"]), r["reason"])
        for r in data["results"]
    ]
    return Report(**{**data, "results": results})


def run_record(
    title: str,
    command: str,
    entries: list[dict[str, Any]],
    commit: str | None = None,
) -> dict[str, Any]:
    """One run of the kit: ``entries`` are ``{"label", "config", "report"}``
    (``report_to_dict``) or, for a connector that did not run, ``{"label",
    "config", "not_run": {"status": "FAIL" | "N/A", "reason": ONE_LINE}}``."""
    return {
        "format": RUN_FORMAT,
        "title": title,
        "command": command,
        "machine": machine.describe(),
        "commit": commit or git_commit(),
        "entries": entries,
    }


def one_line(text: str, limit: int = 300) -> str:
    """The first non-empty line of ``text``, clipped: a table cell."""
    line = next((s.strip() for s in text.splitlines() if s.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _entry_statuses(entry: dict[str, Any], names: list[str]) -> list[str]:
    if "report" in entry:
        by_name = {r["name"]: r["status"] for r in entry["report"]["results"]}
        return [by_name.get(n, "-") for n in names]
    return [entry["not_run"]["status"]] * len(names)


def merged_markdown(
    runs: list[dict[str, Any]], command: str, notes: list[str] | None = None
) -> str:
    """One document of several runs (``run_record``): the ``command`` that
    made it, ``notes``, then a section per run with its command, machine and
    commit, an overview (connector x scenario) and each connector's table."""
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
    ]
    for note in notes or []:
        out += [note, ""]
    for run in runs:
        names: list[str] = []
        for entry in run["entries"]:
            for r in entry.get("report", {}).get("results", []):
                if r["name"] not in names:
                    names.append(r["name"])
        out += [
            f"## {run['title']}",
            "",
            "```",
            run["command"],
            "```",
            "",
            f"- machine: {run['machine']}",
            f"- commit: `{run['commit']}`",
            "",
        ]
        if names:
            out += [
                "| connector | " + " | ".join(names) + " |",
                "|---|" + "---|" * len(names),
            ]
            for entry in run["entries"]:
                cells = _entry_statuses(entry, names)
                out.append(f"| {_cell(entry['label'])} | " + " | ".join(cells) + " |")
            out.append("")
        for entry in run["entries"]:
            out += [f"### {entry['label']}", ""]
            if "not_run" in entry:
                status, why = entry["not_run"]["status"], entry["not_run"]["reason"]
                verb = "Not run" if status == "N/A" else "Did not run"
                out += [f"{verb} ({status}): {_cell(why)}", ""]
                continue
            report = report_from_dict(entry["report"])
            out += [
                f"{report.connector} on vLLM {report.vllm_version}, "
                f"{'with' if report.lifecycle else 'without'} the external-match "
                "lifecycle.",
                "",
                "| scenario | result | why |",
                "|---|---|---|",
            ]
            for r in report.results:
                out.append(f"| {r.name} | {r.status.value} | {_cell(r.reason)} |")
            out.append("")
    return "\n".join(out)

"""``vllm-kv-conformance``: run the kit against one or more connectors.

    vllm-kv-conformance --kv-transfer-config '{"kv_connector": "StoreConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"path": "/scratch/store"}}'

prints one line per scenario (PASS, FAIL or N/A, and why) as each finishes,
then the table; exits 1 when a scenario failed, 2 on a usage error. Give
``--kv-transfer-config`` once per connector to run several in one process (one
import of vLLM), with ``--label`` for each; ``--markdown OUT`` writes the
table of all of them (``report.markdown``), ``--json OUT`` the run as data
(``report.run_record``: a connector whose engine did not start is an entry
with its error's line). ``--merge RUN.json`` (repeatable) runs nothing: it
writes ``--markdown`` of runs made earlier, perhaps each in another
environment (``./wb conformance`` makes project/docs/conformance.md so).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from vllm_kv_conformance.results import Report, ScenarioResult

# --tp2 without a label.
ALL = "*"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from vllm_kv_conformance.runner import SCENARIO_NAMES

    p = argparse.ArgumentParser(
        prog="vllm-kv-conformance", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--kv-transfer-config",
        action="append",
        default=[],
        metavar="JSON",
        help="the connector's --kv-transfer-config; repeat for more connectors",
    )
    p.add_argument(
        "--label",
        action="append",
        default=[],
        help="a name for each config, in order (default: its kv_connector)",
    )
    p.add_argument(
        "--scenario",
        action="append",
        choices=SCENARIO_NAMES,
        help="run only these scenarios (repeatable; default: all)",
    )
    p.add_argument("--model", type=Path, help="tiny model directory (made if absent)")
    p.add_argument("--seed", type=int, help="the prompts' seed (default: fresh)")
    p.add_argument("--markdown", type=Path, metavar="OUT", help="write the table here")
    p.add_argument(
        "--note",
        action="append",
        default=[],
        help="a paragraph for the Markdown table's head (repeatable)",
    )
    p.add_argument("--verbose", action="store_true", help="keep vLLM's info log")
    p.add_argument(
        "--tp2",
        action="append",
        nargs="?",
        const=ALL,
        default=[],
        metavar="LABEL",
        help="run tensor_parallel_2 (the connector on two ranks in a child "
        "process, about a minute of two cores) for every connector, or for "
        "the one of this label (repeatable)",
    )
    p.add_argument(
        "--json", type=Path, metavar="OUT", help="write the run as JSON here"
    )
    p.add_argument(
        "--title", help="the run's title in --json (default: vLLM and its version)"
    )
    p.add_argument(
        "--merge",
        action="append",
        default=[],
        type=Path,
        metavar="RUN.json",
        help="run nothing: write --markdown of these --json runs, in order",
    )
    p.add_argument(
        "--command",
        help="with --merge: the command the Markdown names as its maker "
        "(default: this one)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        return merge(args, argv)
    if not args.kv_transfer_config:
        print("give --kv-transfer-config (or --merge)", file=sys.stderr)
        return 2
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    configs: list[dict[str, Any]] = []
    for text in args.kv_transfer_config:
        try:
            config = json.loads(text)
        except json.JSONDecodeError as e:
            print(f"--kv-transfer-config is not JSON: {e}", file=sys.stderr)
            return 2
        if not isinstance(config, dict) or not config.get("kv_connector"):
            print(
                "--kv-transfer-config must be an object with a kv_connector",
                file=sys.stderr,
            )
            return 2
        configs.append(config)
    if len(args.label) not in (0, len(configs)):
        print("give one --label per --kv-transfer-config, or none", file=sys.stderr)
        return 2
    labels = args.label or [str(c["kv_connector"]) for c in configs]

    from vllm_kv_conformance import report as render
    from vllm_kv_conformance.runner import run_conformance

    def progress(result: ScenarioResult) -> None:
        print(f"{result.status.value:<4}  {result.name}: {result.reason}", flush=True)

    reports: list[tuple[str, Report]] = []
    broken: list[str] = []
    entries: list[dict[str, Any]] = []
    for label, config in zip(labels, configs, strict=True):
        print(f"== {label}", flush=True)
        try:
            report = run_conformance(
                config,
                model_dir=args.model,
                seed=args.seed,
                only=args.scenario,
                progress=progress,
                tp2=ALL in args.tp2 or label in args.tp2,
            )
        except Exception as e:  # noqa: BLE001 - the engine did not start
            why = render.one_line(f"{type(e).__name__}: {e}")
            print(f"{label}: not run: {why}", file=sys.stderr)
            broken.append(label)
            entries.append(
                {
                    "label": label,
                    "config": config,
                    "not_run": {"status": "FAIL", "reason": f"not run: {why}"},
                }
            )
            continue
        reports.append((label, report))
        entries.append(
            {"label": label, "config": config, "report": render.report_to_dict(report)}
        )
    print()
    for _, report in reports:
        print(render.table(report))
    command = command_line(argv)
    if args.markdown is not None:
        args.markdown.write_text(render.markdown(reports, command, notes=args.note))
        print(f"wrote {args.markdown}")
    if args.json is not None:
        from vllm_kv_conformance.runner import vllm_version

        title = args.title or f"vLLM {vllm_version()}"
        record = render.run_record(title, command, entries)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 1 if broken or any(r.failed for _, r in reports) else 0


def command_line(argv: list[str] | None) -> str:
    """This command as a shell line, one option per line (the Markdown's head)."""
    parts: list[str] = []
    for arg in argv if argv is not None else sys.argv[1:]:
        if arg.startswith("--") or not parts:
            parts.append(shlex.quote(arg))
        else:
            parts[-1] += " " + shlex.quote(arg)
    return " \\\n    ".join(["vllm-kv-conformance", *parts])


def merge(args: argparse.Namespace, argv: list[str] | None) -> int:
    """``--merge``: the Markdown of earlier ``--json`` runs; exits 1 when one
    of them has a failure, as the runs did."""
    from vllm_kv_conformance import report as render

    if args.markdown is None or args.kv_transfer_config:
        print(
            "--merge takes --markdown OUT and no --kv-transfer-config", file=sys.stderr
        )
        return 2
    try:
        runs = [json.loads(path.read_text()) for path in args.merge]
    except (OSError, json.JSONDecodeError) as e:
        print(f"--merge: {e}", file=sys.stderr)
        return 2
    args.markdown.write_text(
        render.merged_markdown(
            runs, args.command or command_line(argv), notes=args.note
        )
    )
    print(f"wrote {args.markdown}")
    failed = any(
        entry.get("not_run", {}).get("status") == "FAIL"
        or any(
            r["status"] == "FAIL" for r in entry.get("report", {}).get("results", [])
        )
        for run in runs
        for entry in run["entries"]
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""``gpu_ttft.py``'s time plan and summary: what each process will measure,
its estimated seconds, what is trimmed to fit ``--budget-s``, and the
markdown table rebuilt from ``results.jsonl``. Imports neither torch nor
vLLM, so ``--plan-only`` and ``--summarize`` answer at once.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Seconds per unit. On a GPU: the H200 run 1 of docs/gpu.md
# (docs/gpu/gpu_ttft-run1.json), except where marked "estimate"; an H100
# is taken to be as fast (its link and HBM are slower, its runs were not
# kept). --tiny: this script's --tiny runs on 2 CPU cores.
ESTIMATES: dict[str, dict[str, float]] = {
    "gpu": {
        # A process's wall less its requests: 35-45 s (Python and vLLM
        # imports, engine start, dummy weights, exit with its pinned memory).
        "process_s": 40.0,
        # The first process: run 1's first engine start took 29.8 s, the
        # others 8-17 s (file caches cold).
        "first_process_s": 20.0,
        # CUDA graph capture and torch.compile on top of an eager start: run
        # 3's process with graphs took 115 s, the same process eager 61 s.
        "graphs_s": 55.0,
        # A recompute of L tokens is a*L + b*L^2: fitted to run 1's 0.098 s
        # at 4k and 1.247 s at 32k (Llama-3.1-8B shape, bf16, V2).
        "prefill_a": 2.19e-5,
        "prefill_b": 4.93e-10,
        # A hit is at most this share of a recompute (run 1: OffloadingConnector
        # 0.036/0.098 s at 4k, 0.131/1.247 s at 32k).
        "hit_share": 0.4,
        # A save waited for by the next reset: 128 KiB of KV per token written
        # at about 2 GB/s (estimate).
        "save_s_per_token": 6.5e-5,
        # A read from the store (page cache, 8 threads): 0.15-0.17 s for 32k
        # tokens measured on the H100 host (docs/gpu.md), rounded up.
        "read_s_per_token": 6e-6,
        # One decode step, 0.024-0.029 s in run 1 (a resident hit).
        "decode_s": 0.03,
    },
    "tiny": {
        "process_s": 14.0,
        "first_process_s": 2.0,
        "graphs_s": 30.0,
        "prefill_a": 2e-4,
        "prefill_b": 0.0,
        "hit_share": 0.5,
        "save_s_per_token": 1e-5,
        "read_s_per_token": 1e-5,
        "decode_s": 0.02,
    },
}

GREEDY = "greedy"  # a step's item: the greedy check, not a prompt length
TOKENS = 16  # the greedy check's answer

# role -> the figure whose presence means the step was measured
MAIN_FIGURE = {
    "recompute": "recompute",
    "offload": "hit",
    "store": "hot hit",
    "cold": "cold hit",
}


@dataclass
class Process:
    """One engine in its own process: a runner and a connector."""

    name: str
    runner: str  # "v2" (Model Runner V2) or "v1"
    connector: str  # none, offload, store, store-async
    role: str  # a key of MAIN_FIGURE
    graphs: bool = False
    writer: str | None = None  # cold: the process whose store it reads
    note: str = ""  # why this process runs differently from what was asked


@dataclass
class Step:
    process: str
    item: int | str  # a prompt length, or GREEDY
    est_s: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.process}@{self.item}"


@dataclass
class Plan:
    plan: int
    tiny: bool
    budget_s: float
    lengths: list[int]
    greedy_length: int
    processes: list[Process]
    steps: list[Step]  # most important first: trimmed from the end
    trimmed: list[dict[str, str]] = field(default_factory=list)
    machine: str = ""

    def process(self, name: str) -> Process:
        return next(p for p in self.processes if p.name == name)

    def start_s(self, name: str) -> float:
        """A process's own seconds, not its steps'."""
        e = ESTIMATES["tiny" if self.tiny else "gpu"]
        running = {s.process for s in self.steps}
        first = next(p.name for p in self.processes if p.name in running)
        extra = e["graphs_s"] if self.process(name).graphs else 0.0
        return e["process_s"] + extra + (e["first_process_s"] if name == first else 0)

    def total_s(self) -> float:
        running = dict.fromkeys(s.process for s in self.steps)
        return sum(self.start_s(p) for p in running) + sum(s.est_s for s in self.steps)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["steps"] = [{**asdict(s), "step": s.name} for s in self.steps]
        out["total_s"] = round(self.total_s(), 1)
        out["estimates"] = ESTIMATES["tiny" if self.tiny else "gpu"]
        return out


def step_s(
    role: str, item: int | str, greedy_length: int, e: dict[str, float]
) -> float:
    """A step's estimated seconds: every request it makes, and the saves its
    resets wait for."""

    def prefill(n: int) -> float:
        return e["prefill_a"] * n + e["prefill_b"] * n * n

    def hit(n: int) -> float:
        return e["hit_share"] * prefill(n) + e["decode_s"]

    if item == GREEDY:  # computed, resident, store hit and control, 16 tokens each
        n = greedy_length
        answers = 4 * TOKENS * e["decode_s"]
        return 2 * prefill(n) + 2 * hit(n) + 2 * n * e["save_s_per_token"] + answers
    n = int(item)
    if role == "recompute":  # warm-up, recompute, two resident hits
        return 2 * prefill(n) + 2 * hit(n)
    if role == "cold":  # the warm-up prompt and the prompt, both from the store
        return 2 * (hit(n) + n * e["read_s_per_token"])
    # warm-up and first request (each saved), two hits
    return 2 * prefill(n) + 2 * n * e["save_s_per_token"] + 2 * hit(n)


def make_plan(number: int, tiny: bool, budget_s: float) -> Plan:
    """Plan 1 (Model Runner V2: recompute, OffloadingConnector, StoreConnector
    first request, hot and cold hits, the greedy check) or plan 2 (V1, CUDA
    graphs, ``load_async``), trimmed to ``budget_s``."""
    lengths = [256, 2048] if tiny else [4096, 32768]
    # 16k+1: the resident hit and the store's hit both leave the last token
    # to compute (the store offers one short of the prompt), so the two
    # answers come from the same split of the prompt and must be equal.
    greedy_length = 1025 if tiny else 16385
    short, long = lengths
    if number == 1:
        processes = [
            Process("recompute", "v2", "none", "recompute"),
            Process("offload", "v2", "offload", "offload"),
            Process("store", "v2", "store", "store"),
            Process("store-cold", "v2", "store", "cold", writer="store"),
        ]
        order = [
            ("store", long), ("store-cold", long), ("store", GREEDY),
            ("store", short), ("recompute", long), ("offload", long),
            ("store-cold", short), ("recompute", short), ("offload", short),
        ]  # fmt: skip
    elif number == 2:
        processes = [
            Process("v1-recompute", "v1", "none", "recompute"),
            Process("v1-store", "v1", "store", "store"),
            Process("v2-store-graphs", "v2", "store", "store", graphs=True),
            Process("v2-store-async", "v2", "store-async", "store"),
            Process("v2-store-async-cold", "v2", "store-async", "cold",
                    writer="v2-store-async"),
        ]  # fmt: skip
        order = [
            ("v1-store", long), ("v2-store-async", long),
            ("v2-store-async-cold", long), ("v2-store-graphs", long),
            ("v1-recompute", long), ("v2-store-async", GREEDY),
            ("v1-store", GREEDY), ("v2-store-graphs", GREEDY), ("v1-store", short),
            ("v2-store-async", short), ("v2-store-graphs", short),
            ("v1-recompute", short), ("v2-store-async-cold", short),
        ]  # fmt: skip
    else:
        raise ValueError(f"no plan {number}")
    unplanned: list[dict[str, str]] = []
    if tiny:
        for p in processes:
            if p.runner == "v2":
                p.runner = "v1"
                p.note = "Model Runner V2 needs Triton, which CPU builds lack: V1"
        for p in [p for p in processes if p.connector == "offload"]:
            # OffloadingConnector's CPU tier moves blocks off a GPU only.
            processes.remove(p)
            reason = "not on CPU: OffloadingConnector needs a CUDA or XPU GPU"
            unplanned += [
                {"step": f"{p.name}@{i}", "reason": reason}
                for name, i in order
                if name == p.name
            ]
            order = [(name, i) for name, i in order if name != p.name]
    e = ESTIMATES["tiny" if tiny else "gpu"]
    roles = {p.name: p.role for p in processes}
    steps = [
        Step(name, item, round(step_s(roles[name], item, greedy_length, e), 2))
        for name, item in order
    ]
    plan = Plan(number, tiny, budget_s, lengths, greedy_length, processes, steps)
    plan.trimmed = unplanned + trim(plan)
    return plan


def trim(plan: Plan) -> list[dict[str, str]]:
    """Drop the least important steps until the estimate fits the budget.
    Each plan ranks a cold hit below the step that stored its prompt, so a
    cold hit never outlives its writer (test_gpu_ttft_tiny.py checks)."""
    trimmed: list[dict[str, str]] = []
    while plan.steps and plan.total_s() > plan.budget_s:
        reason = f"time plan: {plan.total_s():.0f} s > budget {plan.budget_s:.0f} s"
        trimmed.append({"step": plan.steps.pop().name, "reason": reason})
    return trimmed


def render_plan(plan: Plan) -> list[str]:
    where = "2 CPU cores (--tiny)" if plan.tiny else "an H100/H200"
    lines = [
        f"TIME PLAN: plan {plan.plan}, estimated for {where} "
        "(bench/gpu_plan.py ESTIMATES)",
        f"  {'step':<36} {'runner':<10} {'connector':<12} {'est s':>7}",
    ]
    for p in plan.processes:
        steps = [s for s in plan.steps if s.process == p.name]
        if not steps:
            continue
        runner = p.runner + (" graphs" if p.graphs else "")
        start = f"{p.name} (process start)"
        lines.append(
            f"  {start:<36} {runner:<10} {p.connector:<12} {plan.start_s(p.name):>7.1f}"
        )
        lines += [f"  {s.name:<36} {'':<10} {'':<12} {s.est_s:>7.1f}" for s in steps]
    lines += [
        f"  note: {n}" for n in dict.fromkeys(p.note for p in plan.processes if p.note)
    ]
    fits = "fits" if plan.total_s() <= plan.budget_s else "DOES NOT FIT"
    lines.append(
        f"  total {plan.total_s():.1f} s of a {plan.budget_s:.0f} s budget: {fits}"
    )
    if plan.trimmed:
        lines.append("  trimmed (not run):")
        lines += [f"    {t['step']}: {t['reason']}" for t in plan.trimmed]
    else:
        lines.append("  trimmed: none")
    return lines


def read_results(out: Path) -> list[dict[str, Any]]:
    """``results.jsonl``'s lines; a line cut short by a kill is skipped."""
    path = out / "results.jsonl"
    rows: list[dict[str, Any]] = []
    if not path.exists():
        return rows
    for text in path.read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(text))
        except json.JSONDecodeError:
            continue
    return rows


def summarize(out: Path) -> str:
    """The markdown summary of ``out``'s plan.json and results.jsonl, as
    far as they go; every planned figure not there is listed as missed."""
    plan = json.loads((out / "plan.json").read_text())
    rows = read_results(out)
    figures = [r for r in rows if "figure" in r]
    exits = {r["process"]: r for r in rows if r.get("event") == "exit"}
    starts = {r["process"]: r for r in rows if r.get("event") == "start"}
    procs = {p["name"]: p for p in plan["processes"]}

    def best(process: str, figure: str, length: int) -> dict[str, Any] | None:
        found = [
            r
            for r in figures
            if r["process"] == process
            and r["figure"] == figure
            and r["length"] == length
        ]
        return min(found, key=lambda r: r["s"]) if found else None

    recompute = {r["length"]: r["s"] for r in figures if r["figure"] == "recompute"}
    lines = [
        f"# gpu_ttft.py plan {plan['plan']}"
        + (" (--tiny, CPU)" if plan["tiny"] else ""),
        "",
        f"Machine: {plan['machine']}",
        f"Time plan: {plan['total_s']} s estimated, budget {plan['budget_s']:.0f} s; "
        f"the processes took {sum(e['wall_s'] for e in exits.values()):.1f} s.",
        "",
        "| process | runner | L | figure | s (best) | vs recompute | cached "
        "| tokens from host tier | tokens from store | pid |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    order = ["recompute", "resident hit", "first request", "hit", "hot hit", "cold hit"]
    # In the order the processes ran, shortest prompt first.
    run_order = [p["name"] for p in plan["processes"]]
    measured = sorted(
        (s for s in plan["steps"] if s["item"] != GREEDY),
        key=lambda s: (run_order.index(s["process"]), s["item"]),
    )
    for step in measured:
        name, length = step["process"], step["item"]
        runner = starts.get(name, {}).get("runner", procs[name]["runner"] + "?")
        for figure in order:
            r = best(name, figure, length)
            if r is None:
                continue
            base = recompute.get(length)
            ratio = f"{r['s'] / base:.2f}x" if base and figure != "recompute" else ""
            c = r.get("counters", {})
            lines.append(
                f"| {name} | {runner} | {length} | {figure} | {r['s']:.3f} s | {ratio} "
                f"| {r['cached']} | {c.get('host_tier_loaded_tokens', '')} "
                f"| {c.get('store_loaded_tokens', '')} | {r['pid']} |"
            )
    missed = [dict(t) for t in plan["trimmed"]]
    for step in plan["steps"]:
        name, item = step["process"], step["item"]
        main = "greedy" if item == GREEDY else MAIN_FIGURE[procs[name]["role"]]
        if any(
            r["process"] == name and r["figure"] == main and r["length"] == (
                plan["greedy_length"] if item == GREEDY else item)
            for r in figures
        ):  # fmt: skip
            continue
        end = exits.get(name)
        if end is None:
            why = "no result: the run ended (killed or timed out) before it"
        elif end["rc"] == "timeout":
            why = f"timeout: stopped at the budget after {end['wall_s']} s"
        elif isinstance(end["rc"], str):
            why = end["rc"]
        else:
            why = f"process exited rc={end['rc']} before it (see processes.log)"
        missed.append({"step": step["step"], "reason": why})
    lines.append("")
    for r in [r for r in figures if r["figure"] == "greedy"]:
        same = "YES" if r["same"] else "NO"
        lines.append(
            f"Greedy check at {r['length']} tokens ({r['process']}, {r['runner']}): "
            f"StoreConnector's hit ({r['cached']} tokens cached, "
            f"{r['counters'].get('host_tier_loaded_tokens', 0)} from the host tier, "
            f"{r['counters'].get('store_loaded_tokens', 0)} from the store) answers "
            f"as vLLM's resident prefix-cache hit: **{same}**; a control prompt "
            f"answers differently: {'yes' if r['control_differs'] else 'no'}."
        )
        if not r["same"]:
            missed.append({"step": f"{r['process']}@{GREEDY}",
                           "reason": "NO: the hit's answer differs"})  # fmt: skip
    lines += ["", "Missed:"]
    if missed:
        lines += ["", "| step | reason |", "|---|---|"]
        lines += [f"| {m['step']} | {m['reason']} |" for m in missed]
    else:
        lines.append("none.")
    return "\n".join(lines) + "\n"

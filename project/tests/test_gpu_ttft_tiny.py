"""``project/bench/gpu_ttft.py``'s own logic, on CPU: a lent GPU machine is
short (one call), and the StoreConnector hit rows of its first runs were
lost (one measured vLLM's own prefix cache, the next waited on a refused
reset, a third ran out of time with nothing written).

``--tiny`` serves a 2-layer model on CPU with StoreConnector on the path of
a KV cache on a GPU (``gpu_path_on_cpu.py``: host tier, saves on a thread, a
finished request's blocks kept until its saves are written). vLLM refuses a
prefix-cache reset while it keeps them; the benchmark steps the engine until
the reset takes, so every hit is one the store served, not vLLM's own cache.
The time plan and the summary need neither vLLM nor torch: the tests that
check them put packages on the path that fail to import. The whole ``--tiny``
plan runs in the offline kit's rehearsal (``test_offline_kit.py``), with
``check_tiny_plan_one`` below.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

BENCH = REPO / "project" / "bench" / "gpu_ttft.py"
sys.path.insert(0, str(BENCH.parent))

from gpu_plan import make_plan  # noqa: E402

SHORT, LONG, GREEDY_LENGTH = 256, 2048, 1025  # --tiny's lengths


@pytest.fixture
def no_vllm(tmp_path: Path) -> dict[str, str]:
    """An environment where importing vllm or torch fails."""
    poison = tmp_path / "poison"
    for name in ("vllm", "torch"):
        (poison / name).mkdir(parents=True)
        (poison / name / "__init__.py").write_text(f"raise ImportError('{name}')\n")
    return {**os.environ, "PYTHONPATH": str(poison)}


def bench(*args: str, env: dict[str, str] | None = None, timeout: float = 60):
    return subprocess.run(
        [sys.executable, str(BENCH), *args],
        capture_output=True, text=True, timeout=timeout, env=env, check=False,
    )  # fmt: skip


def rows(out: Path) -> list[dict[str, Any]]:
    lines = (out / "results.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_plan_only_prints_the_time_plan_without_vllm(no_vllm: dict[str, str]):
    started = time.monotonic()
    run = bench("--plan-only", env=no_vllm)
    assert run.returncode == 0, run.stderr
    assert time.monotonic() - started < 10
    lines = run.stdout.splitlines()
    assert lines[0].startswith("TIME PLAN: plan 1")
    for step in ("recompute@4096", "offload@32768", "store@32768", "store@greedy",
                 "store-cold@32768", "store-cold (process start)"):  # fmt: skip
        assert any(line.strip().startswith(step + " ") for line in lines[1:]), step
    assert "of a 330 s budget: fits" in run.stdout
    assert "trimmed: none" in run.stdout
    second = bench("--plan-only", "--plan", "2", env=no_vllm)
    assert second.returncode == 0, second.stderr
    assert "v2-store-graphs" in second.stdout and "v2-store-async-cold" in second.stdout


def test_a_small_budget_trims_the_least_important_steps_first(
    no_vllm: dict[str, str],
):
    full = make_plan(1, tiny=False, budget_s=330)
    assert full.total_s() <= 330 and not full.trimmed
    plan = make_plan(1, tiny=False, budget_s=150)
    assert plan.total_s() <= 150
    gone = [t["step"] for t in plan.trimmed]
    # Least important first: the 4k baselines, then OffloadingConnector's
    # process as a whole, before any StoreConnector hit at 32k.
    assert gone[:3] == ["offload@4096", "recompute@4096", "store-cold@4096"]
    kept = [s.name for s in plan.steps]
    assert kept[:3] == ["store@32768", "store-cold@32768", "store@greedy"]
    assert all("time plan" in t["reason"] for t in plan.trimmed)
    assert make_plan(1, tiny=False, budget_s=45).steps == []
    # A cold hit reads what its writer's step stored: ranked below it, it
    # is trimmed first.
    for number in (1, 2):
        ranked = make_plan(number, tiny=False, budget_s=330)
        names = [s.name for s in ranked.steps]
        for step in ranked.steps:
            writer = ranked.process(step.process).writer
            if writer is not None:
                assert names.index(f"{writer}@{step.item}") < names.index(step.name)
    run = bench("--plan-only", "--budget-s", "150", env=no_vllm)
    assert run.returncode == 0 and "trimmed (not run):" in run.stdout
    assert "offload@4096: time plan" in run.stdout


def test_summarize_rebuilds_the_table_from_a_partial_results_file(
    tmp_path: Path, no_vllm: dict[str, str]
):
    """What a run stopped in its second process left: a figure of the
    first, and a line the kill cut short."""
    plan = make_plan(1, tiny=True, budget_s=330)
    plan.machine = "test"
    (tmp_path / "plan.json").write_text(json.dumps(plan.to_json()))
    measured = {"process": "recompute", "pid": 11, "runner": "v1", "length": SHORT,
                "counters": {}, "cached": 0}  # fmt: skip
    lines = [
        {"process": "recompute", "pid": 11, "runner": "v1", "event": "start"},
        {**measured, "figure": "recompute", "s": 0.5},
        {"process": "recompute", "event": "exit", "rc": 0, "wall_s": 9.0},
        {"process": "store", "pid": 12, "runner": "v1", "event": "start"},
        {**measured, "process": "store", "figure": "first request", "s": 0.2},
        {**measured, "process": "store", "figure": "hot hit", "s": 0.05,
         "cached": SHORT - 1, "counters": {"host_tier_loaded_tokens": SHORT}},
        {"process": "store-cold", "event": "exit", "rc": "timeout", "wall_s": 3.0},
    ]  # fmt: skip
    text = "".join(json.dumps(line) + "\n" for line in lines) + '{"process": "st'
    (tmp_path / "results.jsonl").write_text(text)
    run = bench("--summarize", str(tmp_path), env=no_vllm)
    assert run.returncode == 0, run.stderr
    summary = (tmp_path / "summary.md").read_text()
    assert summary == run.stdout
    # Each count in its own column: tokens from the host tier, then from
    # the store (a hot hit's come from the tier alone).
    header = next(line for line in summary.splitlines() if "tokens from" in line)
    assert header.index("from host tier") < header.index("from store")
    assert (
        f"| store | v1 | {SHORT} | hot hit | 0.050 s | 0.10x | {SHORT - 1} "
        f"| {SHORT} |  | 11 |" in summary
    )
    missed = summary.split("Missed:")[1]
    assert f"| recompute@{LONG} | process exited rc=0 before it" in missed
    assert f"| store@{SHORT} |" not in missed
    for step in (f"store@{LONG}", "store@greedy"):
        assert f"| {step} | no result: the run ended" in missed
    assert f"| store-cold@{SHORT} | timeout: stopped at the budget" in missed
    assert f"| offload@{SHORT} | not on CPU" in missed


def check_tiny_plan_one(stdout: str, out: Path) -> None:
    """What ``gpu_ttft.py --tiny``'s plan 1 must have measured and written:
    the offline rehearsal (``test_offline_kit.py``) runs it through the kit."""
    log = (out / "processes.log").read_text()
    # The plan comes before any engine starts.
    assert stdout.index("TIME PLAN: plan 1") < stdout.index("== recompute: rc=0")
    assert stdout.index("trimmed") < stdout.index("== recompute: rc=0")
    assert len(list(out.iterdir())) <= 8
    results = rows(out)
    starts = {r["process"]: r for r in results if r.get("event") == "start"}
    assert set(starts) == {"recompute", "store", "store-cold"}
    # Model Runner V2 needs Triton; on CPU the plan asks for V1 and says so.
    assert {r["runner"] for r in starts.values()} == {"v1"}
    assert all(".cpu_model_runner." in r["model_runner"] for r in starts.values())
    assert "needs Triton" in stdout
    writer, cold = starts["store"]["pid"], starts["store-cold"]["pid"]
    assert writer != cold

    def figure(process: str, name: str, length: int) -> list[dict[str, Any]]:
        return [
            r
            for r in results
            if r.get("figure") == name
            and r["process"] == process
            and r["length"] == length
        ]

    for length in (SHORT, LONG):
        (first,) = figure("store", "first request", length)
        assert first["cached"] == 0
        hot = figure("store", "hot hit", length)
        assert [h["cached"] for h in hot] == [length - 1] * 2
        assert [h["tokens"] for h in hot] == [first["tokens"]] * 2
        assert all(h["counters"]["host_tier_loaded_tokens"] >= length - 1 for h in hot)
        assert all("store_loaded_tokens" not in h["counters"] for h in hot)
        (hit,) = figure("store-cold", "cold hit", length)
        assert hit["pid"] == cold and hit["cached"] == length - 1
        assert hit["counters"]["store_loaded_tokens"] >= length - 1
        assert "host_tier_loaded_tokens" not in hit["counters"]
        assert hit["tokens"] == first["tokens"]
        (recomputed,) = figure("recompute", "recompute", length)
        assert recomputed["cached"] == 0
    (greedy,) = figure("store", "greedy", GREEDY_LENGTH)
    assert greedy["same"] and greedy["cached"] == GREEDY_LENGTH - 1
    assert greedy["resident_cached"] > 0
    assert greedy["counters"]["host_tier_loaded_tokens"] > 0
    # Each reset took (before the first request and each hit, at both
    # lengths; three for the greedy check; one at the end), so vLLM's own
    # cache was empty at each hit. The first follows the warm-up request,
    # whose saves kept its blocks until a later step: refused at least once.
    (done,) = [r for r in results if r.get("event") == "done" and r["pid"] == writer]
    assert len(done["reset_steps"]) == 2 * 3 + 3 + 1
    assert done["reset_steps"][0] >= 1
    assert "batched transfers through a host tier" in log
    assert "Failed to reset prefix cache" in log
    summary = (out / "summary.md").read_text()
    assert f"| store-cold | v1 | {LONG} | cold hit |" in summary
    assert "as vLLM's resident prefix-cache hit: **YES**" in summary
    assert f"| offload@{LONG} | not on CPU" in summary


def test_a_killed_run_keeps_its_figures(tmp_path: Path, no_vllm: dict[str, str]):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, str(BENCH), "--tiny", "--out", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # its store, left by the kill
    )  # fmt: skip
    deadline = time.monotonic() + 120
    try:
        while (
            not (out / "results.jsonl").exists()
            or '"figure"' not in (out / "results.jsonl").read_text()
        ):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert any("figure" in r for r in rows(out))
    assert not (out / "summary.md").exists()
    run = bench("--summarize", str(out), env=no_vllm)
    assert run.returncode == 0, run.stderr
    assert "| store-cold@2048 | no result: the run ended" in run.stdout

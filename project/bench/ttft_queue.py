"""TTFT of a queue of concurrent repeats, with and without the reference
connector's ways of loading waiting requests ahead (issue 20, item 4).

Serves the TTFT bench's model (``ttft.py``: Qwen2.5-0.5B shape, the dtype
this CPU runs natively) three times on one local Redis: the reference
``StoreConnector`` as it is (``plain``), with ``prefetch_buffer`` set
(``prefetch``: waiting requests' chunks copied into a local buffer) and with
``load_async`` (``async``: hits loaded into their own blocks beside the steps
of other requests). All admit ``--max-num-seqs`` requests at once (vLLM's
default if not given). With 1, a burst of concurrent requests queues in the
scheduler, where the prefetcher sees it; with vLLM's default admission a
burst of hits is scheduled whole in one step, which loads them all before
any of them computes, unless the loads are asynchronous.

Stores ``--prompts`` different 4096-token prompts (one request each, one
after the other), then sends all their repeats at once, ``--rounds`` times to
each server in turn, and times each one's first token; then one repeat alone
on each. Prints the machine, the per-round means and one JSON line; with
``--out`` also writes ``ttft_queue.json`` and ``ttft_queue.md`` there.

``--forward-threads 1`` runs each server's forward on one OpenMP thread
(``OMP_NUM_THREADS``, threads not bound), leaving the other cores to the
store, the prefetcher or the loads: the layout of a GPU server, whose forward
does not take the CPU the loads need.

Run with ``.venv/bin/python project/bench/ttft_queue.py`` on a quiet machine
(needs ``redis-server``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "demo"))

import machine  # noqa: E402
import ttft  # noqa: E402
from serve_demo import http, metric_sum  # noqa: E402
from ttft_serve import (  # noqa: E402
    Shot,
    System,
    backing_service,
    first_token,
    make_model,
    prompt,
    serving,
)

GOAL = 1.5  # issue 20: mean TTFT with prefetch at least 1.5x better
PREFETCH_BUFFER = "2GiB"  # every prompt's chunks at once, in float32 too
# Server name -> what it adds to the plain server's connector settings.
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "prefetch": {"prefetch_buffer": PREFETCH_BUFFER},
    "async": {"load_async": True},
}
COUNTERS = (
    "vllm:kvlc_store_prefetched_bytes_total",
    "vllm:kvlc_store_prefetch_loaded_bytes_total",
    "vllm:kvlc_store_loaded_bytes_total",
)


def burst(url: str, prompts: list[list[int]]) -> list[Shot]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda ids: first_token(url, ids), prompts))


def counters(url: str) -> dict[str, float]:
    text = http(f"{url}/metrics")
    return {name: metric_sum(text, name) or 0.0 for name in COUNTERS}


def table(result: dict[str, Any]) -> str:
    admission = result["max_num_seqs"] or "vLLM's default"
    threads = result.get("forward_threads") or "vLLM's default (one per core)"
    rows = [
        f"Machine: {result['machine']}; {result['dtype']}; "
        f"--max-num-seqs {admission}; forward threads {threads}; "
        f"{result['prompts']} concurrent "
        f"4096-token repeats on Redis, {result['rounds']} rounds per server.",
        "",
        "| server | mean TTFT per round (ms) | mean (ms) | one repeat alone (ms) |",
        "|---|---|---|---|",
    ]
    for name in VARIANTS:
        means = result[name]["round_means_s"]
        rows.append(
            f"| {name} | {', '.join(f'{m * 1e3:.0f}' for m in means)} | "
            f"{statistics.mean(means) * 1e3:.0f} | "
            f"{result[name]['alone_s'] * 1e3:.0f} |"
        )
    rows.append("")
    for name, ratio in result["ratios"].items():
        rows.append(
            f"- {name}: {ratio:.2f}x better mean TTFT than plain (goal {GOAL}x: "
            f"{'met' if ratio >= GOAL else 'missed'})"
        )
    rows.append(
        f"- {result['from_buffer_share'] * 100:.0f}% of the prefetch server's "
        "loaded bytes came from its buffer."
    )
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--forward-threads", type=int)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    dtype = machine.native_dtype()
    python = Path(sys.executable)
    make_model(python, dtype)
    print(f"{machine.describe()}; {dtype}", flush=True)
    # Every prompt's KV at once: 8 x 4096 tokens are 0.4 GB in bf16, 0.8 in fp32.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    if args.forward_threads:
        os.environ["OMP_NUM_THREADS"] = str(args.forward_threads)
    prompts = [prompt(500 + i) for i in range(args.prompts)]
    admit = ["--max-num-seqs", str(args.max_num_seqs)] if args.max_num_seqs else []
    shots: dict[str, list[list[Shot]]] = {name: [] for name in VARIANTS}
    alone: dict[str, Shot] = {}
    with (
        tempfile.TemporaryDirectory(prefix="kvlc-ttft-queue-") as tmp,
        ExitStack() as stack,
    ):
        scratch = Path(tmp)
        redis = stack.enter_context(
            backing_service("store-redis", scratch / "redis", python)
        )
        assert redis.kv_config is not None
        extra = redis.kv_config["kv_connector_extra_config"]
        systems = {
            name: System(
                name,
                python,
                {**redis.kv_config, "kv_connector_extra_config": {**extra, **more}},
                serve_args=admit,
            )
            for name, more in VARIANTS.items()
        }
        urls = {
            name: stack.enter_context(serving(system, scratch, dtype))[0]
            for name, system in systems.items()
        }
        for url in urls.values():
            first_token(url, prompt(1500, ttft.WARMUP_TOKENS))
        for ids in prompts:
            time.sleep(ttft.PAUSE_S)
            first_token(urls["plain"], ids)  # stores it: a miss
        before = counters(urls["prefetch"])
        for r in range(args.rounds):
            order = list(VARIANTS)[r % len(VARIANTS) :] + list(VARIANTS)
            for name in order[: len(VARIANTS)]:
                time.sleep(ttft.PAUSE_S)
                shots[name].append(burst(urls[name], prompts))
                mean = statistics.mean(s.ttft_s for s in shots[name][-1])
                print(f"round {r} {name}: mean TTFT {mean * 1e3:.0f} ms", flush=True)
        after = counters(urls["prefetch"])
        for name, url in urls.items():
            time.sleep(ttft.PAUSE_S)
            alone[name] = first_token(url, prompts[0])
    grew = {k: after[k] - before[k] for k in COUNTERS}
    for name, rounds in shots.items():
        uncached = [
            s for b in rounds for s in b if s.cached_tokens < s.prompt_tokens - 1
        ]
        if uncached:
            raise RuntimeError(f"{name}: {len(uncached)} repeats missed the store")
    result: dict[str, Any] = {
        "machine": machine.describe(),
        "dtype": dtype,
        "max_num_seqs": args.max_num_seqs,
        "forward_threads": args.forward_threads,
        "prompts": args.prompts,
        "rounds": args.rounds,
        **{
            name: {
                "round_means_s": [statistics.mean(s.ttft_s for s in b) for b in rounds],
                "ttft_s": [[s.ttft_s for s in b] for b in rounds],
                "alone_s": alone[name].ttft_s,
            }
            for name, rounds in shots.items()
        },
        "prefetch_counters": grew,
    }
    plain = statistics.mean(result["plain"]["round_means_s"])
    result["ratios"] = {
        name: plain / statistics.mean(result[name]["round_means_s"])
        for name in VARIANTS
        if name != "plain"
    }
    loaded = grew["vllm:kvlc_store_loaded_bytes_total"]
    result["from_buffer_share"] = (
        grew["vllm:kvlc_store_prefetch_loaded_bytes_total"] / loaded if loaded else 0.0
    )
    print(table(result), end="")
    print(json.dumps(result))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ttft_queue.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "ttft_queue.md").write_text(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

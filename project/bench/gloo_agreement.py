"""What the rank agreement of ``before_update_states`` costs per step.

In a step where some request may take a worker-side hit, every tensor-parallel
rank joins one MIN all-reduce on the TP group's gloo (CPU) group:
``external_hits.all_reduce_min([*hits_per_request, failed_rank], groups)``.
This starts ``world_size`` processes on one machine, joins them in a gloo
group over TCP on the loopback, and times that same function (imported from
the installed patched vLLM) per call, for 1, 16 and 256 requests that may
take a hit.

Prints the machine, the load average before the run, and one line per world
size and request count (median, p90, p99 of the per-call time on rank 0, and
the largest median over the ranks), then one JSON object with the same.

    python project/bench/gloo_agreement.py [--world-sizes 2 4 8] [--iters 2000]

On a machine with fewer cores than ranks the ranks share cores, so the time
includes waiting to be scheduled: it is the cost on that machine, an upper
bound for ranks on their own cores, not a GPU server's figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

REQUEST_COUNTS = (1, 16, 256)
WARMUP = 50


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _rank(rank: int, world_size: int, port: int, iters: int, results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    from vllm.distributed.kv_transfer.kv_connector.v1.external_hits import (
        all_reduce_min,
    )

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=300),
    )
    # The TP group's cpu_group is a gloo group made with new_group().
    group = dist.new_group(list(range(world_size)), backend="gloo")
    timings: dict[int, list[float]] = {}
    for num_requests in REQUEST_COUNTS:
        # Per request the tokens this rank may skip, then the failure slot.
        values = [16 * (rank + 1)] * num_requests + [2**62]
        dist.barrier(group)
        for _ in range(WARMUP):
            all_reduce_min(values, [group])
        dist.barrier(group)
        samples = []
        for _ in range(iters):
            start = time.perf_counter()
            agreed = all_reduce_min(values, [group])
            samples.append(time.perf_counter() - start)
        assert agreed[0] == 16, agreed
        timings[num_requests] = samples
    results.put((rank, timings))
    dist.barrier(group)
    dist.destroy_process_group()


def run(world_size: int, iters: int) -> dict[int, dict[str, float]]:
    from vllm.utils.network_utils import get_open_port

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = get_open_port()
    procs = [
        ctx.Process(target=_rank, args=(r, world_size, port, iters, results))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    by_rank = dict(results.get(timeout=900) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"a rank failed: {[p.exitcode for p in procs]}")
    summary: dict[int, dict[str, float]] = {}
    for num_requests in REQUEST_COUNTS:
        rank0 = by_rank[0][num_requests]
        summary[num_requests] = {
            "median_us": statistics.median(rank0) * 1e6,
            "p90_us": _percentile(rank0, 0.90) * 1e6,
            "p99_us": _percentile(rank0, 0.99) * 1e6,
            "max_rank_median_us": max(
                statistics.median(t[num_requests]) for t in by_rank.values()
            )
            * 1e6,
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()

    import machine

    load = os.getloadavg()
    print(f"machine: {machine.describe()}")
    print(f"load average before the run: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    out: dict[str, Any] = {
        "machine": machine.describe(),
        "loadavg_before": load,
        "iters": args.iters,
        "results": {},
    }
    for world_size in args.world_sizes:
        summary = run(world_size, args.iters)
        out["results"][world_size] = summary
        for num_requests, s in summary.items():
            print(
                f"TP={world_size} requests={num_requests}: median "
                f"{s['median_us']:.0f} us, p90 {s['p90_us']:.0f} us, p99 "
                f"{s['p99_us']:.0f} us (slowest rank's median "
                f"{s['max_rank_median_us']:.0f} us)",
                flush=True,
            )
    out["loadavg_after"] = os.getloadavg()
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""What ``before_update_states`` costs on the worker (patched build only).

Prints one JSON object with:

* ``engine``: a real engine run of the demo model with ``ExampleConnector``
  (which does not override the hook), counting scheduler steps, hook calls,
  hit applications and ``torch.distributed.all_reduce`` calls in the engine
  process (in-process engine: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``);
* ``apply``: seconds per application of a hit for every request (the
  worker's eligibility limits, then ``apply_external_hits``; the hook and the
  rank agreement left out) on a real first-step scheduler output with n newly
  scheduled prefills, beside the seconds of that ``schedule()`` call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def counting(
    counts: Counter[str], name: str, fn: Callable[..., Any]
) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        counts[name] += 1
        return fn(*args, **kwargs)

    return wrapper


def engine_counts(model_dir: str, prompts: int) -> dict[str, int]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch.distributed as dist
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1 import external_hits

    counts: Counter[str] = Counter()
    patches = [
        (KVConnectorBase_V1, "before_update_states"),
        (external_hits, "apply_external_hits"),
        (external_hits.WorkerExternalHits, "limits"),
        (Scheduler, "schedule"),
        (dist, "all_reduce"),
    ]
    for owner, name in patches:
        setattr(owner, name, counting(counts, name, getattr(owner, name)))
    with tempfile.TemporaryDirectory() as storage:
        llm = LLM(
            model=model_dir,
            max_model_len=1024,
            enable_prefix_caching=False,
            kv_transfer_config={
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": storage},
            },
        )
        text = "A key-value cache stores attention keys and values. " * 30
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        for _ in range(2):
            llm.generate([text] * prompts, params, use_tqdm=False)
    return {
        "steps": counts["schedule"],
        "before_update_states_calls": counts["before_update_states"],
        "apply_external_hits_calls": counts["apply_external_hits"],
        "external_hit_limits_calls": counts["limits"],
        "all_reduce_calls": counts["all_reduce"],
    }


def apply_cost(model_dir: str, n: int, reps: int) -> dict[str, float]:
    from types import SimpleNamespace

    from scheduler_step import PROMPT_LEN, Workload, make_scheduler

    from vllm.distributed.kv_transfer.kv_connector.v1.external_hits import (
        WorkerExternalHits,
        apply_external_hits,
    )

    scheduler = make_scheduler(
        model_dir, n, None, max_num_seqs=n, max_num_batched_tokens=n * PROMPT_LEN
    )
    workload = Workload()
    for _ in range(n):
        scheduler.add_request(workload.request())
    t0 = time.perf_counter()
    so = scheduler.schedule()
    schedule_s = time.perf_counter() - t0
    assert len(so.scheduled_new_reqs) == n, len(so.scheduled_new_reqs)
    # A connector stand-in: the worker only reads its KV cache config (one
    # group, no Mamba layers: hits allowed).
    connector: Any = SimpleNamespace(
        _kv_cache_config=SimpleNamespace(has_mamba_layers=False, kv_cache_groups=[None])
    )
    worker = WorkerExternalHits(connector)
    seconds = []
    for _ in range(reps):
        t0 = time.perf_counter()
        limits = worker.limits(so)
        hits = {req_id: min(32, limit) for req_id, limit in limits.items()}
        applied = apply_external_hits(so, hits, "bench")
        seconds.append(time.perf_counter() - t0)
    assert applied.total_num_scheduled_tokens == so.total_num_scheduled_tokens - 32 * n
    return {"apply_s": statistics.median(seconds), "schedule_s": schedule_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--sizes", default="64,512,4096")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=4)
    args = p.parse_args()
    apply = {
        n: apply_cost(args.model_dir, n, args.reps)
        for n in (int(s) for s in args.sizes.split(","))
    }
    engine = engine_counts(args.model_dir, args.prompts)
    print(json.dumps({"engine": engine, "apply": apply}))


if __name__ == "__main__":
    main()

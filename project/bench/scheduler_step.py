"""Time ``Scheduler.schedule()`` + ``update_from_output()`` with no model.

Run with the python of the vLLM install under test; prints one JSON object:
``{"vllm": version, "results": {"<connector>/<n>": [[seconds per step, ...], ...]}}``,
one list per repetition (a fresh scheduler on the same workload each time).
The same script runs against the unpatched and the patched build, so it only
uses APIs both have (the lifecycle connector only where it exists).

Workload, per (connector, n): prefix caching on, block size 16, ``n`` requests
always in the system (``n/2`` may run, the rest wait), 96-token prompts that
share their first block, 8 output tokens each; a finished request is replaced
by a new one at once, so every step admits, prefills, decodes and frees.
The workload is deterministic (run it with a fixed ``PYTHONHASHSEED``): step
``i`` does the same work in every repetition and every process, which is what
lets ``run.py`` take the fastest sample of each step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# This directory (the test connectors) and project/ (the scheduler harness).
sys.path[:0] = [str(HERE), str(HERE.parent)]

import bench_connectors  # noqa: E402
from testing import scheduler_harness  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

import vllm  # noqa: E402

BLOCK_SIZE = 16
PROMPT_LEN = 96
MAX_TOKENS = 8
EOS = 2

CONNECTORS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "legacy": {"kv_connector": "LegacyLookupConnector"},
    # Only where the installed vLLM has the lifecycle API (see bench_connectors).
    "lifecycle": {"kv_connector": "LifecycleLookupConnector"},
    "multi": {
        "kv_connector": "MultiConnector",
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": "LegacyLookupConnector",
                    "kv_role": "kv_both",
                    "kv_connector_module_path": "bench_connectors",
                }
            ]
            * 2
        },
    },
}


def make_scheduler(
    model_dir: str,
    n: int,
    connector: dict[str, Any] | None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int = 8192,
) -> Scheduler:
    max_len = 4096
    return scheduler_harness.make_scheduler(
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, seed=0),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs or max(n // 2, 1),
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        kv_transfer_config=(
            KVTransferConfig(
                kv_role="kv_both",
                kv_connector_module_path=(
                    "bench_connectors"
                    if connector["kv_connector"] != "MultiConnector"
                    else None
                ),
                **connector,
            )
            if connector
            else None
        ),
        num_blocks=n * (PROMPT_LEN + MAX_TOKENS) // BLOCK_SIZE * 2 + 1024,
    )


class Workload:
    def __init__(self) -> None:
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self.params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        self.params.update_from_generation_config({}, EOS)
        self.count = 0

    def request(self) -> Request:
        i = self.count
        self.count += 1
        shared = list(range(100, 100 + BLOCK_SIZE))
        unique = [(i * 7919 + k) % 30000 + 1000 for k in range(PROMPT_LEN - BLOCK_SIZE)]
        return Request(
            request_id=f"req-{i}",
            prompt_token_ids=shared + unique,
            sampling_params=self.params,
            pooling_params=None,
            block_hasher=self.hasher,
        )


def runner_output(scheduler: Scheduler, so: Any) -> ModelRunnerOutput:
    """One token per request that finished its prompt in this step."""
    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        req = scheduler.requests[req_id]
        done = req.num_computed_tokens >= req.num_prompt_tokens
        sampled.append([1000] if done else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


def measure(
    model_dir: str, connector: str, n: int, steps: int, warmup: int
) -> list[float]:
    scheduler = make_scheduler(model_dir, n, CONNECTORS[connector])
    workload = Workload()
    for _ in range(n):
        scheduler.add_request(workload.request())
    seconds = []
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        so = scheduler.schedule()
        t1 = time.perf_counter()
        output = runner_output(scheduler, so)
        t2 = time.perf_counter()
        scheduler.update_from_output(so, output)
        t3 = time.perf_counter()
        for _ in range(n - len(scheduler.requests)):
            scheduler.add_request(workload.request())
        if step >= warmup:
            seconds.append((t1 - t0) + (t3 - t2))
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--sizes", default="64,512,4096")
    p.add_argument("--connectors", default=",".join(CONNECTORS))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    results: dict[str, list[list[float]]] = {}
    for n in (int(s) for s in args.sizes.split(",")):
        for connector in args.connectors.split(","):
            if connector not in CONNECTORS or (
                connector == "lifecycle"
                and not hasattr(bench_connectors, "LifecycleLookupConnector")
            ):
                continue
            results[f"{connector}/{n}"] = [
                measure(args.model_dir, connector, n, args.steps, args.warmup)
                for _ in range(args.repeats)
            ]
    print(json.dumps({"vllm": vllm.__version__, "results": results}))


if __name__ == "__main__":
    main()

"""Drive vLLM's real Scheduler with seeded random workloads and a test connector;
print one line ``RESULT {json}``.

Usage: python external_match_driver.py CONFIG_JSON
CONFIG_JSON: {"mode": "trace" | "property", "runs": [{"seed": int, "steps": int,
"chunked": bool, "check": bool}, ...], "trace_dir": DIR (trace mode)}.

- ``trace``: RecordingLegacyConnector implements only the legacy pair
  (get_num_new_matched_tokens / update_state_after_alloc); every call the
  scheduler makes on it (method, request, arguments, block ids) and every step's
  scheduled tokens are written to ``trace_dir/<seed>.json``. Runs under the
  unpatched and the patched vLLM alike, so the traces can be compared.
- ``property``: LeasingConnector implements prepare / commit / abort, leases
  what it offers and records every broken guarantee; the result holds the
  call counts, the violations and the leases left open (patched vLLM only).

The workload mixes arrivals with shared prefixes (local prefix hits), client
aborts, None answers, asynchronous loads finishing 0-3 steps later, chunked
prefill (or not), and a block pool small enough to force allocation failures
and preemption. The connector's answers depend only on the seed, the request
and how often it was asked, not on the order of the calls.
"""

from __future__ import annotations

import json
import os
import random
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from vllm import SamplingParams

# project/: the scheduler harness shared with the benchmarks.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from testing import scheduler_harness  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 40
EOS_TOKEN_ID = 50256
MODULE = "external_match_driver"


class _Metadata(KVConnectorMetadata):
    pass


class RecordingLegacyConnector(KVConnectorBase_V1):
    """Scheduler-side legacy connector that records every call made on it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seed: int = self._kv_transfer_config.kv_connector_extra_config["seed"]
        self.asked: Counter[str] = Counter()
        self.trace: list[list[Any]] = []

    def answer(self, request: Request, num_computed_tokens: int) -> tuple[Any, bool]:
        """A deterministic answer: the n-th question about a request gets the
        same answer whatever else was asked before."""
        req_id = request.request_id
        self.asked[req_id] += 1
        rng = random.Random(f"{self.seed}:{req_id}:{self.asked[req_id]}")
        if rng.random() < 0.15:
            return None, False
        offer = rng.choice([0, 0, 5, BLOCK_SIZE, 2 * BLOCK_SIZE, 4 * BLOCK_SIZE, 300])
        offer = max(min(offer, request.num_tokens - 1 - num_computed_tokens), 0)
        return offer, offer > 0 and rng.random() < 0.3

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        num_tokens, load_kv_async = self.answer(request, num_computed_tokens)
        self.trace.append(
            [
                "match",
                request.request_id,
                num_computed_tokens,
                num_tokens,
                load_kv_async,
            ]
        )
        return num_tokens, load_kv_async

    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        block_ids = [list(ids) for ids in blocks.get_block_ids()]
        self.trace.append(["alloc", request.request_id, block_ids, num_external_tokens])

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.trace.append(["finished", request.request_id, list(block_ids)])
        return False, None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self.trace.append(
            ["step", sorted(scheduler_output.num_scheduled_tokens.items())]
        )
        return _Metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass


class Lease:
    def __init__(self, req_id: str, num_tokens: int) -> None:
        self.req_id = req_id
        self.num_tokens = num_tokens


class LeasingConnector(RecordingLegacyConnector):
    """Leases what it offers in prepare_external_match(); fails on a double
    commit or abort, an unknown lease, a prepare over an open lease, more
    tokens committed than leased, an admission without commit, or a request
    freed with an open lease."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.open: dict[str, Lease] = {}
        self.violations: list[str] = []
        self.counts: Counter[str] = Counter()
        self.committed_this_step: set[str] = set()

    def prepare_external_match(self, request: Request, num_computed_tokens: int) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.external_match import (
            ExternalKVMatch,
        )

        req_id = request.request_id
        if req_id in self.open:
            self.violations.append(f"{req_id}: prepare while a lease is open")
        if request.skip_reading_prefix_cache:
            self.violations.append(f"{req_id}: prepare of a request that skips the cache")
        num_tokens, load_kv_async = self.answer(request, num_computed_tokens)
        if num_tokens is None:
            self.counts["prepare_none"] += 1
            return None
        self.counts["prepare"] += 1
        lease = Lease(req_id, num_tokens)
        self.open[req_id] = lease
        return ExternalKVMatch(num_tokens, load_kv_async, lease)

    def commit_external_match(self, request: Request, blocks: Any, match: Any) -> None:
        req_id = request.request_id
        self.committed_this_step.add(req_id)
        lease = self.open.pop(req_id, None)
        if match.query_result is None:
            self.counts["commit_unprepared"] += 1
            if request.skip_reading_prefix_cache:
                self.counts["commit_skipping_cache"] += 1
            if lease is not None or match.num_tokens != 0:
                self.violations.append(f"{req_id}: commit bypassed an open lease")
            return
        self.counts["commit" if match.num_tokens else "commit_zero"] += 1
        if lease is None or match.query_result is not lease:
            self.violations.append(f"{req_id}: commit of an unknown lease")
            return
        if not 0 <= match.num_tokens <= lease.num_tokens:
            self.violations.append(f"{req_id}: commit of more than leased")
        if lease is not None and match.num_tokens < lease.num_tokens:
            self.counts["commit_trimmed"] += 1
        if match.load_kv_async:
            self.counts["commit_async"] += 1

    def abort_external_match(self, request: Request, match: Any) -> None:
        req_id = request.request_id
        self.counts["abort"] += 1
        lease = self.open.pop(req_id, None)
        if lease is None or match.query_result is not lease:
            self.violations.append(f"{req_id}: abort of an unknown lease")

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if request.request_id in self.open:
            self.violations.append(f"{request.request_id}: freed with an open lease")
        return False, None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        admitted = {r.req_id for r in scheduler_output.scheduled_new_reqs}
        admitted |= scheduler_output.scheduled_cached_reqs.resumed_req_ids
        if missing := admitted - self.committed_this_step:
            self.violations.append(f"{sorted(missing)}: admitted without commit")
        self.committed_this_step = set()
        self.counts["preempted"] += len(scheduler_output.preempted_req_ids or ())
        return _Metadata()


def make_scheduler(connector: str, run: dict[str, Any]) -> Scheduler:
    chunked = run.get("chunked", True)
    budget = 64 if chunked else 256
    cache_config = CacheConfig(
        block_size=BLOCK_SIZE,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=True,
    )
    cache_config.kv_cache_layout = "LBNHC"
    extra: dict[str, Any] = {"seed": run["seed"]}
    # The checker is switched on (or off) when the scheduler is built.
    os.environ["VLLM_CHECK_EXTERNAL_MATCH_LIFECYCLE"] = "1" if run.get("check") else "0"
    return scheduler_harness.make_scheduler(
        model_config=ModelConfig(
            model="facebook/opt-125m", trust_remote_code=True, dtype="float16", seed=42
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=budget,
            max_model_len=10000 if chunked else budget,
            enable_chunked_prefill=chunked,
            is_encoder_decoder=False,
        ),
        cache_config=cache_config,
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector,
            kv_connector_module_path=MODULE,
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
        num_blocks=NUM_BLOCKS,
        device_config=DeviceConfig("cpu"),
    )


def make_request(rng: random.Random, req_id: str) -> Request:
    prefix_len = rng.choice([0, BLOCK_SIZE, 3 * BLOCK_SIZE + 3, 6 * BLOCK_SIZE])
    family = rng.randint(1, 3)
    prompt = [family] * prefix_len + [
        rng.randint(3, 30000) for _ in range(rng.randint(2, 140))
    ]
    # Prompt logprobs skip the prefix caches: the scheduler accepts none of a
    # connector's offer.
    prompt_logprobs = 1 if rng.random() < 0.05 else None
    params = SamplingParams(
        max_tokens=rng.randint(1, 24), prompt_logprobs=prompt_logprobs
    )
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    return Request(
        request_id=req_id,
        prompt_token_ids=prompt,
        sampling_params=params,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def step(
    scheduler: Scheduler, rng: random.Random, loading: dict[str, int]
) -> dict[str, int]:
    """One scheduler step with a fake model run; asynchronous loads finish
    0-3 steps after they start."""
    so = scheduler.schedule()
    connector = scheduler.connector
    if isinstance(connector, LeasingConnector) and connector.open:
        connector.violations.append(f"{sorted(connector.open)}: open after the step")
    for req_id, request in scheduler.requests.items():
        if (
            request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            and req_id not in scheduler.finished_recving_kv_req_ids
        ):
            loading.setdefault(req_id, rng.randint(0, 3))
    done = {req_id for req_id, left in loading.items() if left == 0}
    req_ids = list(so.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        if request.num_computed_tokens < request.num_tokens:
            sampled.append([])  # a prefill chunk samples nothing
        else:
            sampled.append([EOS_TOKEN_ID if rng.random() < 0.03 else 11])
    output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[None] * len(req_ids),
        kv_connector_output=KVConnectorOutput(finished_recving=done) if done else None,
    )
    scheduler.update_from_output(so, output)
    return {req_id: left - 1 for req_id, left in loading.items() if left}


def run_workload(scheduler: Scheduler, seed: int, num_steps: int) -> int:
    rng = random.Random(seed)
    loading: dict[str, int] = {}
    num_client_aborts = 0
    for i in range(num_steps):
        if rng.random() < 0.5:
            scheduler.add_request(make_request(rng, f"s{seed}-r{i}"))
        if scheduler.requests and rng.random() < 0.08:
            victim = rng.choice(sorted(scheduler.requests))
            scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            num_client_aborts += 1
        loading = step(scheduler, rng, loading)
    scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    for _ in range(5):  # aborted loads are freed once their transfer ends
        loading = step(scheduler, rng, dict.fromkeys(loading, 0))
    assert not scheduler.requests, sorted(scheduler.requests)
    return num_client_aborts


def main() -> None:
    config = json.loads(sys.argv[1])
    init_none_hash(sha256)
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1 import external_match

        patched = external_match is not None
    except ImportError:
        patched = False
    results = []
    for run in config["runs"]:
        if config["mode"] == "trace":
            scheduler = make_scheduler("RecordingLegacyConnector", run)
            run_workload(scheduler, run["seed"], run["steps"])
            connector = scheduler.connector
            assert isinstance(connector, RecordingLegacyConnector)
            path = Path(config["trace_dir"]) / f"{run['seed']}.json"
            path.write_text(json.dumps(connector.trace))
            kinds = Counter(entry[0] for entry in connector.trace)
            results.append({"seed": run["seed"], "trace": str(path), "calls": kinds})
        else:
            scheduler = make_scheduler("LeasingConnector", run)
            aborts = run_workload(scheduler, run["seed"], run["steps"])
            connector = scheduler.connector
            assert isinstance(connector, LeasingConnector)
            results.append(
                {
                    **run,
                    "client_aborts": aborts,
                    "counts": connector.counts,
                    "violations": connector.violations[:20],
                    "open_leases": len(connector.open),
                }
            )
    print("RESULT " + json.dumps({"patched": patched, "runs": results}))


if __name__ == "__main__":
    # The factory imports the connectors by module name: let it find this one.
    sys.modules[MODULE] = sys.modules["__main__"]
    main()

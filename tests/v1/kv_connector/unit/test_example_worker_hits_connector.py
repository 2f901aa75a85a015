# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Runs ExampleWorkerHitsConnector, the before_update_states() example of
docs/features/disagg_prefill.md: a real Scheduler drives its scheduler side,
its worker side runs through the runners' WorkerExternalHits on CPU KV
caches, and its keys keep requests with equal tokens but another cache_salt
or LoRA adapter apart."""

from typing import TYPE_CHECKING, Any, cast

import pytest
import torch

from tests.v1.kv_connector.unit.test_before_update_states import (
    _scheduler_output,
    _single_rank,
)
from tests.v1.kv_connector.unit.utils import (
    create_model_runner_output,
    create_scheduler,
    create_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import (
    KVConnectorRole,
    example_worker_hits_connector,
    external_hits,
)
from vllm.distributed.kv_transfer.kv_connector.v1.example_worker_hits_connector import (  # noqa: E501
    ExampleWorkerHitsConnector,
    ExampleWorkerHitsMetadata,
)
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

BLOCK_SIZE = 16
NUM_BLOCKS = 64
PROMPT = list(range(1000, 1100))


@pytest.fixture
def vllm_config(monkeypatch: pytest.MonkeyPatch) -> Any:
    _single_rank(monkeypatch)
    monkeypatch.setattr(
        example_worker_hits_connector, "get_tensor_model_parallel_rank", lambda: 0
    )
    init_none_hash(sha256)
    config = create_vllm_config(
        kv_connector="ExampleWorkerHitsConnector",
        kv_connector_module_path=example_worker_hits_connector.__name__,
        kv_role="kv_both",
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=256,
    )
    # Every hit must come from the connector, not from vLLM's prefix cache.
    config.cache_config.enable_prefix_caching = False
    return config


def _request(
    req_id: str,
    cache_salt: str | None = None,
    lora_request: LoRARequest | None = None,
) -> Request:
    return Request(
        request_id=req_id,
        prompt_token_ids=PROMPT,
        sampling_params=SamplingParams(max_tokens=4),
        pooling_params=None,
        cache_salt=cache_salt,
        lora_request=lora_request,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def _worker_connector(vllm_config: Any) -> ExampleWorkerHitsConnector:
    connector = KVConnectorFactory.create_connector(
        vllm_config,
        KVConnectorRole.WORKER,
        KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[]),
    )
    assert isinstance(connector, ExampleWorkerHitsConnector)
    connector.register_kv_caches(
        {f"layer.{i}": torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 2, 8) for i in (0, 1)}
    )
    return connector


def _kv(token_id: int, position: int, layer: int) -> float:
    """What the forward writes for a token (stands in for its real KV)."""
    return float(token_id * 1000 + position * 10 + layer)


def _run_step(
    scheduler: Any, worker: ExampleWorkerHitsConnector, runner: Any
) -> SchedulerOutput:
    """One step: the scheduler schedules, the worker applies its hits,
    loads, "computes" the scheduled tokens and saves, as a model runner
    drives a connector."""
    so = scheduler.schedule()
    applied_so = runner.apply(so)
    worker.bind_connector_metadata(so.kv_connector_metadata)
    worker.start_load_kv(cast("ForwardContext", None))
    for new_req in applied_so.scheduled_new_reqs:
        start = new_req.num_computed_tokens
        end = start + applied_so.num_scheduled_tokens[new_req.req_id]
        block_ids = new_req.block_ids[0]
        for pos in range(start, end):
            for i, kv_cache in enumerate(worker.kv_caches.values()):
                block_id, offset = block_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE
                kv_cache[:, block_id, offset] = _kv(PROMPT[pos], pos, i)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    output = create_model_runner_output(reqs=list(scheduler.running))
    output.kv_connector_output = KVConnectorOutput(applied_external_hits=runner.applied)
    engine_outputs = scheduler.update_from_output(so, output)
    runner.external_cached_tokens = {
        o.request_id: o.prefill_stats.num_external_cached_tokens
        for eo in engine_outputs.values()
        for o in eo.outputs
        if o.prefill_stats is not None
    }
    return applied_so


def test_example_connector_hits_repeated_prompt(vllm_config: Any):
    """A repeated prompt is loaded from the worker's store: the hit is
    applied (all full blocks, the last prompt token computed), the loaded
    KV is what the first request computed, and the scheduler counts it.
    The same tokens under another cache_salt get nothing."""
    scheduler = create_scheduler(vllm_config)
    assert isinstance(scheduler.connector, ExampleWorkerHitsConnector)
    worker = _worker_connector(vllm_config)
    runner = external_hits.WorkerExternalHits(worker)

    scheduler.add_request(_request("first"))
    so = _run_step(scheduler, worker, runner)
    assert runner.applied is None
    assert so.num_scheduled_tokens == {"first": 100}
    assert len(worker.store) == 100 // BLOCK_SIZE

    repeat = _request("repeat")
    scheduler.add_request(repeat)
    so = _run_step(scheduler, worker, runner)
    assert runner.applied == {"repeat": 96}
    assert so.num_scheduled_tokens["repeat"] == 4
    (block_ids,) = scheduler.kv_cache_manager.get_block_ids("repeat")
    for i, kv_cache in enumerate(worker.kv_caches.values()):
        for pos in range(100):
            block_id, offset = block_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            expected = _kv(PROMPT[pos], pos, i)
            assert torch.all(kv_cache[:, block_id, offset] == expected), pos
    # What the scheduler reports as cached (prompt_tokens_details).
    assert runner.external_cached_tokens == {"repeat": 96}

    scheduler.add_request(_request("salted", cache_salt="tenant-b"))
    so = _run_step(scheduler, worker, runner)
    assert runner.applied is None
    assert so.num_scheduled_tokens["salted"] == 100


def test_example_connector_stores_at_most_max_stored_blocks(vllm_config: Any):
    vllm_config.kv_transfer_config.kv_connector_extra_config["max_stored_blocks"] = 2
    scheduler = create_scheduler(vllm_config)
    worker = _worker_connector(vllm_config)
    runner = external_hits.WorkerExternalHits(worker)
    scheduler.add_request(_request("first"))
    _run_step(scheduler, worker, runner)
    assert len(worker.store) == 2

    scheduler.add_request(_request("repeat"))
    _run_step(scheduler, worker, runner)
    assert runner.applied == {"repeat": 2 * BLOCK_SIZE}
    assert len(worker.store) == 2


def test_example_connector_loads_only_the_applied_hits(vllm_config: Any):
    """Where the ranks agreed on less than this worker reported, it loads
    only the agreed blocks (on_external_hits_applied)."""
    worker = _worker_connector(vllm_config)
    hashes = _request("a").block_hashes
    for block_hash in hashes[:4]:
        worker.store[worker.key(block_hash)] = {
            name: torch.ones(2, BLOCK_SIZE, 2, 8) for name in worker.kv_caches
        }
    meta = ExampleWorkerHitsMetadata()
    meta.requests["a"] = example_worker_hits_connector.ExampleWorkerHitsRequest(
        block_hashes=list(hashes), block_ids=list(range(7)), num_full_blocks=6
    )
    so = _scheduler_output(new=[("a", 100, 0, 100)])
    so.kv_connector_metadata = meta
    assert worker.before_update_states(so) == {"a": 64}
    # Another rank held two blocks: the runner applied 32 tokens.
    worker.on_external_hits_applied({"a": 32})
    worker.start_load_kv(cast("ForwardContext", None))
    for kv_cache in worker.kv_caches.values():
        assert torch.all(kv_cache[:, :2] == 1)
        assert torch.all(kv_cache[:, 2:] == 0)


def _worker_keys(
    vllm_config: Any, worker: ExampleWorkerHitsConnector, requests: list[Request]
) -> dict[str, list[Any]]:
    """The store keys the worker uses for each request, from the block
    hashes the example's scheduler side sends in its metadata."""
    scheduler_side = ExampleWorkerHitsConnector(
        vllm_config, KVConnectorRole.SCHEDULER, worker._kv_cache_config
    )
    for request in requests:
        scheduler_side.update_state_after_alloc(request, cast("KVCacheBlocks", None), 0)
    so = _scheduler_output()
    so.scheduled_new_reqs = [
        NewRequestData.from_request(request, (list(range(7)),), None)
        for request in requests
    ]
    so.num_scheduled_tokens = {request.request_id: 100 for request in requests}
    meta = scheduler_side.build_connector_meta(so)
    assert isinstance(meta, ExampleWorkerHitsMetadata)
    return {
        req_id: [worker.key(h) for h in req.block_hashes]
        for req_id, req in meta.requests.items()
    }


def test_equal_tokens_under_another_salt_or_lora_get_other_keys(vllm_config: Any):
    worker = _worker_connector(vllm_config)
    keys = _worker_keys(
        vllm_config,
        worker,
        [
            _request("plain"),
            _request("same"),
            _request("salted", cache_salt="tenant-b"),
            _request("lora", lora_request=LoRARequest("adapter", 1, "adapter")),
        ],
    )
    assert len(keys["plain"]) == 100 // BLOCK_SIZE
    assert keys["same"] == keys["plain"]
    for other in ("salted", "lora"):
        assert not set(keys[other]) & set(keys["plain"]), other


def test_keys_are_namespaced_by_model_layout_and_dtype(vllm_config: Any):
    """Block hashes do not cover the model, the TP layout or the KV dtype;
    the example's namespace does."""
    worker = _worker_connector(vllm_config)
    namespace = worker.namespace
    vllm_config.cache_config.cache_dtype = "fp8"
    assert example_worker_hits_connector.store_namespace(vllm_config, 0) != namespace
    vllm_config.cache_config.cache_dtype = "auto"
    assert example_worker_hits_connector.store_namespace(vllm_config, 0) == namespace
    assert example_worker_hits_connector.store_namespace(vllm_config, 1) != namespace
    vllm_config.parallel_config.tensor_parallel_size = 2
    assert example_worker_hits_connector.store_namespace(vllm_config, 0) != namespace

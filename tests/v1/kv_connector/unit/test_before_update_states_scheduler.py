# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for the scheduler's side of KVConnectorBase_V1.before_update_states():
the applied hits reported back (KVOutputAggregator, request and connector
stats, with and without async scheduling) and the failed-load path."""

from typing import Any

import pytest

from tests.v1.kv_connector.unit.test_before_update_states import (
    _attention_groups,
    _extra_config,
    _make_connector,
    _single_rank,
)
from tests.v1.kv_connector.unit.utils import (
    create_model_runner_output,
    create_request,
    create_scheduler,
    create_vllm_config,
)
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.external_hits import (
    WorkerExternalHits,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus


def _mock_connector_config(**kwargs: Any) -> VllmConfig:
    """A scheduler config with MockKVConnector, which reports no hit of its
    own: the hits come from KVConnectorOutput.applied_external_hits."""
    return create_vllm_config(
        kv_connector="MockKVConnector",
        kv_connector_module_path="tests.v1.kv_connector.unit.utils",
        kv_role="kv_both",
        kv_connector_extra_config=_extra_config(),
        **kwargs,
    )


def test_failed_load_on_two_group_model_cannot_be_recomputed():
    """Why the exclusion above is needed: on a model with two KV cache groups
    the scheduler stops on any reported block-level load failure."""
    vllm_config = _mock_connector_config(kv_load_failure_policy="recompute")
    scheduler = create_scheduler(vllm_config)
    scheduler.kv_cache_config = _attention_groups(sliding_window=True)
    with pytest.raises(RuntimeError, match="multiple KV cache groups"):
        scheduler._handle_invalid_blocks({1}, {})


def test_aggregator_carries_applied_hits():
    outputs = [create_model_runner_output(reqs=[]) for _ in range(2)]
    for output in outputs:
        output.kv_connector_output = KVConnectorOutput(applied_external_hits={"a": 5})
    aggregated = KVOutputAggregator(expected_finished_count=2).aggregate(outputs)
    assert aggregated is not None
    assert aggregated.kv_connector_output is not None
    assert aggregated.kv_connector_output.applied_external_hits == {"a": 5}
    assert not aggregated.kv_connector_output.is_empty()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_applied_hits_reach_request_stats(async_scheduling: bool):
    vllm_config = _mock_connector_config(max_num_batched_tokens=64)
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    scheduler = create_scheduler(vllm_config)
    request = create_request(num_tokens=100)
    scheduler.add_request(request)
    req_id = request.request_id

    # Chunked prefill: 64 + 36 tokens; the worker loads 40, then 20 of them.
    outputs = []
    for num_hit_tokens in (40, 20):
        output = create_model_runner_output(reqs=[request])
        output.kv_connector_output = KVConnectorOutput(
            applied_external_hits={req_id: num_hit_tokens}
        )
        outputs.append(output)
    # Partial prefill: nothing sampled yet.
    outputs[0].sampled_token_ids = [[]]
    engine_outputs = []
    first = scheduler.schedule()
    if async_scheduling:
        # As the engine core does with async scheduling: the second chunk
        # is scheduled while the first step runs, before its output.
        second = scheduler.schedule()
        assert second.num_scheduled_tokens == {req_id: 36}
        engine_outputs.append(scheduler.update_from_output(first, outputs[0]))
    else:
        engine_outputs.append(scheduler.update_from_output(first, outputs[0]))
        second = scheduler.schedule()
    engine_outputs.append(scheduler.update_from_output(second, outputs[1]))

    core_outputs = [
        o for eo in engine_outputs for co in eo.values() for o in co.outputs
    ]
    prefill_stats = [o.prefill_stats for o in core_outputs if o.prefill_stats]
    assert len(prefill_stats) == 1
    assert prefill_stats[0].num_cached_tokens == 60
    assert prefill_stats[0].num_external_cached_tokens == 60
    assert prefill_stats[0].num_computed_tokens == 40
    # Each update_from_output() takes the stats recorded since the last one.
    connector_stats = [
        eo.scheduler_stats.connector_prefix_cache_stats
        for eos in engine_outputs
        for eo in eos.values()
        if eo.scheduler_stats and eo.scheduler_stats.connector_prefix_cache_stats
    ]
    assert sum(stats.hits for stats in connector_stats) == 60


def test_failed_load_of_applied_hit_is_recomputed():
    """A block skipped by a worker-side hit that then fails to load is reported
    through invalid_block_ids, like a scheduler-side hit: the scheduler
    recomputes the request from that block and samples nothing this step."""
    vllm_config = _mock_connector_config(
        max_num_batched_tokens=128, kv_load_failure_policy="recompute"
    )
    scheduler = create_scheduler(vllm_config)
    request = create_request(num_tokens=100)
    scheduler.add_request(request)
    req_id = request.request_id
    so = scheduler.schedule()
    assert so.num_scheduled_tokens[req_id] == 100
    (block_ids,) = scheduler.kv_cache_manager.get_block_ids(req_id)

    # The worker skipped 64 tokens (blocks 0-3); block 2 failed to load.
    output = create_model_runner_output(reqs=[request])
    output.kv_connector_output = KVConnectorOutput(
        applied_external_hits={req_id: 64}, invalid_block_ids={block_ids[2]}
    )
    engine_outputs = [scheduler.update_from_output(so, output)]

    assert request.num_computed_tokens == 2 * 16
    assert request.num_output_tokens == 0
    so = scheduler.schedule()
    assert so.num_scheduled_tokens[req_id] == 100 - 2 * 16

    # The recomputing step samples; the failed hit was never counted.
    engine_outputs.append(
        scheduler.update_from_output(so, create_model_runner_output(reqs=[request]))
    )
    core_outputs = [
        o for eo in engine_outputs for co in eo.values() for o in co.outputs
    ]
    prefill_stats = [o.prefill_stats for o in core_outputs if o.prefill_stats]
    assert len(prefill_stats) == 1
    assert prefill_stats[0].num_external_cached_tokens == 0
    connector_hits = sum(
        eo.scheduler_stats.connector_prefix_cache_stats.hits
        for eos in engine_outputs
        for eo in eos.values()
        if eo.scheduler_stats and eo.scheduler_stats.connector_prefix_cache_stats
    )
    assert connector_hits == 0


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_hits_whose_on_external_hits_applied_raised_fail_by_policy(
    monkeypatch: pytest.MonkeyPatch, policy: str
):
    """A worker whose connector raised in on_external_hits_applied() reports
    the hit's first block as a load error: the scheduler recomputes the
    request from that block, or fails it, by kv_load_failure_policy."""
    _single_rank(monkeypatch)
    vllm_config = _mock_connector_config(
        max_num_batched_tokens=40, kv_load_failure_policy=policy
    )
    scheduler = create_scheduler(vllm_config)
    request = create_request(num_tokens=100)
    scheduler.add_request(request)
    connector = _make_connector("FailingApplyConnector", hits={})
    hits = connector._kv_transfer_config.kv_connector_extra_config["hits"]
    connector._kv_cache_config = _attention_groups(sliding_window=False)
    worker = WorkerExternalHits(connector)

    # Chunks of 40 tokens; the hit skips tokens 40-59 of the second, from
    # inside block 2, which came with the first chunk.
    for step in range(2):
        so = scheduler.schedule()
        if step == 0:
            (block_ids,) = scheduler.kv_cache_manager.get_block_ids(request.request_id)
        else:
            hits[request.request_id] = 20
        output = KVConnectorOutput()
        worker.apply(so)
        worker.report(output)
        model_output = create_model_runner_output(reqs=[request])
        model_output.sampled_token_ids = [[]]
        model_output.kv_connector_output = output
        scheduler.update_from_output(so, model_output)
    assert output.invalid_block_ids == {block_ids[2]}

    if policy == "recompute":
        assert request.num_computed_tokens == 2 * 16
        assert not request.is_finished()
    else:
        assert request.status == RequestStatus.FINISHED_ERROR

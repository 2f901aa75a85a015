# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for KVConnectorBase_V1.before_update_states() and the external hits
it reports, on one worker: WorkerExternalHits (eligibility, clamping, copy,
invalid values, the applied hits given back to the connector), hook
detection, the MultiConnector forwarding and the pipeline-parallel guard.
The rank agreement, the scheduler side and the model runners have their own
test_before_update_states_*.py files."""

import copy
from collections.abc import Sequence
from dataclasses import replace
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock

import pytest
import torch

from tests.v1.kv_connector.unit.utils import (
    MockKVConnector,
    create_request,
    create_scheduler,
    create_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole, external_hits
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
)
from vllm.pooling_params import PoolingParams
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.worker.kv_connector_model_runner_mixin import (
    KVConnectorModelRunnerMixin,
)

MODULE = "tests.v1.kv_connector.unit.test_before_update_states"


class HitsConnector(MockKVConnector):
    """Reports the hits given in its kv_connector_extra_config["hits"] and
    records what on_external_hits_applied() gives it."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.applied_calls: list[dict[str, int]] = []

    def before_update_states(self, scheduler_output: SchedulerOutput) -> Any:
        return self._kv_transfer_config.kv_connector_extra_config["hits"]

    def on_external_hits_applied(self, applied: dict[str, int]) -> None:
        self.applied_calls.append(applied)


KVConnectorFactory.register_connector("HitsConnector", MODULE, "HitsConnector")


def _extra_config(hits: Any = None) -> dict[str, Any]:
    extra_config: dict[str, Any] = {"matched_tokens": 0, "is_async": False}
    if hits is not None:
        extra_config["hits"] = hits
    return extra_config


def _make_connector(name: str, hits: Any = None) -> Any:
    vllm_config = create_vllm_config(
        kv_connector=name,
        kv_connector_module_path=MODULE,
        kv_role="kv_both",
        kv_connector_extra_config=_extra_config(hits),
    )
    return KVConnectorFactory.create_connector(
        vllm_config, KVConnectorRole.WORKER, _empty_kv_cache_config()
    )


def _empty_kv_cache_config() -> KVCacheConfig:
    return KVCacheConfig(num_blocks=0, kv_cache_tensors=[], kv_cache_groups=[])


def _new_req(req_id: str, prompt_len: int, num_computed: int) -> NewRequestData:
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=list(range(prompt_len)),
        mm_features=[],
        sampling_params=None,
        pooling_params=None,
        block_ids=([0],),
        num_computed_tokens=num_computed,
        lora_request=None,
    )


def _scheduler_output(
    new: Sequence[tuple[str, int, int, int]] = (),
    cached: Sequence[tuple[str, int, int, int]] = (),
    spec: dict[str, list[int]] | None = None,
) -> SchedulerOutput:
    """new: (req_id, prompt_len, num_computed, num_scheduled);
    cached: (req_id, num_computed, num_output_tokens, num_scheduled)."""
    num_scheduled = {r[0]: r[3] for r in [*new, *cached]}
    return SchedulerOutput(
        scheduled_new_reqs=[_new_req(r, p, c) for r, p, c, _ in new],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=[r[0] for r in cached],
            resumed_req_ids=set(),
            new_token_ids=[[] for _ in cached],
            all_token_ids={},
            new_block_ids=[None for _ in cached],
            num_computed_tokens=[r[1] for r in cached],
            num_output_tokens=[r[2] for r in cached],
        ),
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        scheduled_spec_decode_tokens=spec or {},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


def _single_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    one_rank = SimpleNamespace(world_size=1, cpu_group=None)
    monkeypatch.setattr(external_hits, "get_tp_group", lambda: one_rank)
    monkeypatch.setattr(external_hits, "get_pcp_group", lambda: one_rank)


def _worker(hits: Any = None, kv_cache_config: KVCacheConfig | None = None):
    connector = _make_connector("HitsConnector", hits=hits if hits is not None else {})
    if kv_cache_config is not None:
        connector._kv_cache_config = kv_cache_config
    return external_hits.WorkerExternalHits(connector)


class _Apply:
    """Applies hits to a scheduler output on one rank, through the worker
    path; ``applied`` holds the hits the last call applied."""

    applied: dict[str, int] | None = None

    def __call__(self, so: SchedulerOutput, hits: dict[str, int]) -> SchedulerOutput:
        worker = _worker(hits)
        new_so = worker.apply(so)
        self.applied = worker.applied
        return new_so


@pytest.fixture
def apply(monkeypatch: pytest.MonkeyPatch) -> _Apply:
    _single_rank(monkeypatch)
    return _Apply()


def test_default_hook_reports_nothing_and_is_not_called():
    connector = _make_connector("MockKVConnector")
    assert connector.before_update_states(_scheduler_output()) == {}
    assert not connector.uses_before_update_states


def test_overriding_hook_is_detected():
    connector = _make_connector("HitsConnector", hits={})
    assert connector.uses_before_update_states
    assert external_hits.uses_worker_external_hits(connector)


def test_mock_connector_is_not_a_hook_user(monkeypatch: pytest.MonkeyPatch):
    """A Mock standing in for a connector (as tests of the model runners use)
    has a truthy uses_before_update_states; it must get no hook call."""
    _single_rank(monkeypatch)
    connector = MagicMock()
    connector._kv_cache_config = _attention_groups(sliding_window=False)
    monkeypatch.setattr(
        "vllm.v1.worker.kv_connector_model_runner_mixin.get_kv_transfer_group",
        lambda: connector,
    )
    runner = KVConnectorModelRunnerMixin()
    so = _scheduler_output(new=[("a", 100, 0, 100)])
    assert runner.apply_kv_connector_external_hits(so) is so
    assert runner._worker_external_hits is None
    connector.before_update_states.assert_not_called()
    connector.on_external_hits_applied.assert_not_called()
    assert not external_hits.uses_worker_external_hits(connector)


def test_v1_runner_decides_once_per_connector(monkeypatch: pytest.MonkeyPatch):
    """A connector without the hook costs V1's step one identity check: the
    runner decides when it first sees the connector, not at every step."""
    _single_rank(monkeypatch)
    connector = _make_connector("MockKVConnector")
    mixin = "vllm.v1.worker.kv_connector_model_runner_mixin"
    monkeypatch.setattr(f"{mixin}.get_kv_transfer_group", lambda: connector)
    decided: list[Any] = []

    def uses_worker_external_hits(c: Any) -> bool:
        decided.append(c)
        return external_hits.uses_worker_external_hits(c)

    monkeypatch.setattr(f"{mixin}.uses_worker_external_hits", uses_worker_external_hits)
    runner = KVConnectorModelRunnerMixin()
    so = _scheduler_output(new=[("a", 100, 0, 100)])
    for _ in range(3):
        assert runner.apply_kv_connector_external_hits(so) is so
    assert decided == [connector]


def test_connector_learns_the_applied_hits(monkeypatch: pytest.MonkeyPatch):
    """on_external_hits_applied() gets what was applied, after clamping: not
    what the hook reported."""
    _single_rank(monkeypatch)
    worker = _worker({"a": 99, "b": 30, "gone": 5})
    so = _scheduler_output(new=[("a", 50, 0, 50), ("b", 100, 0, 64)])
    worker.apply(so)
    assert worker.applied == {"a": 49, "b": 30}
    assert worker.connector.applied_calls == [{"a": 49, "b": 30}]
    # A step where the hook ran but nothing was applied says so.
    worker = _worker({"a": 0})
    worker.apply(so)
    assert worker.applied is None
    assert worker.connector.applied_calls == [{}]
    # No call in a step where the hook is not called.
    worker.apply(_scheduler_output(cached=[("a", 50, 1, 1)]))
    assert worker.connector.applied_calls == [{}]


def test_apply_advances_computed_and_keeps_last_prompt_token(apply):
    so = _scheduler_output(
        new=[("a", 100, 0, 100), ("b", 100, 16, 84)],
        cached=[("c", 64, 0, 36)],
    )
    new_so = apply(so, {"a": 40, "b": 1000, "c": 35})
    assert apply.applied == {"a": 40, "b": 83, "c": 35}
    assert [r.num_computed_tokens for r in new_so.scheduled_new_reqs] == [40, 99]
    assert new_so.scheduled_cached_reqs.num_computed_tokens == [99]
    assert new_so.num_scheduled_tokens == {"a": 60, "b": 1, "c": 1}
    assert new_so.total_num_scheduled_tokens == 220 - 40 - 83 - 35
    assert new_so.has_sync_kv_loads


def test_apply_clamps_to_prompt_of_new_request_with_replayed_outputs(apply):
    # 10 prompt tokens, but 14 tokens (prompt and replayed outputs) scheduled.
    so = _scheduler_output(new=[("a", 10, 0, 14)])
    assert _worker().limits(so) == {"a": 9}
    assert apply(so, {"a": 13}).num_scheduled_tokens == {"a": 5}


@pytest.mark.parametrize(
    "so",
    [
        # Decode step of a request that produced output.
        _scheduler_output(cached=[("a", 50, 1, 1)]),
        # Speculative tokens scheduled.
        _scheduler_output(cached=[("a", 50, 0, 3)], spec={"a": [1, 2]}),
        # New request whose prompt is already computed.
        _scheduler_output(new=[("a", 10, 10, 1)]),
        # A single scheduled token: nothing left to skip.
        _scheduler_output(new=[("a", 10, 9, 1)]),
        # Request not scheduled in this step.
        _scheduler_output(new=[("b", 10, 0, 10)]),
    ],
)
def test_ineligible_requests_get_nothing(so: SchedulerOutput, apply):
    assert apply(so, {"a": 5}) is so
    assert "a" not in _worker().limits(so)


def test_apply_leaves_scheduler_output_untouched(apply):
    so = _scheduler_output(new=[("a", 100, 0, 100)], cached=[("c", 64, 0, 36)])
    before = copy.deepcopy(so)
    new_req = so.scheduled_new_reqs[0]
    num_scheduled_tokens = so.num_scheduled_tokens
    cached_num_computed = so.scheduled_cached_reqs.num_computed_tokens

    new_so = apply(so, {"a": 10, "c": 5})

    assert new_so is not so
    assert new_so.num_scheduled_tokens is not num_scheduled_tokens
    assert new_so.scheduled_new_reqs[0] is not new_req
    assert new_so.scheduled_cached_reqs is not so.scheduled_cached_reqs
    assert so.num_scheduled_tokens is num_scheduled_tokens
    assert so.scheduled_new_reqs[0] is new_req
    assert so.scheduled_cached_reqs.num_computed_tokens is cached_num_computed
    assert repr(so) == repr(before)
    assert so.num_scheduled_tokens == before.num_scheduled_tokens
    assert so.total_num_scheduled_tokens == before.total_num_scheduled_tokens
    assert apply.applied == {"a": 10, "c": 5}
    assert not so.has_sync_kv_loads


def test_apply_leaves_scheduler_requests_untouched(apply):
    vllm_config = create_vllm_config(
        kv_connector="MockKVConnector",
        kv_connector_module_path="tests.v1.kv_connector.unit.utils",
        kv_role="kv_both",
        kv_connector_extra_config=_extra_config(),
    )
    scheduler = create_scheduler(vllm_config)
    request = create_request(num_tokens=40)
    scheduler.add_request(request)
    so = scheduler.schedule()
    assert request.num_computed_tokens == 40

    new_so = apply(so, {request.request_id: 32})

    assert new_so.num_scheduled_tokens[request.request_id] == 8
    assert so.num_scheduled_tokens[request.request_id] == 40
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    assert request.num_computed_tokens == 40


@pytest.mark.parametrize(
    "hits",
    [{"a": -1}, {"a": 1.5}, {"a": True}, {"a": "3"}, {"a": None}, {7: 3}, [("a", 3)]],
)
def test_invalid_hits_raise_naming_connector_and_request(
    hits: Any, monkeypatch: pytest.MonkeyPatch
):
    _single_rank(monkeypatch)
    worker = _worker({"b": 4, **hits} if isinstance(hits, dict) else hits)
    so = _scheduler_output(new=[("a", 10, 0, 10), ("b", 10, 0, 10)])
    before = copy.deepcopy(so)
    with pytest.raises(RuntimeError, match=r"HitsConnector\.before_update_states") as e:
        worker.apply(so)
    assert isinstance(e.value.__cause__, ValueError)
    if isinstance(hits, dict):
        assert repr(next(iter(hits))) in str(e.value.__cause__)
    assert repr(so) == repr(before)


def test_apply_single_rank_ignores_unknown_requests(monkeypatch: pytest.MonkeyPatch):
    _single_rank(monkeypatch)
    so = _scheduler_output(new=[("a", 10, 0, 10)])
    worker = _worker({"a": 5, "zzz": 3})
    worker.apply(so)
    assert worker.applied == {"a": 5}


def test_hook_and_collective_skipped_without_eligible_requests(
    monkeypatch: pytest.MonkeyPatch,
):
    calls: list[list[int]] = []

    def fake_all_reduce_min(values: list[int], groups: Any) -> list[int]:
        calls.append(values)
        return values

    two_ranks = SimpleNamespace(world_size=2, cpu_group=object())
    one_rank = SimpleNamespace(world_size=1, cpu_group=None)
    monkeypatch.setattr(external_hits, "get_tp_group", lambda: two_ranks)
    monkeypatch.setattr(external_hits, "get_pcp_group", lambda: one_rank)
    monkeypatch.setattr(external_hits, "all_reduce_min", fake_all_reduce_min)
    monkeypatch.setattr(external_hits.dist, "get_rank", lambda: 1)
    worker = _worker({})
    hook_calls: list[SchedulerOutput] = []

    def before_update_states(so: SchedulerOutput) -> dict[str, int]:
        hook_calls.append(so)
        return {}

    monkeypatch.setattr(worker.connector, "before_update_states", before_update_states)

    # A rank without hits still joins while a request is eligible; the last
    # value says that no rank failed.
    worker.apply(_scheduler_output(new=[("a", 10, 0, 10), ("b", 10, 0, 10)]))
    assert calls == [[0, 0, external_hits._NO_FAILURE]]
    assert len(hook_calls) == 1
    # Decode only: every rank skips the hook and the collective alike.
    worker.apply(_scheduler_output(cached=[("a", 10, 1, 1)]))
    assert len(calls) == 1
    assert len(hook_calls) == 1


def _new_req_with_params(
    req_id: str, sampling_params: Any = None, pooling_params: Any = None
) -> NewRequestData:
    return replace(
        _new_req(req_id, 100, 0),
        sampling_params=sampling_params,
        pooling_params=pooling_params,
    )


_PARAMS = {
    "greedy": (SamplingParams(), None),
    "prompt_logprobs": (SamplingParams(prompt_logprobs=1), None),
    # PoolingParams.verify() sets it for pooling over every token.
    "token_embed": (
        None,
        PoolingParams(task="token_embed", skip_reading_prefix_cache=True),
    ),
    "embed": (None, PoolingParams(task="embed", skip_reading_prefix_cache=False)),
}


@pytest.mark.parametrize("kind", list(_PARAMS))
def test_requests_that_skip_reading_prefix_cache_get_no_hit(
    kind: str, monkeypatch: pytest.MonkeyPatch
):
    """A request gets a hit exactly when the scheduler would allow it a
    prefix-cache hit, in its first chunk and in its continuation chunks."""
    _single_rank(monkeypatch)
    sampling_params, pooling_params = _PARAMS[kind]
    request = create_request(num_tokens=100)
    request.sampling_params = sampling_params
    request.pooling_params = pooling_params
    must_compute = request.get_skip_reading_prefix_cache()
    assert must_compute == (kind in ("prompt_logprobs", "token_embed"))

    worker = _worker({"a": 1000})
    first = _scheduler_output(new=[("a", 100, 0, 64)])
    first.scheduled_new_reqs[0] = _new_req_with_params(
        "a", sampling_params, pooling_params
    )
    continuation = _scheduler_output(cached=[("a", 64, 0, 36)])
    applied = []
    for so in (first, continuation):
        worker.apply(so)
        applied.append(worker.applied)
    assert applied == ([None, None] if must_compute else [{"a": 63}, {"a": 35}])


def test_finished_requests_are_forgotten():
    worker = _worker()
    first = _scheduler_output(new=[("a", 100, 0, 64)])
    first.scheduled_new_reqs[0] = _new_req_with_params(
        "a", SamplingParams(prompt_logprobs=1)
    )
    worker._track_requests(first)
    assert worker._skip_reading_req_ids == {"a"}
    finished = _scheduler_output()
    finished.finished_req_ids = {"a"}
    worker._track_requests(finished)
    assert worker._skip_reading_req_ids == set()


def test_hybrid_models_get_no_hit():
    mamba = MambaSpec(block_size=16, shapes=((1,),), dtypes=(torch.float32,))
    kv_cache_config = KVCacheConfig(
        num_blocks=0,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["mamba"], mamba)],
    )
    worker = _worker({"a": 5}, kv_cache_config)
    so = _scheduler_output(new=[("a", 100, 0, 100)], cached=[("c", 64, 0, 36)])
    assert worker.limits(so) == {}
    assert worker.apply(so) is so


def _attention_groups(*, sliding_window: bool) -> KVCacheConfig:
    spec = {"block_size": 16, "num_kv_heads": 1, "head_size": 64}
    groups = [
        KVCacheGroupSpec(["full"], FullAttentionSpec(**spec, dtype=torch.float16))
    ]
    if sliding_window:
        # Gemma 2/3, gpt-oss: sliding-window layers beside full attention.
        sliding = SlidingWindowSpec(**spec, dtype=torch.float16, sliding_window=128)
        groups.append(KVCacheGroupSpec(["sliding"], sliding))
    return KVCacheConfig(num_blocks=0, kv_cache_tensors=[], kv_cache_groups=groups)


def test_models_with_several_kv_cache_groups_get_no_hit(
    monkeypatch: pytest.MonkeyPatch,
):
    """With more than one KV cache group the scheduler cannot map a failed
    load back to its request (_handle_invalid_blocks raises), so no hit is
    offered there: the hook is not called and nothing is applied."""
    _single_rank(monkeypatch)
    hook_calls: list[SchedulerOutput] = []

    def before_update_states(self: Any, so: SchedulerOutput) -> dict[str, int]:
        hook_calls.append(so)
        return {"a": 5, "c": 5}

    monkeypatch.setattr(HitsConnector, "before_update_states", before_update_states)
    so = _scheduler_output(new=[("a", 100, 0, 100)], cached=[("c", 64, 0, 36)])

    one_group = _worker(kv_cache_config=_attention_groups(sliding_window=False))
    one_group.apply(so)
    assert one_group.applied == {"a": 5, "c": 5}
    assert len(hook_calls) == 1

    two_groups = _worker(kv_cache_config=_attention_groups(sliding_window=True))
    assert two_groups.limits(so) == {}
    assert two_groups.apply(so) is so
    assert two_groups.applied is None
    assert len(hook_calls) == 1


class FailingApplyConnector(HitsConnector):
    def on_external_hits_applied(self, applied: dict[str, int]) -> None:
        raise OSError("transfer engine down")


KVConnectorFactory.register_connector(
    "FailingApplyConnector", MODULE, "FailingApplyConnector"
)


def test_failing_on_external_hits_applied_fails_the_loads_of_its_hits(
    monkeypatch: pytest.MonkeyPatch,
):
    """The ranks agreed, so the hits stay applied; the block of each
    request's first skipped token is reported as a load error, named also
    when it came in an earlier step's scheduler output, and the error is
    logged once."""
    _single_rank(monkeypatch)
    logger = MagicMock()
    monkeypatch.setattr(external_hits, "logger", logger)
    connector = _make_connector("FailingApplyConnector", hits={})
    hits = connector._kv_transfer_config.kv_connector_extra_config["hits"]
    connector._kv_cache_config = _attention_groups(sliding_window=False)
    worker = external_hits.WorkerExternalHits(connector)

    # "c" computes its first 40 tokens (blocks 20-22), with no hit.
    first = _scheduler_output(new=[("c", 100, 0, 40)])
    first.scheduled_new_reqs[0].block_ids = ([20, 21, 22],)
    worker.apply(first)
    assert worker.failed_block_ids == set()
    hits.update(a=40, c=20)

    # "a" from token 16 (blocks 10-16); "c" from token 40, inside block 22,
    # which this step's output does not carry.
    so = _scheduler_output(new=[("a", 100, 16, 84)], cached=[("c", 40, 0, 36)])
    so.scheduled_new_reqs[0].block_ids = (list(range(10, 17)),)
    so.scheduled_cached_reqs.new_block_ids = [([23, 24],)]
    new_so = worker.apply(so)
    assert new_so.num_scheduled_tokens == {"a": 44, "c": 16}
    assert worker.applied == {"a": 40, "c": 20}
    assert worker.failed_block_ids == {11, 22}
    output = KVConnectorOutput(invalid_block_ids={7})
    worker.report(output)
    assert output.applied_external_hits == {"a": 40, "c": 20}
    assert output.invalid_block_ids == {7, 11, 22}

    # Reported once; a second failing step is not logged again.
    worker.report(empty := KVConnectorOutput())
    assert empty.applied_external_hits is None and not empty.invalid_block_ids
    worker.apply(_scheduler_output(new=[("b", 100, 0, 100)]))
    assert logger.exception.call_count == 1


def _multi_connector(children: list[dict[str, Any]]) -> MultiConnector:
    vllm_config = create_vllm_config(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": children},
    )
    return MultiConnector(vllm_config, KVConnectorRole.WORKER, _empty_kv_cache_config())


def _child(name: str, hits: Any = None) -> dict[str, Any]:
    return {
        "kv_connector": name,
        "kv_role": "kv_both",
        "kv_connector_module_path": MODULE
        if name == "HitsConnector"
        else "tests.v1.kv_connector.unit.utils",
        "kv_connector_extra_config": _extra_config(hits),
    }


def test_multi_connector_first_positive_hit_wins():
    mc = _multi_connector(
        [
            _child("MockKVConnector"),
            _child("HitsConnector", hits={"a": 0, "b": 7}),
            _child("HitsConnector", hits={"a": 3, "b": 9, "c": 2}),
        ]
    )
    assert mc.uses_before_update_states
    assert mc.before_update_states(_scheduler_output()) == {"a": 3, "b": 7, "c": 2}


def test_multi_connector_gives_each_child_the_hits_it_won(
    monkeypatch: pytest.MonkeyPatch,
):
    _single_rank(monkeypatch)
    mc = _multi_connector(
        [
            _child("MockKVConnector"),
            _child("HitsConnector", hits={"a": 0, "b": 7}),
            _child("HitsConnector", hits={"a": 3, "b": 9, "c": 2}),
        ]
    )
    mc._kv_cache_config = _attention_groups(sliding_window=False)
    so = _scheduler_output(
        new=[("a", 100, 0, 100), ("b", 100, 0, 100), ("c", 100, 0, 100)]
    )
    worker = external_hits.WorkerExternalHits(mc)
    worker.apply(so)
    assert worker.applied == {"a": 3, "b": 7, "c": 2}
    first, second = mc._connectors[1:]
    assert first.applied_calls == [{"b": 7}]
    assert second.applied_calls == [{"a": 3, "c": 2}]


def test_multi_connector_without_hook_users_is_not_called():
    mc = _multi_connector([_child("MockKVConnector"), _child("MockKVConnector")])
    assert not mc.uses_before_update_states
    mc._connectors.append(MagicMock())
    assert not MultiConnector.uses_before_update_states.func(mc)


def test_multi_connector_names_the_sub_connector_on_bad_hits():
    mc = _multi_connector([_child("HitsConnector", hits={"a": -2})])
    with pytest.raises(ValueError, match=r"HitsConnector.*'a'"):
        mc.before_update_states(_scheduler_output())


def test_pipeline_parallel_is_rejected_at_creation():
    vllm_config = create_vllm_config(
        kv_connector="HitsConnector",
        kv_connector_module_path=MODULE,
        kv_role="kv_both",
        kv_connector_extra_config=_extra_config({}),
    )
    vllm_config.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(ValueError, match="HitsConnector.*pipeline"):
        KVConnectorFactory.create_connector(
            vllm_config, KVConnectorRole.WORKER, _empty_kv_cache_config()
        )

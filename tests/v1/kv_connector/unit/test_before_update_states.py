# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for KVConnectorBase_V1.before_update_states() and the external hits
it reports: WorkerExternalHits (eligibility, clamping, copy, rank agreement
and failures), the MultiConnector forwarding, the report back to the
scheduler, the failed-load path, and the Model Runner V2 state update."""

import copy
import datetime
import multiprocessing
import time
from collections.abc import Sequence
from dataclasses import replace
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock

import pytest
import torch
import torch.distributed as dist

from tests.v1.kv_connector.unit.utils import (
    MockKVConnector,
    create_model_runner_output,
    create_request,
    create_scheduler,
    create_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole, external_hits
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
)
from vllm.pooling_params import PoolingParams
from vllm.sampling_params import SamplingParams
from vllm.utils.network_utils import get_open_port
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
    assert runner.applied_kv_connector_external_hits is None
    connector.before_update_states.assert_not_called()
    connector.on_external_hits_applied.assert_not_called()
    assert not external_hits.uses_worker_external_hits(connector)


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


def test_failed_load_on_two_group_model_cannot_be_recomputed():
    """Why the exclusion above is needed: on a model with two KV cache groups
    the scheduler stops on any reported block-level load failure."""
    vllm_config = create_vllm_config(
        kv_connector="MockKVConnector",
        kv_connector_module_path="tests.v1.kv_connector.unit.utils",
        kv_role="kv_both",
        kv_connector_extra_config=_extra_config(),
        kv_load_failure_policy="recompute",
    )
    scheduler = create_scheduler(vllm_config)
    scheduler.kv_cache_config = _attention_groups(sliding_window=True)
    with pytest.raises(RuntimeError, match="multiple KV cache groups"):
        scheduler._handle_invalid_blocks({1}, {})


def _min_worker(rank: int, port: int, ready: Any, results: Any, mode: str) -> None:
    ready.put(rank)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        group = SimpleNamespace(world_size=2, cpu_group=dist.group.WORLD)
        external_hits.get_tp_group = lambda: group
        external_hits.get_pcp_group = lambda: SimpleNamespace(world_size=1)
        # Rank 0 has hits for both requests, rank 1 only a smaller one for b.
        hits: Any = {"a": 9, "b": 50} if rank == 0 else {"b": 20}
        if rank == 1 and mode == "raises":
            hits = RuntimeError("cache unreachable")
        elif rank == 1 and mode == "bad_value":
            hits = {"b": -1}
        connector = _make_connector("HitsConnector", hits={})

        def before_update_states(so: SchedulerOutput) -> Any:
            if isinstance(hits, Exception):
                raise hits
            return hits

        connector.before_update_states = before_update_states
        so = _scheduler_output(new=[("a", 10, 0, 10), ("b", 100, 0, 64)])
        try:
            worker = external_hits.WorkerExternalHits(connector)
            worker.apply(so)
            results.put((rank, (worker.applied, connector.applied_calls)))
        except RuntimeError as e:
            results.put((rank, str(e)))
    finally:
        dist.destroy_process_group()


def _run_two_ranks(mode: str) -> dict[int, Any]:
    """Run _min_worker on two gloo ranks; a rank still running 120 s after
    both started fails the test instead of hanging it. Starting (a spawned
    interpreter importing vLLM) is not timed: on a loaded machine it alone
    can take minutes."""
    ctx = multiprocessing.get_context("spawn")
    ready, results = ctx.Queue(), ctx.Queue()
    port = get_open_port()
    procs = [
        ctx.Process(target=_min_worker, args=(r, port, ready, results, mode))
        for r in (0, 1)
    ]
    for p in procs:
        p.start()
    try:
        started = [ready.get(timeout=240) for _ in procs]
        assert sorted(started) == [0, 1]
        deadline = time.monotonic() + 120
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 0))
    finally:
        hung = [p.pid for p in procs if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
    assert not hung, f"ranks {hung} still waiting after 120 s"
    assert [p.exitcode for p in procs] == [0, 0]
    return dict(results.get(timeout=5) for _ in procs)


def test_ranks_apply_the_minimum():
    """Rank 0 holds a and b, rank 1 only part of b: both apply, and tell
    their connector to load, only the 20 tokens of b they agree on."""
    agreed = ({"b": 20}, [{"b": 20}])
    assert _run_two_ranks("ok") == {0: agreed, 1: agreed}


@pytest.mark.parametrize("mode", ["raises", "bad_value"])
def test_failing_rank_fails_the_step_on_every_rank(mode: str):
    results = _run_two_ranks(mode)
    message = "HitsConnector.before_update_states() failed on rank 1"
    assert message in results[0]
    assert results[0] == results[1]


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
    vllm_config = create_vllm_config(
        kv_connector="MockKVConnector",
        kv_connector_module_path="tests.v1.kv_connector.unit.utils",
        kv_role="kv_both",
        kv_connector_extra_config=_extra_config(),
        max_num_batched_tokens=64,
    )
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
    vllm_config = create_vllm_config(
        kv_connector="MockKVConnector",
        kv_connector_module_path="tests.v1.kv_connector.unit.utils",
        kv_role="kv_both",
        kv_connector_extra_config=_extra_config(),
        max_num_batched_tokens=128,
        kv_load_failure_policy="recompute",
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

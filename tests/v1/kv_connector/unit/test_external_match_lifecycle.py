# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for the external match lifecycle: prepare_external_match(),
commit_external_match() and abort_external_match(), their legacy defaults,
the guarantees Scheduler.schedule() gives on every path, the MultiConnector
forwarding and the opt-in ExternalMatchChecker."""

import dataclasses
import os
import random
import sys
from collections import Counter
from typing import Any
from unittest.mock import Mock, patch

import pytest

from tests.v1.kv_connector.unit.utils import (
    EOS_TOKEN_ID,
    MockKVConnector,
    create_request,
    create_scheduler,
    create_vllm_config,
)
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.distributed.kv_transfer.kv_connector.v1.external_match import (
    ExternalKVMatch,
    ExternalMatchCalls,
    ExternalMatchChecker,
    ExternalMatchLifecycle,
    ExternalMatchLifecycleError,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
    MultiExternalMatch,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

MODULE = "tests.v1.kv_connector.unit.test_external_match_lifecycle"
BLOCK_SIZE = 16


@dataclasses.dataclass(eq=False)
class Lease:
    req_id: str
    num_tokens: int


class LeasingConnector(MockKVConnector):
    """Leases what it offers in prepare_external_match() and records every
    broken guarantee instead of raising, so a test can check them all.

    extra config: "offer" (tokens offered past the local hit, capped to leave
    one token to compute), "is_async", "seed" (random offers, None answers
    and async loads when set).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.offer: int = extra.get("offer", 0)
        self.rng = random.Random(extra["seed"]) if "seed" in extra else None
        self.open: dict[str, Lease] = {}
        self.violations: list[str] = []
        self.calls: list[tuple[str, str, int]] = []
        self.committed_this_step: set[str] = set()

    def prepare_external_match(
        self, request: Request, num_computed_tokens: int
    ) -> ExternalKVMatch[Lease] | None:
        req_id = request.request_id
        if req_id in self.open:
            self.violations.append(f"{req_id}: prepare while a lease is open")
        offer, is_async = self.offer, self.config.is_async
        if self.rng is not None:
            if self.rng.random() < 0.15:
                self.calls.append(("prepare", req_id, -1))
                return None
            offer = self.rng.choice([0, 5, BLOCK_SIZE, 2 * BLOCK_SIZE, 100])
            is_async = self.rng.random() < 0.3
        offer = max(min(offer, request.num_tokens - 1 - num_computed_tokens), 0)
        self.calls.append(("prepare", req_id, offer))
        lease = Lease(req_id, offer)
        self.open[req_id] = lease
        return ExternalKVMatch(offer, is_async and offer > 0, lease)

    def commit_external_match(
        self, request: Request, blocks: KVCacheBlocks, match: ExternalKVMatch[Lease]
    ) -> None:
        req_id = request.request_id
        self.calls.append(("commit", req_id, match.num_tokens))
        self.committed_this_step.add(req_id)
        lease = self.open.pop(req_id, None)
        if match.query_result is None:
            if lease is not None or match.num_tokens != 0:
                self.violations.append(f"{req_id}: commit bypassed an open lease")
        elif lease is None or match.query_result is not lease:
            self.violations.append(f"{req_id}: commit of an unknown lease")
        elif not 0 <= match.num_tokens <= lease.num_tokens:
            self.violations.append(f"{req_id}: commit of more than leased")

    def abort_external_match(
        self, request: Request, match: ExternalKVMatch[Lease]
    ) -> None:
        req_id = request.request_id
        self.calls.append(("abort", req_id, match.num_tokens))
        lease = self.open.pop(req_id, None)
        if lease is None or match.query_result is not lease:
            self.violations.append(f"{req_id}: abort of an unknown lease")

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        admitted = {r.req_id for r in scheduler_output.scheduled_new_reqs}
        admitted |= scheduler_output.scheduled_cached_reqs.resumed_req_ids
        if missing := admitted - self.committed_this_step:
            self.violations.append(f"{sorted(missing)}: admitted without commit")
        self.committed_this_step = set()
        return super().build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if request.request_id in self.open:
            self.violations.append(f"{request.request_id}: freed with open lease")
        return False, None


class LifecycleOnlyConnector(LeasingConnector):
    """A LeasingConnector without MockKVConnector's legacy pair."""

    get_num_new_matched_tokens = KVConnectorBase_V1.get_num_new_matched_tokens
    update_state_after_alloc = KVConnectorBase_V1.update_state_after_alloc


KVConnectorFactory.register_connector("LeasingConnector", MODULE, "LeasingConnector")
KVConnectorFactory.register_connector(
    "LifecycleOnlyConnector", MODULE, "LifecycleOnlyConnector"
)


def _make_scheduler(
    num_blocks: int = 1000,
    check: bool = True,
    extra: dict[str, Any] | None = None,
    **config_kwargs: Any,
) -> Any:
    vllm_config = create_vllm_config(
        kv_connector="LeasingConnector",
        kv_connector_module_path=MODULE,
        kv_role="kv_both",
        kv_connector_extra_config={
            "matched_tokens": 0,
            "is_async": False,
            **(extra or {}),
        },
        block_size=BLOCK_SIZE,
        **config_kwargs,
    )
    # The checker is switched on when the scheduler is built.
    with patch.dict(
        os.environ, {"VLLM_CHECK_EXTERNAL_MATCH_LIFECYCLE": "1" if check else "0"}
    ):
        return create_scheduler(vllm_config, num_blocks=num_blocks)


def _model_output(scheduler: Any, so: SchedulerOutput, **kv: Any) -> ModelRunnerOutput:
    """Sample one token for every scheduled request that finished its prefill."""
    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([7] if done else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[None] * len(req_ids),
        kv_connector_output=KVConnectorOutput(**kv) if kv else None,
    )


def _assert_clean(connector: LeasingConnector) -> None:
    assert connector.violations == []
    assert connector.open == {}


# ---------------------------------------------------------------------------
# Defaults: legacy connectors see exactly the calls they see today.
# ---------------------------------------------------------------------------


def test_defaults_bridge_to_the_legacy_methods():
    connector = Mock(spec=KVConnectorBase_V1)
    request, blocks = Mock(), Mock()
    connector.get_num_new_matched_tokens.return_value = (32, True)
    match = KVConnectorBase_V1.prepare_external_match(connector, request, 16)
    assert match == ExternalKVMatch(32, True)
    connector.get_num_new_matched_tokens.assert_called_once_with(request, 16)

    connector.get_num_new_matched_tokens.return_value = (None, False)
    assert KVConnectorBase_V1.prepare_external_match(connector, request, 0) is None

    KVConnectorBase_V1.commit_external_match(
        connector, request, blocks, dataclasses.replace(match, num_tokens=16)
    )
    connector.update_state_after_alloc.assert_called_once_with(request, blocks, 16)
    assert KVConnectorBase_V1.abort_external_match(connector, request, match) is None


def _mock_connector_config(matched_tokens: int = 0) -> Any:
    return create_vllm_config(
        kv_connector="MockKVConnector",
        kv_connector_module_path="tests.v1.kv_connector.unit.utils",
        kv_role="kv_both",
        kv_connector_extra_config={"matched_tokens": matched_tokens, "is_async": False},
        block_size=BLOCK_SIZE,
    )


def test_connector_without_either_api_fails_at_construction():
    class NoMatchApi(MockKVConnector):
        get_num_new_matched_tokens = KVConnectorBase_V1.get_num_new_matched_tokens

    with pytest.raises(TypeError) as info:
        NoMatchApi(_mock_connector_config(), KVConnectorRole.SCHEDULER, Mock())
    message = str(info.value)
    assert message.startswith("test_connector_without_either_api_fails_at_constr")
    assert "NoMatchApi implements neither prepare_external_match()" in message
    assert "get_num_new_matched_tokens()" in message

    class NoCommit(MockKVConnector):
        update_state_after_alloc = KVConnectorBase_V1.update_state_after_alloc

    with pytest.raises(TypeError, match="commit_external_match.. or update_state"):
        NoCommit(_mock_connector_config(), KVConnectorRole.SCHEDULER, Mock())


def test_either_pair_constructs():
    class Legacy(MockKVConnector):
        pass

    class Lifecycle(MockKVConnector):
        get_num_new_matched_tokens = KVConnectorBase_V1.get_num_new_matched_tokens
        update_state_after_alloc = KVConnectorBase_V1.update_state_after_alloc
        prepare_external_match = LeasingConnector.prepare_external_match
        commit_external_match = LeasingConnector.commit_external_match

    legacy = Legacy(_mock_connector_config(), KVConnectorRole.SCHEDULER, Mock())
    assert not legacy.uses_external_match_lifecycle
    lifecycle = Lifecycle(_mock_connector_config(), KVConnectorRole.SCHEDULER, Mock())
    assert lifecycle.uses_external_match_lifecycle


def test_legacy_connector_is_called_directly_by_the_scheduler():
    vllm_config = _mock_connector_config(matched_tokens=BLOCK_SIZE)
    with patch.dict(os.environ, {"VLLM_CHECK_EXTERNAL_MATCH_LIFECYCLE": "1"}):
        scheduler = create_scheduler(vllm_config)
    # The legacy calls, no match objects: the legacy pair costs what it did.
    assert type(scheduler.external_matches) is ExternalMatchCalls
    connector = scheduler.connector
    connector.prepare_external_match = Mock()
    connector.commit_external_match = Mock()
    scheduler.add_request(create_request(num_tokens=50, block_size=BLOCK_SIZE))
    scheduler.schedule()
    connector.prepare_external_match.assert_not_called()
    connector.commit_external_match.assert_not_called()


def _functions_called(step: Any) -> set[str]:
    """The Python functions step() calls, as "file:qualified name"."""
    called: set[str] = set()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            called.add(f"{os.path.basename(code.co_filename)}:{code.co_qualname}")

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return called


@pytest.mark.parametrize("with_connector", [False, True])
def test_steps_without_a_lifecycle_connector_call_no_lifecycle_code(
    with_connector: bool,
):
    # With no connector a step runs nothing of the lifecycle; with one that
    # does not use it, only the forwarding of the two legacy calls and an
    # empty end_pass().
    vllm_config = _mock_connector_config(matched_tokens=BLOCK_SIZE)
    if not with_connector:
        vllm_config.kv_transfer_config = None
    scheduler = create_scheduler(vllm_config)
    assert (scheduler.connector is not None) == with_connector
    for _ in range(3):
        scheduler.add_request(create_request(num_tokens=50, block_size=BLOCK_SIZE))
    outputs: list[SchedulerOutput] = []

    def step() -> None:
        so = scheduler.schedule()
        outputs.append(so)
        scheduler.update_from_output(so, _model_output(scheduler, so))

    called = _functions_called(step)
    assert outputs[0].num_scheduled_tokens
    assert "scheduler.py:Scheduler.schedule" in called
    lifecycle = {c for c in called if c.startswith("external_match.py:")}
    if not with_connector:
        assert lifecycle == set()
    else:
        assert lifecycle == {
            "external_match.py:ExternalMatchCalls.prepare",
            "external_match.py:ExternalMatchCalls.commit",
            "external_match.py:ExternalMatchCalls.end_pass",
        }


def test_bare_mock_connector_is_driven_through_the_legacy_pair():
    # Out-of-tree harnesses replace Scheduler.connector by a Mock configured
    # through the legacy methods; it is not a KVConnectorBase_V1 subclass
    # that overrides the lifecycle, so it gets the legacy calls.
    scheduler = create_scheduler(create_vllm_config(block_size=BLOCK_SIZE))
    scheduler.connector = Mock()
    scheduler.connector.get_num_new_matched_tokens.return_value = (0, False)
    request = create_request(num_tokens=50, block_size=BLOCK_SIZE)
    scheduler.add_request(request)
    so = scheduler.schedule()
    assert so.num_scheduled_tokens[request.request_id] == 50
    scheduler.connector.update_state_after_alloc.assert_called_once()


def test_legacy_connector_calls_are_unchanged_through_the_scheduler():
    vllm_config = _mock_connector_config(matched_tokens=2 * BLOCK_SIZE)
    scheduler = create_scheduler(vllm_config)
    connector = scheduler.connector
    connector.get_num_new_matched_tokens = Mock(
        wraps=connector.get_num_new_matched_tokens
    )
    connector.update_state_after_alloc = Mock()
    request = create_request(num_tokens=50, block_size=BLOCK_SIZE)
    scheduler.add_request(request)
    so = scheduler.schedule()

    connector.get_num_new_matched_tokens.assert_called_once_with(request, 0)
    connector.update_state_after_alloc.assert_called_once()
    args = connector.update_state_after_alloc.call_args.args
    assert args[0] is request and args[2] == 2 * BLOCK_SIZE
    assert so.num_scheduled_tokens[request.request_id] == 50 - 2 * BLOCK_SIZE


# ---------------------------------------------------------------------------
# Guarantees 2 and 4: what commit receives.
# ---------------------------------------------------------------------------


def test_commit_receives_the_accepted_tokens_and_the_same_query_result():
    scheduler = _make_scheduler(extra={"offer": 2 * BLOCK_SIZE + 5})
    connector = scheduler.connector
    request = create_request(num_tokens=80, block_size=BLOCK_SIZE)
    scheduler.add_request(request)
    leases: list[Lease] = []
    commits: list[ExternalKVMatch] = []
    prepare, commit = connector.prepare_external_match, connector.commit_external_match

    def spy_prepare(*args: Any) -> ExternalKVMatch | None:
        match = prepare(*args)
        assert match is not None and isinstance(match.query_result, Lease)
        leases.append(match.query_result)
        return match

    def spy_commit(request: Request, blocks: Any, match: ExternalKVMatch) -> None:
        commits.append(match)
        commit(request, blocks, match)

    connector.prepare_external_match = spy_prepare
    connector.commit_external_match = spy_commit
    # Bounded prompt replay takes only whole blocks of an external hit.
    scheduler.prefix_replay_tokens = 1
    scheduler.schedule()

    (match,) = commits
    assert match.query_result is leases[0]
    assert match.num_tokens == 2 * BLOCK_SIZE
    _assert_clean(connector)


def test_skip_reading_prefix_cache_is_not_prepared():
    scheduler = _make_scheduler(extra={"offer": 2 * BLOCK_SIZE})
    connector = scheduler.connector
    request = Request(
        request_id="prompt-logprobs",
        prompt_token_ids=list(range(80)),
        sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=1),
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )
    assert request.skip_reading_prefix_cache
    scheduler.add_request(request)
    scheduler.schedule()
    # Nothing is pinned or leased for tokens the request will not read.
    assert connector.calls == [("commit", request.request_id, 0)]
    _assert_clean(connector)


def test_resume_after_async_load_commits_no_external_match():
    scheduler = _make_scheduler(extra={"offer": 2 * BLOCK_SIZE, "is_async": True})
    connector = scheduler.connector
    request = create_request(num_tokens=80, block_size=BLOCK_SIZE)
    scheduler.add_request(request)
    so = scheduler.schedule()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    scheduler.update_from_output(
        so, _model_output(scheduler, so, finished_recving={request.request_id})
    )
    so = scheduler.schedule()
    assert request.request_id in so.num_scheduled_tokens
    assert connector.calls == [
        ("prepare", request.request_id, 2 * BLOCK_SIZE),
        ("commit", request.request_id, 2 * BLOCK_SIZE),
        ("commit", request.request_id, 0),
    ]
    _assert_clean(connector)


# ---------------------------------------------------------------------------
# Guarantee 3: every path that leaves a prepared request unadmitted aborts.
# ---------------------------------------------------------------------------


def _prepare_then_abort(scheduler: Any, request: Request, **schedule_kwargs: Any):
    connector = scheduler.connector
    connector.calls.clear()
    scheduler.add_request(request)
    so = scheduler.schedule(**schedule_kwargs)
    assert request.request_id not in so.num_scheduled_tokens
    assert [c[0] for c in connector.calls if c[1] == request.request_id] == [
        "prepare",
        "abort",
    ]
    _assert_clean(connector)
    return so


def test_abort_when_allocation_fails():
    scheduler = _make_scheduler(num_blocks=4, extra={"offer": BLOCK_SIZE})
    _prepare_then_abort(
        scheduler, create_request(num_tokens=200, block_size=BLOCK_SIZE)
    )


def test_abort_when_chunked_prefill_is_disabled():
    scheduler = _make_scheduler(
        extra={"offer": BLOCK_SIZE},
        enable_chunked_prefill=False,
        max_num_batched_tokens=64,
        max_model_len=64,
    )
    scheduler.scheduler_config.max_model_len = 1000
    _prepare_then_abort(
        scheduler, create_request(num_tokens=200, block_size=BLOCK_SIZE)
    )


def test_abort_when_encoder_inputs_are_pending():
    scheduler = _make_scheduler(extra={"offer": BLOCK_SIZE})
    # An encoder cache connector whose transfer of the request's encoder
    # output has not arrived yet.
    scheduler.ec_connector = Mock()
    scheduler.ec_connector.ensure_cache_available.return_value = False
    request = create_request(num_tokens=60, block_size=BLOCK_SIZE)
    request.mm_features = [Mock()]
    _prepare_then_abort(scheduler, request)
    scheduler.ec_connector.ensure_cache_available.assert_called_once_with(
        request, BLOCK_SIZE
    )


def test_abort_when_prefills_are_deferred():
    scheduler = _make_scheduler(extra={"offer": BLOCK_SIZE})
    decoding = create_request(num_tokens=20, block_size=BLOCK_SIZE)
    scheduler.add_request(decoding)
    so = scheduler.schedule()
    scheduler.update_from_output(so, _model_output(scheduler, so))
    scheduler.prefill_capacity_bound = False
    _prepare_then_abort(
        scheduler,
        create_request(num_tokens=60, block_size=BLOCK_SIZE),
        throttle_prefills=True,
    )


def test_abort_when_mamba_split_leaves_nothing():
    scheduler = _make_scheduler(extra={"offer": BLOCK_SIZE})
    # The split returns 0 only for a hybrid Mamba KV cache layout, which
    # create_scheduler() does not build, so it is stubbed here.
    scheduler.need_mamba_block_aligned_split = True
    scheduler._mamba_block_aligned_split = lambda *args: 0
    _prepare_then_abort(scheduler, create_request(num_tokens=60, block_size=BLOCK_SIZE))


def test_abort_when_no_tokens_remain_to_schedule():
    scheduler = _make_scheduler(extra={"offer": BLOCK_SIZE}, max_num_batched_tokens=32)
    # A multi-module MTP drafter needs the last 64 prefill tokens in one chunk:
    # 44 tokens are left after the hit, more than the budget of 32.
    scheduler.num_prefill_lookahead = 64
    _prepare_then_abort(scheduler, create_request(num_tokens=60, block_size=BLOCK_SIZE))


def test_abort_when_spec_decode_padding_does_not_fit():
    scheduler = _make_scheduler(
        extra={"offer": 100}, max_num_batched_tokens=2, max_num_seqs=2
    )
    scheduler.num_spec_tokens = 2
    scheduler.dynamic_sd_lookup = None
    # The hit leaves one token: padded to 3 it exceeds the budget of 2.
    _prepare_then_abort(scheduler, create_request(num_tokens=60, block_size=BLOCK_SIZE))


def test_none_answer_is_neither_committed_nor_aborted():
    scheduler = _make_scheduler(extra={"offer": BLOCK_SIZE})
    connector = scheduler.connector
    request = create_request(num_tokens=60, block_size=BLOCK_SIZE)
    connector.prepare_external_match = Mock(return_value=None)
    connector.commit_external_match = Mock()
    connector.abort_external_match = Mock()
    scheduler.add_request(request)
    so = scheduler.schedule()
    assert request.request_id not in so.num_scheduled_tokens
    connector.commit_external_match.assert_not_called()
    connector.abort_external_match.assert_not_called()


def test_abort_comes_before_the_next_prepare_and_the_free():
    # The pool fits one request: the second is prepared and aborted every
    # step until the first finishes, then aborted by the client.
    scheduler = _make_scheduler(num_blocks=6, extra={"offer": BLOCK_SIZE})
    connector = scheduler.connector
    first = create_request(num_tokens=60, block_size=BLOCK_SIZE)
    second = create_request(num_tokens=60, block_size=BLOCK_SIZE)
    scheduler.add_request(first)
    scheduler.add_request(second)
    for _ in range(3):
        so = scheduler.schedule()
        scheduler.update_from_output(so, _model_output(scheduler, so))
    scheduler.finish_requests(second.request_id, RequestStatus.FINISHED_ABORTED)
    calls = [c[0] for c in connector.calls if c[1] == second.request_id]
    assert calls == ["prepare", "abort"] * 3
    _assert_clean(connector)


def test_abort_when_the_pass_raises():
    # An exception in the middle of the pass (here the allocation) never
    # reaches end_pass(): the open match is aborted before it propagates, so
    # the next prepare finds no lease left behind.
    scheduler = _make_scheduler(extra={"offer": BLOCK_SIZE})
    connector = scheduler.connector
    request = create_request(num_tokens=60, block_size=BLOCK_SIZE)
    scheduler.add_request(request)
    allocate_slots = scheduler.kv_cache_manager.allocate_slots
    scheduler.kv_cache_manager.allocate_slots = Mock(side_effect=RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        scheduler.schedule()
    assert [c[0] for c in connector.calls] == ["prepare", "abort"]
    _assert_clean(connector)

    scheduler.kv_cache_manager.allocate_slots = allocate_slots
    so = scheduler.schedule()
    assert request.request_id in so.num_scheduled_tokens
    assert [c[0] for c in connector.calls] == ["prepare", "abort", "prepare", "commit"]
    _assert_clean(connector)


def test_commit_of_external_tokens_needs_a_prepared_match():
    lifecycle = ExternalMatchLifecycle()
    request = create_request(num_tokens=80, block_size=BLOCK_SIZE)
    with pytest.raises(ExternalMatchLifecycleError, match="without a prepared match"):
        lifecycle.commit(Mock(), request, Mock(), num_tokens=16, load_kv_async=True)


# ---------------------------------------------------------------------------
# Guarantees as properties over seeded random workloads.
# ---------------------------------------------------------------------------


def run_random_workload(scheduler: Any, seed: int, num_steps: int) -> Counter:
    """Drive the real scheduler with arrivals, client aborts, async loads,
    chunked prefill, shared prefixes and preemption; return call counts."""
    rng = random.Random(seed)
    connector = scheduler.connector
    loading: dict[str, int] = {}
    next_id = 0
    for _ in range(num_steps):
        if rng.random() < 0.5:
            next_id += 1
            prefix = rng.choice([0, BLOCK_SIZE, 3 * BLOCK_SIZE])
            request = create_request(
                request_id=seed * 100_000 + next_id,
                num_tokens=prefix + rng.randint(2, 120),
                common_prefix_len=prefix,
                max_tokens=rng.randint(1, 24),
                block_size=BLOCK_SIZE,
            )
            scheduler.add_request(request)
        if scheduler.requests and rng.random() < 0.08:
            victim = rng.choice(sorted(scheduler.requests))
            scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
        loading = _step(scheduler, rng, loading)
    # Abort what is left; aborted loads are freed once their transfer ends.
    scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    for _ in range(5):
        loading = _step(scheduler, rng, dict.fromkeys(loading, 0))
    return Counter(call[0] for call in connector.calls)


def _step(scheduler: Any, rng: random.Random, loading: dict[str, int]):
    """One scheduler step; asynchronous loads finish after 0-3 steps."""
    so = scheduler.schedule()
    assert scheduler.connector.open == {}, "a match outlived its scheduling pass"
    for req_id, request in scheduler.requests.items():
        if (
            request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            and req_id not in scheduler.finished_recving_kv_req_ids
        ):
            loading.setdefault(req_id, rng.randint(0, 3))
    done = {req_id for req_id, left in loading.items() if left == 0}
    output = _model_output(scheduler, so, finished_recving=done)
    for tokens in output.sampled_token_ids:
        if tokens and rng.random() < 0.05:
            tokens[0] = EOS_TOKEN_ID
    scheduler.update_from_output(so, output)
    return {req_id: left - 1 for req_id, left in loading.items() if left}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("enable_chunked_prefill", [True, False])
def test_random_workloads_keep_every_guarantee(seed: int, enable_chunked_prefill: bool):
    scheduler = _make_scheduler(
        num_blocks=40,
        extra={"seed": seed},
        enable_chunked_prefill=enable_chunked_prefill,
        max_num_batched_tokens=64 if enable_chunked_prefill else 256,
        max_model_len=10000 if enable_chunked_prefill else 256,
        max_num_seqs=8,
    )
    counts = run_random_workload(scheduler, seed, num_steps=300)
    connector = scheduler.connector
    _assert_clean(connector)
    # The workload reaches every kind of call, preemption and async loads.
    assert counts["prepare"] > 100 and counts["commit"] > 50 and counts["abort"] > 0
    assert scheduler.requests == {}


# ---------------------------------------------------------------------------
# MultiConnector forwarding.
# ---------------------------------------------------------------------------


def _multi_connector(offers: list[int]) -> MultiConnector:
    vllm_config = create_vllm_config(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "connectors": [
                {
                    "kv_connector": "LeasingConnector",
                    "kv_connector_module_path": MODULE,
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {
                        "matched_tokens": 0,
                        "is_async": False,
                        "offer": offer,
                    },
                }
                for offer in offers
            ]
        },
    )
    return MultiConnector(vllm_config, KVConnectorRole.SCHEDULER, Mock())


def test_multi_connector_commits_each_sub_connector_own_match():
    mc = _multi_connector([0, 2 * BLOCK_SIZE, BLOCK_SIZE])
    request = create_request(num_tokens=80, block_size=BLOCK_SIZE)
    match = mc.prepare_external_match(request, 0)
    assert match is not None and match.num_tokens == 2 * BLOCK_SIZE
    multi = match.query_result
    assert isinstance(multi, MultiExternalMatch) and multi.chosen == 1
    mc.commit_external_match(
        request, Mock(), dataclasses.replace(match, num_tokens=BLOCK_SIZE)
    )
    calls = [c.calls for c in mc._connectors]
    assert calls == [
        [("prepare", request.request_id, 0), ("commit", request.request_id, 0)],
        [
            ("prepare", request.request_id, 2 * BLOCK_SIZE),
            ("commit", request.request_id, BLOCK_SIZE),
        ],
        [
            ("prepare", request.request_id, BLOCK_SIZE),
            ("commit", request.request_id, 0),
        ],
    ]
    for c in mc._connectors:
        _assert_clean(c)


def test_multi_connector_abort_and_none_release_every_sub_match():
    mc = _multi_connector([BLOCK_SIZE, BLOCK_SIZE])
    request = create_request(num_tokens=80, block_size=BLOCK_SIZE)
    match = mc.prepare_external_match(request, 0)
    assert match is not None
    mc.abort_external_match(request, match)
    for c in mc._connectors:
        _assert_clean(c)

    second = mc._connectors[1]
    second.prepare_external_match = Mock(return_value=None)
    assert mc.prepare_external_match(request, 0) is None
    assert [c[0] for c in mc._connectors[0].calls] == [
        "prepare",
        "abort",
        "prepare",
        "abort",
    ]
    _assert_clean(mc._connectors[0])


def test_multi_connector_forgets_the_choice_of_a_match_it_does_not_load():
    mc = _multi_connector([BLOCK_SIZE, 2 * BLOCK_SIZE])
    first, second = mc._connectors
    first._cache_hit_source = CacheHitSource.HOST
    request = create_request(num_tokens=80, block_size=BLOCK_SIZE)
    host_hit = {CacheHitSource.HOST: BLOCK_SIZE}
    no_choice = {CacheHitSource.EXTERNAL_UNSPECIFIED: BLOCK_SIZE}

    def hit_sources() -> dict[CacheHitSource, int]:
        return mc.get_external_cache_hit_sources(request, BLOCK_SIZE)

    # Between prepare and commit the scheduler reads the prepared choice.
    match = mc.prepare_external_match(request, 0)
    assert match is not None and hit_sources() == host_hit
    mc.abort_external_match(request, match)
    assert hit_sources() == no_choice

    # A lookup still in flight leaves no choice behind either.
    match = mc.prepare_external_match(request, 0)
    assert match is not None
    mc.abort_external_match(request, match)
    second.prepare_external_match = Mock(return_value=None)
    assert mc.prepare_external_match(request, 0) is None
    assert hit_sources() == no_choice
    del second.prepare_external_match

    # Neither does a commit of none of the offered tokens; a load keeps it.
    match = mc.prepare_external_match(request, 0)
    assert match is not None
    mc.commit_external_match(request, Mock(), dataclasses.replace(match, num_tokens=0))
    assert hit_sources() == no_choice
    match = mc.prepare_external_match(request, 0)
    assert match is not None
    mc.commit_external_match(request, Mock(), match)
    assert hit_sources() == host_hit
    for c in mc._connectors:
        _assert_clean(c)


# ---------------------------------------------------------------------------
# The opt-in checker.
# ---------------------------------------------------------------------------


def test_checker_is_off_by_default_and_on_by_env():
    assert _make_scheduler(check=False).external_matches._checker is None
    assert isinstance(
        _make_scheduler(check=True).external_matches._checker, ExternalMatchChecker
    )


def test_checker_catches_an_admission_without_commit():
    scheduler = _make_scheduler(check=True, extra={"offer": BLOCK_SIZE})
    lifecycle = scheduler.external_matches
    # A scheduler that forgot the commit of an admitted request (guarantee 4).
    lifecycle.commit = Mock()
    request = create_request(num_tokens=60, block_size=BLOCK_SIZE)
    scheduler.add_request(request)
    with pytest.raises(ExternalMatchLifecycleError) as info:
        scheduler.schedule()
    message = str(info.value)
    assert request.request_id in message
    assert "admitted without commit_external_match()" in message


def test_checker_reports_request_and_history():
    lifecycle = ExternalMatchLifecycle(ExternalMatchChecker())
    connector = Mock()
    request = create_request(num_tokens=80, block_size=BLOCK_SIZE)
    connector.prepare_external_match.return_value = ExternalKVMatch(16, False, "plan")
    lifecycle.prepare(connector, request, 0)
    with pytest.raises(ExternalMatchLifecycleError) as info:
        lifecycle.commit(connector, request, Mock(), num_tokens=32, load_kv_async=False)
    message = str(info.value)
    assert request.request_id in message and "more tokens than prepared" in message
    assert "prepare_external_match(num_computed_tokens=0)" in message


def test_checker_rejects_invalid_matches_naming_the_connector():
    lifecycle = ExternalMatchLifecycle(ExternalMatchChecker())
    connector = Mock()
    request = create_request(num_tokens=80, block_size=BLOCK_SIZE)
    connector.prepare_external_match.return_value = (16, False)
    with pytest.raises(ExternalMatchLifecycleError, match="returned tuple"):
        lifecycle.prepare(connector, request, 0)
    connector.prepare_external_match.return_value = ExternalKVMatch(0, True)
    with pytest.raises(ExternalMatchLifecycleError, match="invalid match"):
        ExternalMatchLifecycle(ExternalMatchChecker()).prepare(connector, request, 0)


def test_checker_catches_a_match_left_open():
    checker = ExternalMatchChecker()
    connector = Mock()
    request = create_request(num_tokens=80, block_size=BLOCK_SIZE)
    connector.prepare_external_match.return_value = ExternalKVMatch(16)
    checker.prepare(connector, request, 0)
    with pytest.raises(ExternalMatchLifecycleError, match="still open"):
        checker.end_pass([], [])
    with pytest.raises(ExternalMatchLifecycleError, match="while a match is open"):
        checker.prepare(connector, request, 0)


# ---------------------------------------------------------------------------
# Legacy entry points over sub-connectors that use the lifecycle.
# ---------------------------------------------------------------------------


def _legacy_multi_connector(legacy_offer: int | None) -> MultiConnector:
    children: list[dict[str, Any]] = [
        {
            "kv_connector": "LifecycleOnlyConnector",
            "kv_connector_module_path": MODULE,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "matched_tokens": 0,
                "is_async": False,
                "offer": 2 * BLOCK_SIZE,
            },
        }
    ]
    if legacy_offer is not None:
        children.insert(
            0,
            {
                "kv_connector": "MockKVConnector",
                "kv_connector_module_path": "tests.v1.kv_connector.unit.utils",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "matched_tokens": legacy_offer,
                    "is_async": False,
                },
            },
        )
    vllm_config = create_vllm_config(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": children},
    )
    return MultiConnector(vllm_config, KVConnectorRole.SCHEDULER, Mock())


def test_multi_connector_of_legacy_children_does_not_use_the_lifecycle():
    vllm_config = create_vllm_config(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "connectors": [
                {
                    "kv_connector": "MockKVConnector",
                    "kv_connector_module_path": "tests.v1.kv_connector.unit.utils",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {
                        "matched_tokens": 0,
                        "is_async": False,
                    },
                }
            ]
            * 2
        },
    )
    mc = MultiConnector(vllm_config, KVConnectorRole.SCHEDULER, Mock())
    assert not mc.uses_external_match_lifecycle
    assert type(ExternalMatchCalls.for_connector(mc)) is ExternalMatchCalls
    assert _legacy_multi_connector(0).uses_external_match_lifecycle


@pytest.mark.parametrize("legacy_offer", [None, 0])
def test_multi_connector_legacy_entry_points_reject_lifecycle_children(
    legacy_offer: int | None,
):
    # The scheduler drives this MultiConnector through the lifecycle; the
    # legacy pair could not release what a lifecycle child pins, so a caller
    # of it gets a TypeError naming the child instead of a leak.
    mc = _legacy_multi_connector(legacy_offer)
    lifecycle_child = mc._connectors[-1]
    request = create_request(num_tokens=80, block_size=BLOCK_SIZE)
    with pytest.raises(TypeError, match="^LifecycleOnlyConnector implements the"):
        mc.get_num_new_matched_tokens(request, 0)
    with pytest.raises(TypeError, match="not update_state_after_alloc"):
        mc.update_state_after_alloc(request, Mock(), 0)
    assert isinstance(lifecycle_child, LifecycleOnlyConnector)
    assert lifecycle_child.calls == []


# ---------------------------------------------------------------------------
# Why prepare comes before the encoder and deferred-prefill rejections.
# ---------------------------------------------------------------------------


def test_deferred_prefill_is_admitted_when_its_match_loads_asynchronously():
    # Under DP prefill balancing a request whose KV loads asynchronously is
    # still admitted (it computes nothing this step): whether the deferral
    # rejects a request depends on the match, so the match comes first.
    scheduler = _make_scheduler(extra={"offer": 2 * BLOCK_SIZE, "is_async": True})
    decoding = create_request(num_tokens=20, block_size=BLOCK_SIZE)
    scheduler.add_request(decoding)
    so = scheduler.schedule()
    scheduler.update_from_output(so, _model_output(scheduler, so))
    scheduler.prefill_capacity_bound = False
    request = create_request(num_tokens=60, block_size=BLOCK_SIZE)
    scheduler.add_request(request)
    scheduler.schedule(throttle_prefills=True)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    _assert_clean(scheduler.connector)

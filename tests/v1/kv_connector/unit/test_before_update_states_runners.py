# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for where the model runners call KVConnectorBase_V1.
before_update_states(), and for Model Runner V2's request state update with
the hits applied. They run on CPU: the runners' execute_model() is driven up
to the state update with stand-ins for everything else, and V2's
RequestState lives on the CPU with its staged-write kernel replaced by the
equivalent tensor writes."""

from dataclasses import replace
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock

import pytest
import torch

from tests.v1.kv_connector.unit.test_before_update_states import (
    HitsConnector,
    _make_connector,
    _scheduler_output,
    _single_rank,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.worker.gpu import buffer_utils
from vllm.v1.worker.gpu import kv_connector as v2_kv_connector
from vllm.v1.worker.gpu.buffer_utils import StagedWriteTensor
from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2ModelRunner
from vllm.v1.worker.gpu.states import RequestState
from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1ModelRunner

pytestmark = pytest.mark.cpu_test


class _StateUpdateReached(Exception):
    pass


def test_v1_runner_applies_hits_before_update_states(
    monkeypatch: pytest.MonkeyPatch,
):
    _single_rank(monkeypatch)
    connector = _make_connector("HitsConnector", hits={"a": 40})
    calls: list[str] = []
    connector.handle_preemptions = lambda meta: calls.append("handle_preemptions")

    def before_update_states(self: Any, so: SchedulerOutput) -> dict[str, int]:
        calls.append("before_update_states")
        return {"a": 40, "b": 30}

    monkeypatch.setattr(HitsConnector, "before_update_states", before_update_states)
    connector.on_external_hits_applied = lambda applied: calls.append(applied)
    module = "vllm.v1.worker.gpu_model_runner"
    monkeypatch.setattr(f"{module}.has_kv_transfer_group", lambda: True)
    monkeypatch.setattr(f"{module}.get_kv_transfer_group", lambda: connector)
    monkeypatch.setattr(
        "vllm.v1.worker.kv_connector_model_runner_mixin.get_kv_transfer_group",
        lambda: connector,
    )
    updated: list[SchedulerOutput] = []

    def update_states(so: SchedulerOutput) -> None:
        updated.append(so)
        raise _StateUpdateReached

    runner = MagicMock(
        execute_model_state=None,
        speculative_config=None,
        _worker_external_hits=None,
        _update_states=update_states,
    )
    runner.apply_kv_connector_external_hits = (
        lambda so: V1ModelRunner.apply_kv_connector_external_hits(runner, so)
    )
    # "b" is a decode: its reported hit is not applied.
    so = _scheduler_output(new=[("a", 100, 0, 100)], cached=[("b", 100, 1, 1)])
    so.kv_connector_metadata = SimpleNamespace()

    with pytest.raises(_StateUpdateReached):
        V1ModelRunner.execute_model(runner, so)

    # The connector learns the applied hits before the state update, so
    # before bind_connector_metadata() and start_load_kv().
    assert calls == ["handle_preemptions", "before_update_states", {"a": 40}]
    assert updated[0].num_scheduled_tokens == {"a": 60, "b": 1}
    # What maybe_get_kv_connector_output() reports to the scheduler.
    assert runner._worker_external_hits.applied == {"a": 40}


def test_v1_gpu_model_runner_updates_its_states_with_the_hits(
    monkeypatch: pytest.MonkeyPatch, dist_init
):
    """A real V1 GPUModelRunner on this machine's device (CPU here), set up as
    in tests/v1/worker: the hits applied before its state update are what
    its request states and persistent batch hold, and what it reports."""
    from tests.v1.worker.test_gpu_model_runner import (
        DEVICE_TYPE,
        get_vllm_config,
        initialize_kv_cache,
    )
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.sampling_params import SamplingParams

    _single_rank(monkeypatch)
    connector = _make_connector("HitsConnector", hits={"a": 40})
    monkeypatch.setattr(
        "vllm.v1.worker.kv_connector_model_runner_mixin.get_kv_transfer_group",
        lambda: connector,
    )
    vllm_config = get_vllm_config()
    with set_current_vllm_config(vllm_config):
        model_config = vllm_config.model_config
        vllm_config.compilation_config.static_forward_context["layer.0"] = Attention(
            model_config.get_num_kv_heads(vllm_config.parallel_config),
            model_config.get_head_size(),
            0.1,
        )
        runner = V1ModelRunner(vllm_config, DEVICE_TYPE)
        initialize_kv_cache(runner)

        so = _scheduler_output(new=[("a", 100, 0, 100)])
        so.scheduled_new_reqs[0] = replace(
            so.scheduled_new_reqs[0],
            sampling_params=SamplingParams(),
            block_ids=(list(range(7)),),
        )
        so = runner.apply_kv_connector_external_hits(so)
        runner._update_states(so)

    assert runner.requests["a"].num_computed_tokens == 40
    idx = runner.input_batch.req_id_to_index["a"]
    assert runner.input_batch.num_computed_tokens_cpu[idx] == 40
    assert so.num_scheduled_tokens == {"a": 60}
    assert runner._worker_external_hits.applied == {"a": 40}
    assert connector.applied_calls == [{"a": 40}]


def _cpu_apply_write(self: StagedWriteTensor) -> None:
    """StagedWriteTensor.apply_write() without its Triton kernel: it takes
    the same staging buffers, then writes with tensor ops."""
    if not self._staged_write_indices:
        return
    self.write_indices.copy_to_uva(self._staged_write_indices)
    self.write_starts.copy_to_uva(self._staged_write_starts)
    self.write_cu_lens.copy_to_uva(self._staged_write_cu_lens)
    start = 0
    for index, row_start, end in zip(
        self._staged_write_indices,
        self._staged_write_starts,
        self._staged_write_cu_lens,
    ):
        values = torch.tensor(self._staged_write_contents[start:end])
        row = self.gpu[index] if self.gpu.dim() > 1 else self.gpu
        offset = row_start if self.gpu.dim() > 1 else index
        row[offset : offset + end - start] = values
        start = end
    self.clear_staged_writes()


@pytest.fixture
def req_states(monkeypatch: pytest.MonkeyPatch) -> RequestState:
    # Plain CPU tensors: no pinned memory without an accelerator.
    monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)
    monkeypatch.setattr(StagedWriteTensor, "apply_write", _cpu_apply_write)
    return RequestState(
        max_num_reqs=4,
        max_model_len=256,
        max_num_batched_tokens=256,
        num_speculative_steps=0,
        vocab_size=128,
        device=torch.device("cpu"),
    )


def _active_kv_connector(
    monkeypatch: pytest.MonkeyPatch, connector: Any
) -> v2_kv_connector.ActiveKVConnector:
    monkeypatch.setattr(v2_kv_connector, "get_kv_transfer_group", lambda: connector)
    return v2_kv_connector.ActiveKVConnector(connector._vllm_config, {})


def test_v2_hit_on_running_request_reaches_gpu_num_computed_tokens(
    monkeypatch: pytest.MonkeyPatch, req_states: RequestState
):
    """The second chunk of a chunked prefill takes a hit: the GPU copy of
    num_computed_tokens, from which V2 computes positions and slot mappings,
    must move with the CPU mirror."""
    _single_rank(monkeypatch)
    req_states.add_request(
        req_id="c",
        prompt_len=100,
        all_token_ids=list(range(100)),
        num_computed_tokens=0,
        max_tokens=16,
    )
    req_states.apply_staged_writes()
    idx = req_states.req_id_to_index["c"]
    # The first chunk of 64 tokens ran: V2 advanced both copies.
    req_states.num_computed_tokens.gpu[idx] = 64
    req_states.num_computed_tokens_np[idx] = 64

    connector = _make_connector("HitsConnector", hits={"c": 20})
    kv = _active_kv_connector(monkeypatch, connector)
    so = _scheduler_output(cached=[("c", 64, 0, 36)])
    so.kv_connector_metadata = SimpleNamespace()
    new_so = kv.before_update_states(so, req_states)
    runner: Any = SimpleNamespace(req_states=req_states, block_tables=MagicMock())
    V2ModelRunner.update_requests(runner, new_so)

    assert kv._external_hits.applied == {"c": 20}
    assert req_states.num_computed_tokens_np[idx] == 84
    assert int(req_states.num_computed_tokens.gpu[idx]) == 84


def test_v2_new_request_hit_reaches_gpu_num_computed_tokens(
    monkeypatch: pytest.MonkeyPatch, req_states: RequestState
):
    _single_rank(monkeypatch)
    connector = _make_connector("HitsConnector", hits={"a": 30})
    kv = _active_kv_connector(monkeypatch, connector)
    so = _scheduler_output(new=[("a", 100, 0, 64)])
    so.kv_connector_metadata = SimpleNamespace()
    new_req = kv.before_update_states(so, req_states).scheduled_new_reqs[0]
    req_states.add_request(
        req_id="a",
        prompt_len=100,
        all_token_ids=list(range(100)),
        num_computed_tokens=new_req.num_computed_tokens,
        max_tokens=16,
    )
    req_states.apply_staged_writes()
    idx = req_states.req_id_to_index["a"]
    assert int(req_states.num_computed_tokens.gpu[idx]) == 30


def test_v2_hook_order_matches_v1(monkeypatch: pytest.MonkeyPatch, req_states):
    """handle_preemptions(), then the hook, then bind_connector_metadata(),
    each once per step, as in the V1 runner."""
    _single_rank(monkeypatch)
    connector = _make_connector("HitsConnector", hits={})
    calls: list[str] = []
    connector.handle_preemptions = lambda meta: calls.append("handle_preemptions")
    connector.bind_connector_metadata = lambda meta: calls.append("bind")

    def before_update_states(self: Any, so: SchedulerOutput) -> dict[str, int]:
        calls.append("before_update_states")
        return {"a": 200, "b": 5}

    monkeypatch.setattr(HitsConnector, "before_update_states", before_update_states)
    connector.on_external_hits_applied = lambda applied: calls.append(applied)
    connector.start_load_kv = lambda *args, **kwargs: calls.append("start_load_kv")
    kv = _active_kv_connector(monkeypatch, connector)
    # "a" is clamped to its last prompt token; "b" is a decode.
    so = _scheduler_output(new=[("a", 100, 0, 100)], cached=[("b", 100, 1, 1)])
    so.kv_connector_metadata = SimpleNamespace()
    for _ in range(2):
        kv.pre_forward(kv.before_update_states(so, req_states))
    step = ["handle_preemptions", "before_update_states", {"a": 99}, "bind"]
    assert calls == [*step, "start_load_kv"] * 2


def test_v2_runner_applies_hits_before_update_states():
    """V2's execute_model() hands the hits-applied output, and its request
    states, to every state update."""
    applied = _scheduler_output(new=[("a", 100, 40, 60)])
    seen: list[SchedulerOutput] = []

    def finish_requests(so: SchedulerOutput) -> None:
        seen.append(so)
        raise _StateUpdateReached

    runner = MagicMock(finish_requests=finish_requests)
    runner.kv_connector.before_update_states.return_value = applied
    so = _scheduler_output(new=[("a", 100, 0, 100)])

    with pytest.raises(_StateUpdateReached):
        V2ModelRunner.execute_model(runner, so)

    runner.kv_connector.before_update_states.assert_called_once_with(
        so, runner.req_states
    )
    assert seen == [applied]


def test_v2_runner_without_a_hits_connector_skips_the_hook(
    monkeypatch: pytest.MonkeyPatch,
):
    """Without a connector that reports hits (none, or one without
    before_update_states()), V2's step reads one boolean set when the
    connector was built and calls nothing."""
    _single_rank(monkeypatch)
    legacy = _active_kv_connector(monkeypatch, _make_connector("MockKVConnector"))
    assert not v2_kv_connector.KVConnector().applies_external_hits
    assert not legacy.applies_external_hits
    hits = _make_connector("HitsConnector", hits={})
    assert _active_kv_connector(monkeypatch, hits).applies_external_hits

    seen: list[SchedulerOutput] = []

    def finish_requests(so: SchedulerOutput) -> None:
        seen.append(so)
        raise _StateUpdateReached

    runner = MagicMock(finish_requests=finish_requests)
    runner.kv_connector = MagicMock(
        spec=v2_kv_connector.KVConnector, applies_external_hits=False
    )
    so = _scheduler_output(new=[("a", 100, 0, 100)])

    with pytest.raises(_StateUpdateReached):
        V2ModelRunner.execute_model(runner, so)

    runner.kv_connector.before_update_states.assert_not_called()
    assert seen == [so]


class _InFlightPool:
    """Stands in for a UvaBufferPool: max_concurrency staging buffers taken
    round robin. With async scheduling that many steps are in flight at
    once, so a buffer taken in a step may be read by the GPU until
    max_concurrency - 1 later steps began; taking it again before that
    fails."""

    def __init__(self, clock: SimpleNamespace, max_concurrency: int = 2):
        self.clock = clock
        self.taken_in_step: list[int | None] = [None] * max_concurrency
        self.curr = 0
        # The step of every take, in order.
        self.takes: list[int] = []

    def copy_to_uva(self, x: Any) -> torch.Tensor:
        n = len(self.taken_in_step)
        self.curr = (self.curr + 1) % n
        taken = self.taken_in_step[self.curr]
        if taken is not None and self.clock.step - taken < n:
            raise AssertionError(
                f"staging buffer {self.curr}, taken in step {taken}, taken "
                f"again in step {self.clock.step} while still in flight"
            )
        self.taken_in_step[self.curr] = self.clock.step
        self.takes.append(self.clock.step)
        return torch.tensor(x)


def test_v2_writes_num_computed_tokens_once_per_step(
    monkeypatch: pytest.MonkeyPatch, req_states: RequestState
):
    """Hits on running requests are staged by the hook and written with
    add_requests()' own write, or by the hook when no request is added: one
    write of num_computed_tokens per step, so the staging buffers that
    max_concurrency (2 with async scheduling) sizes for the steps in flight
    are never taken while the previous step may still read them."""
    _single_rank(monkeypatch)
    clock = SimpleNamespace(step=0)
    num_computed = req_states.num_computed_tokens
    pools = {
        name: _InFlightPool(clock)
        for name in ("write_indices", "write_starts", "write_cu_lens")
    }
    for name, pool in pools.items():
        monkeypatch.setattr(num_computed, name, pool)
    connector = _make_connector("HitsConnector", hits={"a": 20, "b": 30})
    kv = _active_kv_connector(monkeypatch, connector)
    runner: Any = MagicMock(
        req_states=req_states,
        adaptive_verification=None,
        pooling_runner=None,
        encoder_cache=None,
        is_last_pp_rank=False,
        sampler=None,
    )

    def step(so: SchedulerOutput) -> None:
        clock.step += 1
        so.kv_connector_metadata = SimpleNamespace()
        for i, new_req in enumerate(so.scheduled_new_reqs):
            so.scheduled_new_reqs[i] = replace(
                new_req, prefill_token_ids=new_req.prompt_token_ids
            )
        so = kv.before_update_states(so, req_states)
        V2ModelRunner.add_requests(runner, so)
        V2ModelRunner.update_requests(runner, so)
        # The forward computes the scheduled tokens and advances both copies.
        for req_id, n in so.num_scheduled_tokens.items():
            idx = req_states.req_id_to_index[req_id]
            req_states.num_computed_tokens.gpu[idx] += n
            req_states.num_computed_tokens_np[idx] += n

    def gpu_num_computed(req_id: str) -> int:
        return int(num_computed.gpu[req_states.req_id_to_index[req_id]])

    # Step 1: "a" is added with a hit of 20 and computes 44 of its 64.
    step(_scheduler_output(new=[("a", 100, 0, 64)]))
    assert gpu_num_computed("a") == 64
    # Step 2: "a" continues with a hit while "b" is added with one.
    step(_scheduler_output(new=[("b", 100, 0, 64)], cached=[("a", 64, 0, 36)]))
    assert gpu_num_computed("a") == 100
    assert gpu_num_computed("b") == 64
    # Step 3: "b" continues with a hit; no request is added.
    step(_scheduler_output(cached=[("b", 64, 0, 36), ("a", 100, 1, 1)]))
    assert gpu_num_computed("b") == 100
    assert pools["write_indices"].takes == [1, 2, 3]

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for the rank agreement of KVConnectorBase_V1.before_update_states()
on two real processes in a gloo group: the minimum is applied and given to
the connector on every rank, and a failing rank fails the step on every rank
without leaving one in the collective."""

import datetime
import multiprocessing
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from tests.v1.kv_connector.unit.test_before_update_states import (
    _make_connector,
    _scheduler_output,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import external_hits
from vllm.utils.network_utils import get_open_port
from vllm.v1.core.sched.output import SchedulerOutput

# Each mode is one step both ranks take in turn in the same gloo group, so a
# step after a failing one also shows that no rank was left in the collective.
MODES = ("ok", "raises", "bad_value")


def _hits(rank: int, mode: str) -> Any:
    # Rank 0 has hits for both requests, rank 1 only a smaller one for b.
    if rank == 0:
        return {"a": 9, "b": 50}
    if mode == "raises":
        return RuntimeError("cache unreachable")
    if mode == "bad_value":
        return {"b": -1}
    return {"b": 20}


def _min_worker(rank: int, port: int, ready: Any, results: Any) -> None:
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
        for mode in MODES:
            hits = _hits(rank, mode)
            connector = _make_connector("HitsConnector", hits={})

            def before_update_states(so: SchedulerOutput, hits: Any = hits) -> Any:
                if isinstance(hits, Exception):
                    raise hits
                return hits

            connector.before_update_states = before_update_states
            so = _scheduler_output(new=[("a", 10, 0, 10), ("b", 100, 0, 64)])
            try:
                worker = external_hits.WorkerExternalHits(connector)
                worker.apply(so)
                results.put((mode, rank, (worker.applied, connector.applied_calls)))
            except RuntimeError as e:
                results.put((mode, rank, str(e)))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def steps() -> dict[str, dict[int, Any]]:
    """Run _min_worker on two gloo ranks, one step per mode; a rank still
    running 120 s after both started fails the tests instead of hanging
    them. One pair of processes serves every test of the module, forked
    from this one, which imported vLLM already: a spawned rank imports it
    again (15 s of a core each on a CI runner)."""
    ctx = multiprocessing.get_context("fork")
    ready, results = ctx.Queue(), ctx.Queue()
    port = get_open_port()
    procs = [
        ctx.Process(target=_min_worker, args=(r, port, ready, results)) for r in (0, 1)
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
    by_mode: dict[str, dict[int, Any]] = {mode: {} for mode in MODES}
    for _ in range(len(MODES) * len(procs)):
        mode, rank, result = results.get(timeout=5)
        by_mode[mode][rank] = result
    return by_mode


def test_ranks_apply_the_minimum(steps: dict[str, dict[int, Any]]):
    """Rank 0 holds a and b, rank 1 only part of b: both apply, and tell
    their connector to load, only the 20 tokens of b they agree on."""
    agreed = ({"b": 20}, [{"b": 20}])
    assert steps["ok"] == {0: agreed, 1: agreed}


@pytest.mark.parametrize("mode", ["raises", "bad_value"])
def test_failing_rank_fails_the_step_on_every_rank(
    steps: dict[str, dict[int, Any]], mode: str
):
    results = steps[mode]
    message = "HitsConnector.before_update_states() failed on rank 1"
    assert message in results[0]
    assert results[0] == results[1]

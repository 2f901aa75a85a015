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

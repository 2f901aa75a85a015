"""Asynchronous loads (``load_async``): a hit loads while other requests run.

With ``load_async`` the scheduler side answers a hit as vLLM's asynchronous
KV load (``load_kv_async``): vLLM allocates the request's blocks, keeps the
request out of the batch (``WAITING_FOR_REMOTE_KVS``) and schedules it once
every worker reported its load finished (``get_finished``). Each worker
hands such loads to one thread here, in the order they were scheduled, and
the engine goes on running steps for the other requests meanwhile. A burst
of hits then no longer shares one step that loads them all: the first
request's first token waits for its own load only, and every later request
for the loads before its own.

A load reads into the request's own blocks, which vLLM neither schedules
nor frees until the load is reported: a request aborted while it loads keeps
its blocks until then, so the thread stops at the next batch and reports it
(its errors are dropped: nothing uses the blocks). The blocks that failed
their checks are reported through ``get_block_ids_with_load_errors`` in the
step whose ``get_finished`` reports the request, as vLLM's contract asks.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from kvlc_store.core import logger
from kvlc_store.metadata import LoadSpec

# (spec, the prefetch buffer's directory) -> the blocks that failed.
LoadFn = Callable[[LoadSpec, str | None, Callable[[], bool]], set[int]]


class AsyncLoads:
    """One worker's asynchronous loads, run one after another on a thread.

    Called from the worker's step (``submit``, ``cancel``, ``take``) while the
    thread loads; ``load`` must release the load's lease whatever happens.
    """

    def __init__(self, load: LoadFn, device: torch.device) -> None:
        self._load = load
        self._device = device
        self._queue: queue.Queue[tuple[LoadSpec, str | None] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._running: set[str] = set()  # submitted, not yet taken
        self._cancelled: set[str] = set()
        self._done: dict[str, set[int]] = {}  # request -> blocks that failed
        self._thread = threading.Thread(
            target=self._run, name="kvlc-async-load", daemon=True
        )
        self._thread.start()

    def submit(self, spec: LoadSpec, buffer_dir: str | None) -> None:
        with self._lock:
            self._running.add(spec.req_id)
        self._queue.put((spec, buffer_dir))

    def cancel(self, req_ids: set[str]) -> None:
        """Requests that finished: their loads stop at the next batch."""
        with self._lock:
            self._cancelled |= req_ids & self._running

    def take(self) -> tuple[set[str], set[int]]:
        """Requests whose load is over since the last call, and the blocks
        that failed among those not cancelled."""
        with self._lock:
            done, self._done = self._done, {}
            self._running -= done.keys()
            failed = {
                block_id
                for req_id, blocks in done.items()
                if req_id not in self._cancelled
                for block_id in blocks
            }
            self._cancelled -= done.keys()
        return set(done), failed

    def close(self, timeout_s: float = 30) -> None:
        with self._lock:
            self._cancelled |= self._running
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        if self._device.type == "cuda":
            # A new thread's current device is 0: on every other TP rank its
            # copies would create a context on GPU 0, outside vLLM's budget.
            torch.cuda.set_device(self._device)
        while (item := self._queue.get()) is not None:
            spec, buffer_dir = item
            failed = self._run_one(spec, buffer_dir)
            with self._lock:
                self._done[spec.req_id] = failed

    def _run_one(self, spec: LoadSpec, buffer_dir: str | None) -> set[int]:
        def cancelled() -> bool:
            with self._lock:
                return spec.req_id in self._cancelled

        try:
            return self._load(spec, buffer_dir, cancelled)
        except Exception:
            # Reported as failed, so vLLM recomputes instead of waiting for a
            # load that never ends.
            logger.exception("StoreConnector: asynchronous load of %s", spec.req_id)
            return set(spec.block_ids)

"""Saves of a KV cache on an accelerator, off the forward's path.

``wait_for_save`` only records an event after the step's forward and hands
the step's saves to a thread here. The thread copies the blocks in batches
into host memory (on the side stream, after that event), two batches in
flight, and writes each chunk (digest, header, backend put) once its batch
is on the host, so the next batch's copy overlaps the writes of the one
before. The blocks go into slots of the host tier (``host_tier.py``), which
keeps each chunk for later loads whatever the store does with its write; a
layout that pointer copies cannot move goes through the host pool instead
(``DeviceTransfer.gather``), batches of at most a quarter of it. A chunk
stays in the tier only once the store holds it: during a store outage the
tier keeps the chunks the scheduler can still offer, instead of filling up
with ones it never will.

The blocks must keep their KV until gathered. Prompt blocks are not written
again while their request runs; when it finishes, vLLM keeps its blocks
until every worker reports the request through ``get_finished``
(``request_finished`` returned ``delay_free_blocks=True``), which
``finished`` allows once its saves are written; when it is preempted, its
blocks are freed at once, so ``handle_preemptions`` waits for its saves
(``wait``) before the step that may reuse them. Lazy offload's blocks are
pinned by the scheduler until reported saved (``take_saved``).

A store failure drops the save (counted and logged by ``write``), never the
request; after one, the rest of that step's saves are skipped, as on the
host path.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from kvlc_store.core import logger
from kvlc_store.device_transfer import DeviceTransfer, Region
from kvlc_store.host_tier import HostTier
from kvlc_store.metadata import SaveSpec
from kvlc_store.offload import SavedBlocks

# (key, payload parts) -> False if the store failed.
WriteFn = Callable[[str, Sequence[memoryview]], bool]


@dataclass
class _Job:
    saves: list[SaveSpec]
    keys: list[str]
    ready: torch.cuda.Event | None


class AsyncSaves:
    """One worker's saves, gathered and written on a thread, in step order.

    Called from the worker's step (``submit``, ``busy``, ``wait``,
    ``take_saved``) while the thread writes.
    """

    def __init__(
        self,
        transfer: DeviceTransfer,
        write: WriteFn,
        tier: HostTier | None = None,
        after_job: Callable[[], None] = lambda: None,
    ) -> None:
        self._transfer = transfer
        self._write = write
        self._tier = tier
        # Called on the thread after each job's writes.
        self._after_job = after_job
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._cond = threading.Condition()
        self._pending: collections.Counter[str] = collections.Counter()
        self._saved = SavedBlocks()
        self._thread = threading.Thread(
            target=self._run, name="kvlc-async-save", daemon=True
        )
        self._thread.start()

    def submit(
        self,
        saves: list[SaveSpec],
        keys: list[str],
        ready: torch.cuda.Event | None,
    ) -> None:
        """Save ``saves`` under ``keys`` once ``ready`` (the event after the
        forward that computed them) has passed."""
        with self._cond:
            self._pending.update(s.req_id for s in saves if s.req_id is not None)
        self._queue.put(_Job(saves, keys, ready))

    def busy(self, req_ids: set[str]) -> set[str]:
        """Those of ``req_ids`` with saves not yet written (or dropped)."""
        with self._cond:
            return {r for r in req_ids if self._pending[r]}

    def wait(self, req_ids: set[str]) -> None:
        """Block until no save of ``req_ids`` is left."""
        with self._cond:
            self._cond.wait_for(lambda: not any(self._pending[r] for r in req_ids))

    def take_saved(self) -> SavedBlocks:
        """Lazy offload's pinned blocks saved (or failed) since the last call."""
        with self._cond:
            saved, self._saved = self._saved, SavedBlocks()
        return saved

    def close(self, timeout_s: float = 30) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _finish(self, save: SaveSpec, ok: bool) -> None:
        with self._cond:
            if save.req_id is not None:
                self._pending[save.req_id] -= 1
                if not self._pending[save.req_id]:
                    del self._pending[save.req_id]
            if save.pinned:
                self._saved.done.add(save.block_id)
                if not ok:
                    self._saved.failed.add(save.block_id)
            self._cond.notify_all()

    def _run(self) -> None:
        if self._transfer.device.type == "cuda":
            torch.cuda.set_device(self._transfer.device)
        while (job := self._queue.get()) is not None:
            finished = 0
            try:
                for ok in self._save(job):
                    self._finish(job.saves[finished], ok)
                    finished += 1
            except Exception:
                # Dropped, never left pending: a request waiting for its
                # saves would keep its blocks forever.
                logger.exception("StoreConnector: asynchronous save failed")
                for save in job.saves[finished:]:
                    self._finish(save, False)
            self._after_job()

    def _save(self, job: _Job) -> Iterator[bool]:
        """Copy and write ``job``'s saves; yield each one's outcome in
        order."""
        if self._tier is not None:
            yield from self._save_through_tier(job, self._tier)
            return
        transfer, pool = self._transfer, self._transfer.pool
        in_flight: collections.deque[
            tuple[Region, list[str], torch.cuda.Event | None]
        ] = collections.deque()
        store_up = True
        i = 0
        try:
            while i < len(job.saves) or in_flight:
                region = None
                if i < len(job.saves) and len(in_flight) < 2:
                    # Two runs of a quarter of the pool at most: the other
                    # half stays for loads, which the next forward waits for.
                    want = min(len(job.saves) - i, max(1, pool.max_run // 2))
                    # Wait for the pool only while holding none of it.
                    region = pool.try_take(want) if in_flight else pool.take(want)
                if region is not None:
                    batch = job.saves[i : i + region.count]
                    event = transfer.gather(
                        [s.block_id for s in batch], region, job.ready
                    )
                    in_flight.append((region, job.keys[i : i + region.count], event))
                    i += region.count
                    continue
                region, keys, event = in_flight.popleft()
                try:
                    transfer.wait(event)
                    for j, key in enumerate(keys):
                        store_up = store_up and self._write(
                            key, transfer.chunk_parts(region, j)
                        )
                        yield store_up
                finally:
                    pool.give(region)
        finally:
            for region, _, event in in_flight:
                transfer.wait(event)
                pool.give(region)

    def _save_through_tier(self, job: _Job, tier: HostTier) -> Iterator[bool]:
        """``_save`` into the host tier's slots: each chunk is written to
        the store from its slot and kept there once the store holds it; a
        chunk whose write failed or was skipped leaves its slot free."""
        transfer = self._transfer
        in_flight: collections.deque[
            tuple[list[int], list[str], torch.cuda.Event | None]
        ] = collections.deque()
        store_up = True
        i = 0
        try:
            while i < len(job.saves) or in_flight:
                slots: list[int] = []
                if i < len(job.saves) and len(in_flight) < 2:
                    # Wait for a slot only while holding none.
                    slots = tier.reserve(len(job.saves) - i, wait=not in_flight)
                if slots:
                    batch = job.saves[i : i + len(slots)]
                    event = transfer.save_to(
                        [s.block_id for s in batch],
                        [tier.addr(slot) for slot in slots],
                        job.ready,
                    )
                    in_flight.append((slots, job.keys[i : i + len(slots)], event))
                    i += len(slots)
                    continue
                slots, keys, event = in_flight.popleft()
                try:
                    transfer.wait(event)
                    for slot, key in zip(slots, keys, strict=True):
                        store_up = store_up and self._write(key, [tier.view(slot)])
                        if store_up:
                            tier.publish(key, slot)
                        yield store_up
                finally:
                    tier.unpin(slots)
        finally:
            for slots, _, event in in_flight:
                transfer.wait(event)
                tier.unpin(slots)

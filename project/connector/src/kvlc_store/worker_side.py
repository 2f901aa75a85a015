"""The connector's worker side: loads, worker lookups and saves.

A load reads each planned chunk once, straight into its KV-cache block (a
host KV cache; a cache on an accelerator through pinned host memory, in
batches: ``device_transfer.py``), and checks it there: header, length and
the payload's digest, and that a worker of this KV layout wrote it (see
``chunk.py``). A chunk that fails is deleted and its block reported
through ``get_block_ids_with_load_errors``, so vLLM recomputes it
(``kv_load_failure_policy: recompute``) instead of using it. A save writes
the block's bytes straight from the KV cache after the chunk's header (on an
accelerator: gathered in batches and written by a thread, ``async_save.py``).

Blocks the scheduler side prefetched are read from its buffer
(``prefetch.py``) the same way; a chunk missing or damaged there is read
from the store instead.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import cast

import torch

from kvlc_store.async_load import AsyncLoads
from kvlc_store.async_save import AsyncSaves
from kvlc_store.backends import (
    Backend,
    BackendUnavailable,
    DirectoryBackend,
    Head,
    new_lease_id,
)
from kvlc_store.chunk import (
    HEADER_BYTES,
    ChunkError,
    check_header,
    check_payload,
    checksum,
    encode_header,
)
from kvlc_store.core import StoreCore, logger
from kvlc_store.device_transfer import DeviceTransfer, Region
from kvlc_store.host_tier import HostTier
from kvlc_store.metadata import LoadSpec, SaveSpec, StoreMetadata
from kvlc_store.offload import SavedBlocks
from kvlc_store.prefetch import BufferReader
from kvlc_store.transfer import BlockLayout

# Threads that read a batch of chunks from the directory store: file reads
# release the GIL and scale with threads (page cache on an H100 host: 5.2
# GB/s on one, 18.5 on four, 24.9-27.8 on eight), and each thread digests
# its own chunks, so the digests overlap the other threads' reads.
READ_THREADS = 8

# One chunk's read and checks: its head and the error it failed with.
_Checked = tuple[Head | None, ChunkError | None]
# What ``_read`` yields per batch: block ids, keys, and each block's outcome
# (True loaded, False damaged, None not stored).
_Batch = tuple[Sequence[int], Sequence[str], Sequence[bool | None]]


@dataclass
class WorkerLoad:
    """Blocks a worker found and loaded itself (``before_update_states``),
    whose lease ends after the step's loads."""

    lease_id: str
    keys: list[str]
    num_blocks: int


class WorkerSide:
    """Worker-side state of one connector (one TP rank)."""

    def __init__(self, core: StoreCore, block_size: int) -> None:
        self._core = core
        self._block_size = block_size
        self._layout: BlockLayout | None = None
        self.rank = 0
        self._load_errors: set[int] = set()
        self._worker_loads: list[WorkerLoad] = []
        self._async: AsyncLoads | None = None
        self.saved = SavedBlocks()
        # A KV cache off the host: batched transfers, saves on a thread.
        self._device: DeviceTransfer | None = None
        self._tier: HostTier | None = None
        self._async_saves: AsyncSaves | None = None
        self._readers: ThreadPoolExecutor | None = None
        # Requests whose blocks vLLM keeps until reported (SaveSpec.req_id),
        # and those of them that finished.
        self._sending: set[str] = set()
        self._finishing: set[str] = set()
        self._warned_unordered = False

    def register(
        self, kv_caches: dict[str, torch.Tensor], num_blocks: int, rank: int
    ) -> None:
        self.rank = rank
        self._layout = BlockLayout(kv_caches, num_blocks)
        if not self._layout.on_host:
            self.start_batched_transfers()

    def start_batched_transfers(self) -> None:
        """Move blocks in batches through host memory, and save on a thread:
        ``register`` calls it for a KV cache off the host; tests call it for
        a host one, to run the same path on CPU tensors.

        Blocks move through the host tier's slots (``host_tier.py``), or,
        for a layout that pointer copies cannot move, through the pool of
        ``pinned_buffer`` in staged batches."""
        layout, config = self.layout, self._core.config
        self._device = device = DeviceTransfer(layout, config.pinned_buffer_bytes)
        pinned = "pinned" if layout.device.type == "cuda" else "pageable"
        if device.batched_copies:
            self._tier = HostTier(
                config.host_tier_bytes or config.pinned_buffer_bytes,
                device.block_bytes,
                pin=layout.device.type == "cuda",
                cache=config.host_tier_bytes > 0,
            )
            how = (
                f"a host tier of {self._tier.nbytes / 2**30:.2f} GiB of {pinned} "
                f"memory ({self._tier.capacity} chunks of "
                f"{device.block_bytes / 2**20:.2f} MiB; host_tier)"
                if self._tier.cache
                else f"{self._tier.nbytes / 2**20:.1f} MiB of {pinned} memory "
                "(pinned_buffer; host_tier 0: no chunk kept)"
            )
        else:
            how = (
                f"{device.pool.nbytes / 2**20:.1f} MiB of {pinned} memory "
                "(pinned_buffer), staged: this KV layout has too many runs per "
                "block for pointer copies, so no host tier"
            )
            if layout.device.type != "cpu":
                # Staging buffers are the size of the pool's regions, and the
                # caching allocator keeps its peak; nothing sizes it for vLLM.
                how += (
                    f"; the staging takes up to {device.pool.nbytes / 2**20:.1f} "
                    f"MiB of {layout.device.type} memory, which PyTorch keeps "
                    "cached outside --gpu-memory-utilization"
                )
        self._async_saves = AsyncSaves(device, self._write_chunk, self._tier)
        self._readers = ThreadPoolExecutor(READ_THREADS, "kvlc-read")
        logger.info(
            "StoreConnector: KV cache on %s: batched transfers through %s, "
            "saves on a thread",
            layout.device,
            how,
        )

    @property
    def layout(self) -> BlockLayout:
        assert self._layout is not None, "register_kv_caches was not called"
        return self._layout

    # -- loads ------------------------------------------------------------

    def _read(
        self,
        block_ids: Sequence[int],
        keys: Sequence[str],
        buffer: BufferReader | None = None,
        probe: bool = False,
    ) -> Iterator[_Batch]:
        """Read ``keys`` into ``block_ids`` in order and check each; yield
        them in batches (``_Batch``: a hit of 2,048 blocks is a few batches,
        not 2,048 steps of three generators). Stops early if the store
        fails. From ``buffer`` instead of the store if given: a damaged
        chunk there is None (the store's copy may be fine), and nothing is
        deleted. ``probe``: a worker-side lookup, where a damaged chunk is a
        miss, not a load error."""
        core, layout = self._core, self.layout
        source: Backend | BufferReader = core.backend if buffer is None else buffer
        if self._tier is not None:
            yield from self._read_tier(block_ids, keys, source, buffer, probe)
            return
        if self._device is not None:
            yield from self._read_batched(block_ids, keys, source, buffer, probe)
            return
        targets = [layout.segments(b) for b in block_ids]
        reads = source.read_into(keys, HEADER_BYTES, targets)
        try:
            for i, head in enumerate(_guarded(reads, core)):
                ok = self._check(head, keys[i], targets[i], buffer, probe)
                yield [block_ids[i]], [keys[i]], [ok]
        finally:
            reads.close()

    def _check(
        self,
        head: Head | None,
        key: str,
        into: Sequence[memoryview],
        buffer: BufferReader | None,
        probe: bool,
    ) -> bool | None:
        """The outcome of chunk ``key``, read into its block ``into`` of a
        host KV cache (``_read``'s host path), checked there."""
        core = self._core
        if head is None:
            return None
        try:
            header = check_header(
                head[0], core.identity, key, head[1], self.layout.digest
            )
            check_payload(header, into)
        except ChunkError as e:
            if buffer is not None:
                return None
            core.bad_chunk(key, e, at_load=not probe)
            return False
        self._count_loaded(head, buffer)
        return True

    def _count_loaded(self, head: Head, buffer: BufferReader | None) -> None:
        self._core.stats.inc("loaded_bytes", head[1])
        if self.rank == 0:
            self._core.stats.inc("store_loaded_tokens", self._block_size)
        if buffer is not None:
            self._core.stats.inc("prefetch_loaded_bytes", head[1])

    def _read_batched(
        self,
        block_ids: Sequence[int],
        keys: Sequence[str],
        source: Backend | BufferReader,
        buffer: BufferReader | None,
        probe: bool,
    ) -> Iterator[_Batch]:
        """``_read`` for a KV cache off the host: batches of chunks read into
        the host pool and checked there, then copied into their blocks
        (``DeviceTransfer.scatter``); the next batch is read while one is
        copied. Every copy has finished when this generator ends or is
        closed, so the blocks hold the KV before any forward reads them."""
        core, transfer = self._core, self._device
        assert transfer is not None
        pool = transfer.pool
        held: list[tuple[Region, torch.cuda.Event | None]] = []
        i = 0
        try:
            while i < len(block_ids):
                want = len(block_ids) - i
                # Wait for the pool only while holding none of it.
                region = pool.try_take(want) if held else pool.take(want)
                if region is None:
                    self._give_back(held.pop(0))
                    continue
                held.append((region, None))
                n = region.count
                batch_ids, batch_keys = block_ids[i : i + n], keys[i : i + n]
                checked, store_error = self._read_region(batch_keys, source, region)
                outcomes: list[bool | None] = []
                for key, (head, error) in zip(batch_keys, checked, strict=False):
                    if head is None or (error is not None and buffer is not None):
                        outcomes.append(None)
                    elif error is not None:
                        core.bad_chunk(key, error, at_load=not probe)
                        outcomes.append(False)
                    else:
                        self._count_loaded(head, buffer)
                        outcomes.append(True)
                rows = [j for j, ok in enumerate(outcomes) if ok]
                held[-1] = (
                    region,
                    transfer.scatter([batch_ids[j] for j in rows], rows, region),
                )
                if len(held) > 1:
                    self._give_back(held.pop(0))
                yield batch_ids, batch_keys, outcomes
                if store_error is not None:
                    core.unavailable(store_error)
                    return
                i += n
        finally:
            for item in held:
                self._give_back(item)

    def _read_tier(
        self,
        block_ids: Sequence[int],
        keys: Sequence[str],
        source: Backend | BufferReader,
        buffer: BufferReader | None,
        probe: bool,
    ) -> Iterator[_Batch]:
        """``_read`` through the host tier: a chunk the tier holds is copied
        from its slot; the others are read into free slots, checked there,
        copied, and kept in the tier. In batches of at most a quarter of the
        tier; the next batch is read while one is copied. Every copy has
        finished when this generator ends or is closed."""
        core, transfer, tier = self._core, self._device, self._tier
        assert transfer is not None and tier is not None
        held: list[tuple[list[int], torch.cuda.Event | None]] = []
        i = 0
        try:
            while i < len(block_ids):
                batch_ids = list(block_ids[i : i + tier.max_batch])
                batch_keys = list(keys[i : i + tier.max_batch])
                slots = tier.pin_cached(batch_keys)
                misses = (
                    [j for j, slot in enumerate(slots) if slot is None]
                    if None in slots
                    else []
                )
                fresh = tier.reserve(len(misses), wait=not held) if misses else []
                if len(fresh) < len(misses):
                    # Cut before the first chunk without a slot; with none
                    # to read into, copy out a batch held to free its slots.
                    cut = misses[len(fresh)]
                    tier.unpin([s for s in slots[cut:] if s is not None])
                    if cut == 0:
                        self._give_back_slots(held.pop(0))
                        continue
                    batch_ids, batch_keys = batch_ids[:cut], batch_keys[:cut]
                    slots, misses = slots[:cut], misses[: len(fresh)]
                fresh_of = dict(zip(misses, fresh, strict=True))
                # No misses: every slot was found (none is None).
                batch_slots = (
                    [
                        fresh_of[j] if slot is None else slot
                        for j, slot in enumerate(slots)
                    ]
                    if misses
                    else cast(list[int], slots)
                )
                # Held before anything can raise (a read, a check, a copy):
                # the ``finally`` unpins every slot this load pinned.
                held.append((batch_slots, None))
                checked, store_error = self._read_into(
                    [batch_keys[j] for j in misses],
                    source,
                    [[tier.view(slot)] for slot in fresh],
                )
                outcomes: list[bool | None] = [True] * len(batch_keys)
                for j, (head, error) in zip(misses, checked, strict=False):
                    if head is None or (error is not None and buffer is not None):
                        outcomes[j] = None
                    elif error is not None:
                        core.bad_chunk(batch_keys[j], error, at_load=not probe)
                        outcomes[j] = False
                    else:
                        self._count_loaded(head, buffer)
                        tier.publish(batch_keys[j], fresh_of[j])
                # A failed store ends the read at the first chunk it failed.
                end = len(batch_keys)
                if len(checked) < len(misses):
                    end = misses[len(checked)]
                hits = end - sum(1 for j in misses if j < end)
                core.stats.inc("host_tier_loaded_bytes", hits * tier.block_bytes)
                if self.rank == 0:
                    core.stats.inc("host_tier_loaded_tokens", hits * self._block_size)
                core.stats.inc("loaded_bytes", hits * (HEADER_BYTES + tier.block_bytes))
                if end == len(batch_keys) and all(outcomes):
                    ids, rows_slots = batch_ids, batch_slots
                else:
                    rows = [j for j in range(end) if outcomes[j]]
                    ids = [batch_ids[j] for j in rows]
                    rows_slots = [batch_slots[j] for j in rows]
                held[-1] = (
                    batch_slots,
                    transfer.load_from(ids, tier.addrs(rows_slots)),
                )
                if len(held) > 1:
                    self._give_back_slots(held.pop(0))
                yield batch_ids[:end], batch_keys[:end], outcomes[:end]
                if store_error is not None:
                    core.unavailable(store_error)
                    return
                i += len(batch_keys)
        finally:
            for item in held:
                self._give_back_slots(item)

    def _give_back_slots(self, item: tuple[list[int], torch.cuda.Event | None]) -> None:
        assert self._device is not None and self._tier is not None
        self._device.wait(item[1])
        self._tier.unpin(item[0])

    def _give_back(self, item: tuple[Region, torch.cuda.Event | None]) -> None:
        assert self._device is not None
        self._device.wait(item[1])
        self._device.pool.give(item[0])

    def _read_region(
        self, keys: Sequence[str], source: Backend | BufferReader, region: Region
    ) -> tuple[list[_Checked], BackendUnavailable | None]:
        """``_read_into`` the region's rows."""
        transfer = self._device
        assert transfer is not None
        targets = [transfer.chunk_parts(region, j) for j in range(len(keys))]
        return self._read_into(keys, source, targets)

    def _read_into(
        self,
        keys: Sequence[str],
        source: Backend | BufferReader,
        targets: Sequence[Sequence[memoryview]],
    ) -> tuple[list[_Checked], BackendUnavailable | None]:
        """Read ``keys`` into ``targets`` and check each (header, length,
        digest), in slices on the reading threads for the directory store;
        the results in key order, up to the store's failure if it failed."""
        readers = self._readers
        assert readers is not None
        if not keys:
            return [], None
        identity, layout = self._core.identity, self.layout.digest
        threads = READ_THREADS if isinstance(source, DirectoryBackend) else 1
        step = -(-len(keys) // threads)
        slices = [
            readers.submit(
                _read_checked,
                source,
                identity,
                layout,
                keys[k : k + step],
                targets[k : k + step],
            )
            for k in range(0, len(keys), step)
        ]
        checked: list[_Checked] = []
        for future in slices:
            part, error = future.result()
            checked += part
            if error is not None:
                # Later slices' results are dropped: a failed store ends the
                # read at the first block it failed.
                for rest in slices:
                    rest.result()
                return checked, error
        return checked, None

    def start_load(self, meta: StoreMetadata) -> None:
        if self._device is not None and meta.loads:
            # Loads write blocks the forwards queued so far may still use.
            self._device.mark_compute()
        for spec in meta.loads:
            if spec.load_async:
                if self._async is None:
                    self._async = AsyncLoads(self._load, self.layout.device)
                self._async.submit(spec, meta.buffer_dir)
            elif not meta.sync_loads_first:
                self._load_errors |= self._refuse_unordered(spec)
            else:
                self._load_errors |= self._load(spec, meta.buffer_dir)
        worker_loads, self._worker_loads = self._worker_loads, []
        for load in worker_loads:
            if self.rank == 0:
                self._core.stats.inc(
                    "worker_hit_tokens", load.num_blocks * self._block_size
                )
            self._core.release(load.lease_id, load.keys, count=False)

    def _refuse_unordered(self, spec: LoadSpec) -> set[int]:
        """A synchronous load in a step vLLM did not flag
        ``has_sync_kv_loads``: its runner starts loads after launching the
        forward, which would read the blocks before they are loaded. Their
        blocks fail instead (recomputed, or the request failed, by
        ``kv_load_failure_policy``), never read stale."""
        if not self._warned_unordered:
            self._warned_unordered = True
            logger.error(
                "StoreConnector: vLLM scheduled a synchronous KV load without "
                "has_sync_kv_loads, so it would start after the forward; its "
                "blocks are reported failed instead (a vLLM scheduler bug: "
                "please report it with the vLLM version)"
            )
        if spec.lease_id is not None:
            keys = [keys[self.rank] for keys in spec.keys]
            self._core.release(spec.lease_id, keys, count=False)
        return set(spec.block_ids)

    def _load(
        self,
        spec: LoadSpec,
        buffer_dir: str | None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> set[int]:
        """Load ``spec``'s blocks and release its lease; return the blocks
        that could not be loaded. Stops between two batches once
        ``cancelled()`` (the request finished while it loaded)."""
        core = self._core
        rank = self.rank
        keys = list(map(operator.itemgetter(rank), spec.keys))
        done: set[int] = set()
        block_ids: Sequence[int] = spec.block_ids
        from_store = keys
        try:
            if spec.num_buffered and buffer_dir is not None:
                n = spec.num_buffered
                buffer = BufferReader(buffer_dir)
                done = self._fill(block_ids[:n], keys[:n], cancelled, buffer)
                # What the buffer lacked is read from the store.
                lacked = [j for j in range(n) if block_ids[j] not in done]
                block_ids = [block_ids[j] for j in lacked] + list(block_ids[n:])
                from_store = [keys[j] for j in lacked] + keys[n:]
            if not cancelled():
                done |= self._fill(block_ids, from_store, cancelled)
        finally:
            if spec.lease_id is not None:
                core.release(spec.lease_id, keys, count=self.rank == 0)
        failed = set(spec.block_ids) - done
        if not cancelled():
            core.stats.inc("load_errors", len(failed))
        return failed

    def _fill(
        self,
        block_ids: Sequence[int],
        keys: Sequence[str],
        cancelled: Callable[[], bool],
        buffer: BufferReader | None = None,
    ) -> set[int]:
        """``_read`` until ``cancelled()``; the blocks loaded."""
        done: set[int] = set()
        for ids, _, outcomes in self._read(block_ids, keys, buffer):
            if all(outcomes):
                done.update(ids)
            else:
                done.update(b for b, ok in zip(ids, outcomes, strict=True) if ok)
            if cancelled():
                break
        return done

    def finished_loads(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose asynchronous load is over (loaded, failed or
        cancelled); the blocks that failed go to ``take_load_errors`` in the
        same step, as vLLM requires. ``finished_req_ids``: requests that
        finished since the last step, whose loads stop early."""
        if self._async is None:
            return set()
        self._async.cancel(finished_req_ids)
        done, failed = self._async.take()
        self._load_errors |= failed
        return done

    def before_update_states(self, meta: StoreMetadata) -> dict[str, int]:
        """Look up, load and check the probed blocks now; report the whole
        leading run of each as a hit. A hit reported here cannot be taken
        back (a failed load fails the request under vLLM's default
        ``kv_load_failure_policy``), so it counts only chunks already loaded
        and checked; blocks past the hit are computed by this step's forward,
        which overwrites whatever a damaged chunk left in them."""
        core = self._core
        hits: dict[str, int] = {}
        if self._device is not None:
            self._device.mark_compute()
        for probe in meta.probes:
            if not core.usable():
                break
            keys = [keys[self.rank] for keys in probe.keys]
            keys = keys[: core.usable_run(keys)]
            if not keys:
                continue
            lease_id = new_lease_id()
            try:
                n = core.backend.lease(keys, lease_id, core.config.lease_ttl_s)
            except BackendUnavailable as e:
                core.unavailable(e, op="lease write")
                continue
            if n:
                core.available()
            # Like the scheduler's lookup, reads on past a damaged chunk:
            # each one found is deleted now, so this request's save writes
            # it again.
            good = 0
            whole = True
            for _, _, outcomes in self._read(probe.block_ids[:n], keys[:n], probe=True):
                for ok in outcomes:
                    whole = whole and bool(ok)
                    good += whole
                if None in outcomes:
                    break
            if good < n:
                core.release(lease_id, keys[good:n], count=False)
            if good == 0:
                continue
            self._worker_loads.append(WorkerLoad(lease_id, keys[:good], good))
            hits[probe.req_id] = good * self._block_size
        return hits

    def close(self) -> None:
        if self._async is not None:
            self._async.close()
        if self._async_saves is not None:
            self._async_saves.close()
        if self._readers is not None:
            self._readers.shutdown()

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves ------------------------------------------------------------

    def save(self, meta: StoreMetadata) -> None:
        self._sending.update(s.req_id for s in meta.saves if s.req_id is not None)
        if self._async_saves is not None:
            if meta.saves:
                assert self._device is not None
                self._async_saves.submit(
                    list(meta.saves),
                    [s.keys[self.rank] for s in meta.saves],
                    self._device.mark_compute(),
                )
            return
        store_down = False
        for save in meta.saves:
            # After the store failed once, the step's other saves are skipped.
            store_down = store_down or not self._save_block(save)
            if save.pinned:
                self.saved.done.add(save.block_id)
                if store_down:
                    self.saved.failed.add(save.block_id)

    def _save_block(self, save: SaveSpec) -> bool:
        """Write one block of a host KV cache, straight from it; False if
        the store failed."""
        return self._write_chunk(
            save.keys[self.rank], self.layout.segments(save.block_id)
        )

    def _write_chunk(self, key: str, parts: Sequence[memoryview]) -> bool:
        """Store the chunk ``key`` of payload ``parts``; False if the store
        failed (unreachable, full, an I/O error) or is being backed off
        from: the save is skipped, the server goes on. Also the save
        thread's (``async_save.py``)."""
        core = self._core
        if not core.usable("write"):
            return False
        size = sum(p.nbytes for p in parts)
        header = encode_header(
            core.identity, key, size, checksum(parts), self.layout.digest
        )
        try:
            evicted = core.backend.put(key, [header, *parts])
        except BackendUnavailable as e:
            core.unavailable(e, "write")
            return False
        if evicted is not None:  # Written: a write that failed before works.
            core.available("write")
        core.stats.inc("stored_bytes", HEADER_BYTES + size)
        core.stats.inc("stored_chunks")
        core.evicted(evicted or 0)
        return True

    def handle_preemptions(self, meta: StoreMetadata) -> None:
        """Before the step's forward: the blocks of requests this step
        preempted are free again, so their saves in flight finish first."""
        if self._async_saves is not None and meta.preempted:
            self._async_saves.wait(meta.preempted)

    def finished_saves(self, finished_req_ids: set[str]) -> set[str]:
        """Requests that finished (now or before) whose blocks vLLM kept for
        their saves (``request_finished``), and whose saves are now written
        or dropped: vLLM may free their blocks."""
        self._finishing |= finished_req_ids & self._sending
        busy: set[str] = set()
        if self._async_saves is not None:
            busy = self._async_saves.busy(self._finishing)
        done = self._finishing - busy
        self._finishing -= done
        self._sending -= done
        return done

    def take_saved(self) -> SavedBlocks | None:
        if self._async_saves is not None:
            saved = self._async_saves.take_saved()
            return saved if saved.done else None
        if not self.saved.done:
            return None
        saved, self.saved = self.saved, SavedBlocks()
        return saved


def _read_checked(
    source: Backend | BufferReader,
    identity: str,
    layout: str,
    keys: Sequence[str],
    targets: Sequence[Sequence[memoryview]],
) -> tuple[list[_Checked], BackendUnavailable | None]:
    """Read ``keys`` into ``targets`` and check each chunk; the results, up
    to the store's failure if it failed (a reading thread's task)."""
    checked: list[_Checked] = []
    reads = source.read_into(keys, HEADER_BYTES, targets)
    try:
        for key, into in zip(keys, targets, strict=True):
            head = next(reads)
            if head is None:
                checked.append((None, None))
                continue
            try:
                header = check_header(head[0], identity, key, head[1], layout)
                check_payload(header, into)
            except ChunkError as e:
                checked.append((head, e))
                continue
            checked.append((head, None))
    except BackendUnavailable as e:
        return checked, e
    finally:
        reads.close()
    return checked, None


def _guarded(reads: Iterator[Head | None], core: StoreCore) -> Iterator[Head | None]:
    """``reads``, ending early (counted, logged) if the store fails."""
    try:
        yield from reads
    except BackendUnavailable as e:
        core.unavailable(e)

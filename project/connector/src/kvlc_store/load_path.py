"""A worker's load path: chunks from the store into their KV-cache blocks,
never a wrong byte used.

``LoadPath.read`` puts each chunk of a run into its block and says, per
block, whether the block now holds that chunk's KV (True), holds nothing
usable because the chunk is damaged (False: counted, and deleted where the
store can be written, so the request's save writes it again), or was not
read (None: not stored; or missing or damaged in the prefetch buffer, where
the store's copy may still be good). A chunk is trusted only after its
checks (header, length, the payload's digest, and that a worker of this KV
layout wrote it: ``chunk.py``), made where it landed, so it is read once
and never copied to be checked. A store that fails ends the run at the
failing chunk (counted, backed off from); the blocks before it stay loaded.
The counters say what loaded, from where (the store, the prefetch buffer,
the host tier), and nothing past a failure.

Three ways in, by where the KV cache lives: a host KV cache is read
straight into its blocks; one on an accelerator goes through host memory in
batches (``device_transfer.py``), the next batch read while one is copied,
through the host tier's slots (``host_tier.py``: a chunk it holds costs one
copy and no store read) or, for a layout pointer copies cannot move, the
staged pool. Every copy has finished when a read ends, so a forward never
reads a block before its KV is there.

``LoadPath.load`` runs a planned load (``LoadSpec``: its prefetched blocks
from the buffer, the rest from the store) and releases its lease whatever
happens, even when it raises: the blocks not loaded go back to vLLM as load
errors, which it recomputes or fails by ``kv_load_failure_policy``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import torch

from kvlc_store.backends import Backend, BackendUnavailable, DirectoryBackend, Head
from kvlc_store.chunk import HEADER_BYTES, ChunkError, check_header, check_payload
from kvlc_store.core import StoreCore
from kvlc_store.device_transfer import DeviceTransfer, Region
from kvlc_store.host_tier import HostTier
from kvlc_store.metadata import LoadSpec
from kvlc_store.prefetch import BufferReader
from kvlc_store.transfer import BlockLayout

# Threads that read a batch of chunks from the directory store: file reads
# release the GIL and scale with threads (page cache on an H100 host: 5.2
# GB/s on one, 18.5 on four, 24.9-27.8 on eight), and each thread digests
# its own chunks, so the digests overlap the other threads' reads.
READ_THREADS = 8

# One chunk's read and checks: its head and the error it failed with.
_Checked = tuple[Head | None, ChunkError | None]
# What ``LoadPath.read`` yields per batch: block ids, keys, and each block's
# outcome (True loaded, False damaged, None not stored).
Batch = tuple[Sequence[int], Sequence[str], Sequence[bool | None]]


class LoadPath:
    """The load path of one worker (one TP rank) over ``layout``.

    Args:
        core: the store, its identity and counters.
        layout: the worker's KV cache.
        block_size: tokens per block (the token counters).
        rank: the worker's TP rank; rank 0 alone counts tokens, or TP=2
            would report twice the tokens the scheduler asked for.

    Reads go straight into a host KV cache until ``batched`` is called.
    ``read`` and ``load`` may run on the step's thread and the asynchronous
    load thread at once.
    """

    def __init__(
        self, core: StoreCore, layout: BlockLayout, block_size: int, rank: int
    ) -> None:
        self._core = core
        self._layout = layout
        self._block_size = block_size
        self.rank = rank
        self._device: DeviceTransfer | None = None
        self._tier: HostTier | None = None
        self._readers: ThreadPoolExecutor | None = None

    def batched(self, device: DeviceTransfer, tier: HostTier | None) -> None:
        """Move chunks through host memory: the host tier's slots, or
        without ``tier`` the staged pool of ``device``; chunks are read and
        checked there by ``READ_THREADS`` threads."""
        self._device, self._tier = device, tier
        self._readers = ThreadPoolExecutor(READ_THREADS, "kvlc-read")

    def close(self) -> None:
        if self._readers is not None:
            self._readers.shutdown()

    def load(
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
        gone: list[str] = []
        try:
            if spec.num_buffered and buffer_dir is not None:
                n = spec.num_buffered
                buffer = BufferReader(buffer_dir)
                done = self._fill(block_ids[:n], keys[:n], cancelled, [], buffer)
                # What the buffer lacked is read from the store.
                lacked = [j for j in range(n) if block_ids[j] not in done]
                block_ids = [block_ids[j] for j in lacked] + list(block_ids[n:])
                from_store = [keys[j] for j in lacked] + keys[n:]
            if not cancelled():
                done |= self._fill(block_ids, from_store, cancelled, gone)
        finally:
            if spec.lease_id is not None:
                core.release(spec.lease_id, keys, count=self.rank == 0)
        if gone:
            core.gone_at_load(gone)
        failed = set(spec.block_ids) - done
        if not cancelled():
            core.stats.inc("load_errors", len(failed))
        return failed

    def _fill(
        self,
        block_ids: Sequence[int],
        keys: Sequence[str],
        cancelled: Callable[[], bool],
        gone: list[str],
        buffer: BufferReader | None = None,
    ) -> set[int]:
        """``read`` until ``cancelled()``; the blocks loaded. Adds to
        ``gone`` the keys the store did not hold (a planned load's chunks
        were leased: gone since, by hand)."""
        done: set[int] = set()
        for ids, batch_keys, outcomes in self.read(block_ids, keys, buffer):
            if all(outcomes):
                done.update(ids)
            else:
                loaded = zip(ids, batch_keys, outcomes, strict=True)
                for block_id, key, ok in loaded:
                    if ok:
                        done.add(block_id)
                    elif ok is None and buffer is None:
                        gone.append(key)
            if cancelled():
                break
        return done

    def read(
        self,
        block_ids: Sequence[int],
        keys: Sequence[str],
        buffer: BufferReader | None = None,
        probe: bool = False,
    ) -> Iterator[Batch]:
        """Read ``keys`` into ``block_ids`` in order and check each; yield
        them in batches (``Batch``: a hit of 2,048 blocks is a few batches,
        not 2,048 steps of three generators). Stops early if the store
        fails. From ``buffer`` instead of the store if given: a damaged
        chunk there is None (the store's copy may be fine), and nothing is
        deleted. ``probe``: a worker-side lookup, where a damaged chunk is a
        miss, not a load error."""
        core, layout = self._core, self._layout
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
        host KV cache (``read``'s host path), checked there."""
        core = self._core
        if head is None:
            return None
        try:
            header = check_header(
                head[0], core.identity, key, head[1], self._layout.digest
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
    ) -> Iterator[Batch]:
        """``read`` for a KV cache off the host: batches of chunks read into
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
    ) -> Iterator[Batch]:
        """``read`` through the host tier: a chunk the tier holds is copied
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
        identity, layout = self._core.identity, self._layout.digest
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

"""The connector's worker side: loads, worker lookups and saves.

A load reads each planned chunk once, straight into its KV-cache block (a
host KV cache; a cache on an accelerator through one host buffer per
block), and checks it there: header, length and the payload's digest. A
chunk that fails is deleted and its block reported through
``get_block_ids_with_load_errors``, so vLLM recomputes it
(``kv_load_failure_policy: recompute``) instead of using it. A save writes
the block's bytes straight from the KV cache after the chunk's header.

Blocks the scheduler side prefetched are read from its buffer
(``prefetch.py``) the same way; a chunk missing or damaged there is read
from the store instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from kvlc_store.async_load import AsyncLoads
from kvlc_store.backends import Backend, BackendUnavailable, Head, new_lease_id
from kvlc_store.chunk import (
    HEADER_BYTES,
    ChunkError,
    check_header,
    check_payload,
    checksum,
    encode_header,
)
from kvlc_store.core import StoreCore
from kvlc_store.metadata import LoadSpec, SaveSpec, StoreMetadata
from kvlc_store.offload import SavedBlocks
from kvlc_store.prefetch import BufferReader
from kvlc_store.transfer import BlockLayout, bytes_view


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

    def register(
        self, kv_caches: dict[str, torch.Tensor], num_blocks: int, rank: int
    ) -> None:
        self.rank = rank
        self._layout = BlockLayout(kv_caches, num_blocks)

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
    ) -> Iterator[tuple[int, str, bool | None]]:
        """Read ``keys`` into ``block_ids`` in order and check each; yield
        (block id, key, True if loaded / False if damaged / None if not
        stored). Stops early if the store fails. From ``buffer`` instead of
        the store if given: a damaged chunk there is None (the store's copy
        may be fine), and nothing is deleted. ``probe``: a worker-side
        lookup, where a damaged chunk is a miss, not a load error."""
        core, layout = self._core, self.layout
        source: Backend | BufferReader = core.backend if buffer is None else buffer
        if layout.on_host:
            targets = [layout.segments(b) for b in block_ids]
            stagings: list[torch.Tensor] = []
        else:
            stagings = [
                torch.empty(layout.block_bytes, dtype=torch.uint8) for _ in block_ids
            ]
            targets = [[bytes_view(s)] for s in stagings]
        reads = source.read_into(keys, HEADER_BYTES, targets)
        try:
            for i, head in enumerate(_guarded(reads, core)):
                block_id, key = block_ids[i], keys[i]
                if head is None:
                    yield block_id, key, None
                    continue
                try:
                    header = check_header(head[0], core.identity, key, head[1])
                    check_payload(header, targets[i])
                except ChunkError as e:
                    if buffer is not None:
                        yield block_id, key, None
                        continue
                    core.bad_chunk(key, e, at_load=not probe)
                    yield block_id, key, False
                    continue
                if stagings:
                    layout.unstage(block_id, stagings[i])
                core.stats.inc("loaded_bytes", head[1])
                if buffer is not None:
                    core.stats.inc("prefetch_loaded_bytes", head[1])
                yield block_id, key, True
        finally:
            reads.close()

    def start_load(self, meta: StoreMetadata) -> None:
        for spec in meta.loads:
            if spec.load_async:
                if self._async is None:
                    self._async = AsyncLoads(self._load)
                self._async.submit(spec, meta.buffer_dir)
            else:
                self._load_errors |= self._load(spec, meta.buffer_dir)
        worker_loads, self._worker_loads = self._worker_loads, []
        for load in worker_loads:
            if self.rank == 0:
                self._core.stats.inc(
                    "worker_hit_tokens", load.num_blocks * self._block_size
                )
            self._core.release(load.lease_id, load.keys, count=False)

    def _load(
        self,
        spec: LoadSpec,
        buffer_dir: str | None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> set[int]:
        """Load ``spec``'s blocks and release its lease; return the blocks
        that could not be loaded. Stops between two blocks once
        ``cancelled()`` (the request finished while it loaded)."""
        core = self._core
        keys = [keys[self.rank] for keys in spec.keys]
        done: set[int] = set()
        from_store = list(zip(spec.block_ids, keys, strict=True))
        try:
            if spec.num_buffered and buffer_dir is not None:
                n = spec.num_buffered
                buffer = BufferReader(buffer_dir)
                done = self._fill(spec.block_ids[:n], keys[:n], cancelled, buffer)
                # What the buffer lacked is read from the store.
                from_store = [(b, k) for b, k in from_store[:n] if b not in done]
                from_store += list(zip(spec.block_ids[n:], keys[n:], strict=True))
            if not cancelled():
                done |= self._fill(
                    [b for b, _ in from_store], [k for _, k in from_store], cancelled
                )
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
        for block_id, _, ok in self._read(block_ids, keys, buffer):
            if ok:
                done.add(block_id)
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
        for probe in meta.probes:
            if not core.usable():
                break
            keys = [keys[self.rank] for keys in probe.keys]
            lease_id = new_lease_id()
            try:
                n = core.backend.lease(keys, lease_id, core.config.lease_ttl_s)
            except BackendUnavailable as e:
                core.unavailable(e)
                continue
            if n:
                core.available()
            # Like the scheduler's lookup, reads on past a damaged chunk:
            # each one found is deleted now, so this request's save writes
            # it again.
            good = 0
            whole = True
            for _, _, ok in self._read(probe.block_ids[:n], keys[:n], probe=True):
                whole = whole and bool(ok)
                good += whole
                if ok is None:
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

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves ------------------------------------------------------------

    def save(self, meta: StoreMetadata) -> None:
        store_down = False
        for save in meta.saves:
            # After the store failed once, the step's other saves are skipped.
            store_down = store_down or not self._save_block(save)
            if save.pinned:
                self.saved.done.add(save.block_id)
                if store_down:
                    self.saved.failed.add(save.block_id)

    def _save_block(self, save: SaveSpec) -> bool:
        """Write one block; False if the store failed (unreachable, full,
        an I/O error): the save is skipped, the server goes on."""
        core, layout = self._core, self.layout
        if not core.usable("write"):
            return False
        key = save.keys[self.rank]
        if layout.on_host:
            parts: list[memoryview] = layout.segments(save.block_id)
        else:
            parts = [bytes_view(layout.staged(save.block_id))]
        size = sum(p.nbytes for p in parts)
        header = encode_header(core.identity, key, size, checksum(parts))
        try:
            evicted = core.backend.put(key, [header, *parts])
        except BackendUnavailable as e:
            core.unavailable(e, "write")
            return False
        if evicted is not None:  # Written: a write that failed before works.
            core.available("write")
        core.stats.inc("stored_bytes", HEADER_BYTES + size)
        core.stats.inc("stored_chunks")
        core.stats.inc("evictions", evicted or 0)
        return True

    def take_saved(self) -> SavedBlocks | None:
        if not self.saved.done:
            return None
        saved, self.saved = self.saved, SavedBlocks()
        return saved


def _guarded(reads: Iterator[Head | None], core: StoreCore) -> Iterator[Head | None]:
    """``reads``, ending early (counted, logged) if the store fails."""
    try:
        yield from reads
    except BackendUnavailable as e:
        core.unavailable(e)

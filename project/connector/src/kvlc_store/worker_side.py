"""The connector's worker side: what each step asks of one worker (TP rank)
and when it is done, over the store and the worker's KV cache.

vLLM's runner calls it around the forward, and the forward must never see a
block before its KV is there or a block freed while a save still reads it.
So a step's loads run before its forward (``start_load``; vLLM flags the
step ``has_sync_kv_loads``, else the loads are refused, never read late),
or with ``load_async`` beside the steps on a thread (``async_load.py``),
each reported done through ``finished_loads`` with its failed blocks in the
same step; how a chunk gets into its block, checked, is ``load_path.py``.
``before_update_states`` finds blocks of new prompts another server stored
after the scheduler looked, and reports as a hit only what it already
loaded and checked: vLLM cannot take a hit back.

A save writes the block's bytes straight from the KV cache after the
chunk's header (on an accelerator: gathered in batches and written by a
thread, ``async_save.py``). A chunk write that fails (out of space, an
I/O error) drops the save, never the request, and backs off from saves
only: what the store holds is still looked up, loaded and its leases
released. A finished request's blocks are reported free only once its saves
are written (``finished_saves``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlc_store.async_load import AsyncLoads
from kvlc_store.async_save import AsyncSaves
from kvlc_store.backends import BackendUnavailable, new_lease_id
from kvlc_store.chunk import HEADER_BYTES, checksum, encode_header
from kvlc_store.core import StoreCore, logger
from kvlc_store.device_transfer import DeviceTransfer
from kvlc_store.host_tier import HostTier
from kvlc_store.load_path import READ_THREADS as READ_THREADS  # for benchmarks
from kvlc_store.load_path import LoadPath
from kvlc_store.metadata import LoadSpec, SaveSpec, StoreMetadata
from kvlc_store.offload import SavedBlocks
from kvlc_store.transfer import BlockLayout


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
        # Set by ``register``: how chunks get into the KV cache.
        self._load_path: LoadPath | None = None
        # Requests whose blocks vLLM keeps until reported (SaveSpec.req_id),
        # and those of them that finished.
        self._sending: set[str] = set()
        self._finishing: set[str] = set()
        self._warned_unordered = False
        # Chunks written since the last ``_vouch_written``.
        self._written: list[str] = []

    def register(
        self, kv_caches: dict[str, torch.Tensor], num_blocks: int, rank: int
    ) -> None:
        self.rank = rank
        self._layout = BlockLayout(kv_caches, num_blocks)
        self._load_path = LoadPath(self._core, self._layout, self._block_size, rank)
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
        self._async_saves = AsyncSaves(
            device, self._write_chunk, self._tier, self._vouch_written
        )
        self._loads.batched(device, self._tier)
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

    @property
    def _loads(self) -> LoadPath:
        assert self._load_path is not None, "register_kv_caches was not called"
        return self._load_path

    # -- loads ------------------------------------------------------------

    def start_load(self, meta: StoreMetadata) -> None:
        if self._device is not None and meta.loads:
            # Loads write blocks the forwards queued so far may still use.
            self._device.mark_compute()
        for spec in meta.loads:
            if spec.load_async:
                if self._async is None:
                    self._async = AsyncLoads(self._loads.load, self.layout.device)
                self._async.submit(spec, meta.buffer_dir)
            elif not meta.sync_loads_first:
                self._load_errors |= self._refuse_unordered(spec)
            else:
                self._load_errors |= self._loads.load(spec, meta.buffer_dir)
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
            for _, _, outcomes in self._loads.read(
                probe.block_ids[:n], keys[:n], probe=True
            ):
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
        if self._load_path is not None:
            self._load_path.close()

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
        self._vouch_written()

    def _save_block(self, save: SaveSpec) -> bool:
        """Write one block of a host KV cache, straight from it; False if
        the store failed."""
        return self._write_chunk(
            save.keys[self.rank], self.layout.segments(save.block_id)
        )

    def _write_chunk(self, key: str, parts: Sequence[memoryview]) -> bool:
        """Store the chunk ``key`` of payload ``parts``; False if the store
        failed (unreachable, full, an I/O error) or is being backed off
        from: the save is skipped, the server goes on. It backs off from
        writes only (``"write"``): reads of what the store holds go on.
        Also the save thread's (``async_save.py``)."""
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
            self._written.append(key)
        core.stats.inc("stored_bytes", HEADER_BYTES + size)
        core.stats.inc("stored_chunks")
        core.evicted(evicted or 0)
        return True

    def _vouch_written(self) -> None:
        """Record the chunks written since the last call as checked, for
        every server's lookups (``Backend.vouch``): their headers are this
        worker's own. Once per step's saves (per batch on the save
        thread), one store operation for all of them."""
        written, self._written = self._written, []
        if written:
            layout = self.layout.digest
            self._core.backend.vouch(dict.fromkeys(written, layout))

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

"""Batched transfers between a KV cache on an accelerator and host memory.

A host KV cache is read into and written from in place (``transfer.py``). A
KV cache on a GPU is not host memory, and one small copy per layer per block
runs at a small fraction of the host link's speed, so blocks move in
batches, the way vLLM's offloading connectors move them:

- a save copies a batch of blocks of every layer into pinned host memory, on
  a side stream that waits for the forward that computed the blocks (an
  event); a thread then writes the chunks from there (``async_save.py``),
  off the forward's path;
- a load reads a batch of chunks into pinned host memory and copies them
  into their blocks, on the side stream.

Each batch is one call of vLLM's ``swap_blocks_batch`` (``cuMemcpyBatchAsync``,
what OffloadingConnector moves its blocks with): one pointer copy per
contiguous run of a block in a layer (two per layer for FlashAttention's
``[2, num_blocks, ...]``), straight between pinned memory and the KV cache.
The pointers are computed on the host from the block ids, so nothing waits
for an index tensor to reach the device, and no device memory is taken
outside vLLM's ``--gpu-memory-utilization`` budget. A layout whose payload
order is not its memory order (a permuted, HND-like view: one run per head
and token) would need thousands of runs per block; it is gathered through a
device staging buffer instead (``index_select`` / ``index_copy_`` per
layer), its index tensors sent from pinned memory without a host sync.

A chunk's payload is its block's row of every layer in layer order: the
same bytes as the per-block path (``BlockLayout.staged``). Pointer copies
put it in one place (a host tier slot); a staged batch of ``k`` blocks is
laid out layer by layer (layer ``l``'s ``k`` rows together), and a chunk's
payload is handed to the backends as a list of buffers (``writev`` /
``preadv``).

With a KV cache on the CPU (the tests) the same pointer lists are executed
with ``memmove``, in the caller's order, with no stream and no events.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from kvlc_store.transfer import BlockLayout, bytes_view, contiguous_runs

# torch.cuda's Stream and Event constructors are not annotated.
_new_stream: Callable[[torch.device], torch.cuda.Stream] = torch.cuda.Stream
_new_event: Callable[[], torch.cuda.Event] = torch.cuda.Event


def side_streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """A (load, save) pair: two streams, so a load never queues behind a
    save's copy (``DeviceTransfer``)."""
    return _new_stream(device), _new_stream(device)


# Above this many runs per block row, a gather through a staging buffer
# beats one pointer copy per run (FlashAttention: 2, FlashInfer and MLA: 1).
MAX_RUNS_PER_ROW = 8

# (source pointers, destination pointers, sizes: int64 CPU tensors, the
# source read in any order) -> the copies queued on the current stream.
CopyBatch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], None]


def host_copy_batch(
    src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, any_order: bool
) -> None:
    """``swap_blocks_batch`` for host memory on both sides (a KV cache on
    the CPU): the same pointer lists, copied now."""
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(d, s, n)


def cuda_copy_batch(
    src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, any_order: bool
) -> None:
    """vLLM's batched copy (``cuMemcpyBatchAsync``) on the current stream."""
    from vllm import _custom_ops as ops

    ops.swap_blocks_batch(src, dst, sizes, is_src_access_order_any=any_order)


def _int64(values: Sequence[int]) -> torch.Tensor:
    """``values`` as an int64 CPU tensor: through ``array``, in C, where
    ``torch.tensor`` of a list converts element by element (a 32k-token hit
    builds 4,096 pointers' worth of these per batch)."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


@dataclass(frozen=True)
class _RunTable:
    """Every contiguous run of a block row, over all layers, as columns.

    Block ``b``'s run ``r`` is at ``device[r] + b * step[r]`` in the KV
    cache, and at ``offset[r]`` in the block's chunk payload.
    """

    device: torch.Tensor
    step: torch.Tensor
    offset: torch.Tensor
    size: torch.Tensor

    @classmethod
    def of(cls, blocks: Sequence[torch.Tensor]) -> _RunTable | None:
        """The table of ``blocks`` (``BlockLayout.block_major``), or None if
        a row has more than ``MAX_RUNS_PER_ROW`` runs."""
        cols: list[list[int]] = [[], [], [], []]
        layer_start = 0
        for view in blocks:
            size = view.element_size()
            runs: list[tuple[int, int]] = []
            for run in contiguous_runs(view[0]):
                ptr, nbytes = run.data_ptr(), run.numel() * size
                if runs and runs[-1][0] + runs[-1][1] == ptr:
                    runs[-1] = (runs[-1][0], runs[-1][1] + nbytes)
                else:
                    runs.append((ptr, nbytes))
            if len(runs) > MAX_RUNS_PER_ROW:
                return None
            offset = layer_start
            for ptr, nbytes in runs:
                for col, value in zip(
                    cols, (ptr, view.stride(0) * size, offset, nbytes), strict=True
                ):
                    col.append(value)
                offset += nbytes
            layer_start += view[0].numel() * size
        return cls(*(torch.tensor(col, dtype=torch.int64) for col in cols))

    def pointers_at(
        self, block_ids: Sequence[int], payloads: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(KV cache, host, size) of every run of blocks ``block_ids``,
        whose payloads start at host addresses ``payloads``."""
        ids = _int64(block_ids)[:, None]
        starts = _int64(payloads)[:, None]
        device = self.device + ids * self.step
        host = starts + self.offset
        size = self.size.expand(len(block_ids), -1)
        return device.reshape(-1), host.reshape(-1), size.reshape(-1).contiguous()


@dataclass(frozen=True)
class Region:
    """``count`` consecutive blocks of a ``HostPool``, from block ``start``."""

    start: int
    count: int
    host: torch.Tensor  # their bytes, a slice of the pool


class HostPool:
    """Host memory for batches of blocks, allocated once: ``capacity``
    blocks of ``block_bytes``, handed out as runs of consecutive blocks.

    Thread-safe. ``take`` waits for a free run, so a caller that already
    holds one must use ``try_take`` (two holders waiting for each other's
    runs would wait forever). No run is longer than ``max_run`` blocks, half
    the pool, so two callers (a load and the save thread) always move.
    """

    def __init__(self, total_bytes: int, block_bytes: int, pin: bool) -> None:
        self.block_bytes = block_bytes
        self.capacity = max(1, total_bytes // block_bytes)
        self.max_run = max(1, self.capacity // 2)
        self._pin = pin
        self._buffer: torch.Tensor | None = None
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # start, count
        self._cond = threading.Condition()

    @property
    def buffer(self) -> torch.Tensor:
        """The pool's memory, allocated at first use: a worker whose blocks
        move through the host tier never takes any."""
        if self._buffer is None:
            self._buffer = torch.empty(
                self.capacity * self.block_bytes,
                dtype=torch.uint8,
                pin_memory=self._pin,
            )
        return self._buffer

    @property
    def nbytes(self) -> int:
        return self.capacity * self.block_bytes

    def try_take(self, want: int) -> Region | None:
        """The first free run, cut to ``want`` (and ``max_run``) blocks;
        None if none is free."""
        with self._cond:
            return self._take(want)

    def take(self, want: int) -> Region:
        """``try_take``, waiting for a run to be given back."""
        with self._cond:
            while (region := self._take(want)) is None:
                self._cond.wait()
            return region

    def _take(self, want: int) -> Region | None:
        if not self._free:
            return None
        start, count = self._free[0]
        n = min(count, want, self.max_run)
        if n == count:
            self._free.pop(0)
        else:
            self._free[0] = (start + n, count - n)
        bb = self.block_bytes
        return Region(start, n, self.buffer[start * bb : (start + n) * bb])

    def give(self, region: Region) -> None:
        with self._cond:
            runs = sorted([*self._free, (region.start, region.count)])
            merged: list[tuple[int, int]] = []
            for start, count in runs:
                if merged and merged[-1][0] + merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], merged[-1][1] + count)
                else:
                    merged.append((start, count))
            self._free = merged
            self._cond.notify_all()


class DeviceTransfer:
    """Copies of one worker's KV cache to and from host memory: by pointer
    copies between the KV cache and chunk payloads anywhere in host memory
    (``save_to``, ``load_from``: the host tier's slots), or, for a layout
    with too many runs per block for those, staged through a ``HostPool``
    (``gather``, ``scatter``).

    On CUDA the copies run on two side streams, each batch ending with an
    event (``wait`` blocks on it): loads (``load_from``, ``scatter``) on
    one, saves (``save_to``, ``gather``) on the other, so a hit never queues
    behind a save's multi-GB copy (the copy engines of each direction run
    side by side). Nothing orders the two: a load writes blocks vLLM has
    just allocated to its request, which no save in flight reads (a saved
    request's blocks stay held until its saves are copied:
    ``async_save.py``), and host memory a save writes (tier slots, pool
    regions) is pinned or held until its event passed. Elsewhere the copies
    run in the caller's order, the host copies blocking, and the events are
    None.

    Args:
        layout: the worker's KV cache.
        pool_bytes: host memory for batches (``pinned_buffer``), allocated
            now, pinned on CUDA.
        copy_batch: runs a batch of pointer copies; vLLM's
            ``swap_blocks_batch`` on CUDA, ``memmove`` on the CPU.
        streams: the (load, save) streams; default: two new side streams
            on CUDA, none elsewhere (tests pass stand-ins to check the
            ordering on CPU tensors).
    """

    def __init__(
        self,
        layout: BlockLayout,
        pool_bytes: int,
        copy_batch: CopyBatch | None = None,
        streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None,
    ) -> None:
        self.device = layout.device
        self._blocks = layout.block_major()
        self._row_bytes = [b[0].numel() * b.element_size() for b in self._blocks]
        self.block_bytes = sum(self._row_bytes)
        cuda = self.device.type == "cuda"
        self.pool = HostPool(pool_bytes, self.block_bytes, pin=cuda)
        if streams is None and cuda:
            streams = side_streams(self.device)
        self._load_stream: torch.cuda.Stream | None = None
        self._save_stream: torch.cuda.Stream | None = None
        if streams is not None:
            self._load_stream, self._save_stream = streams
        # Asynchronous host copies only where an event tells when they end.
        self._async_copies = cuda
        self._compute_done: torch.cuda.Event | None = None
        self._runs = _RunTable.of(self._blocks)
        if copy_batch is None:
            copy_batch = cuda_copy_batch if cuda else host_copy_batch
        self._copy_batch = copy_batch

    @property
    def batched_copies(self) -> bool:
        """Whether this layout moves by pointer copies (``save_to``,
        ``load_from``); ``gather`` and ``scatter`` move any layout."""
        return self._runs is not None

    # -- ordering ---------------------------------------------------------

    def mark_compute(self) -> torch.cuda.Event | None:
        """Record where the caller's stream (the forward's) is now: the
        copies queued after this wait for the work queued before it."""
        if self._load_stream is None:
            return None
        event = _new_event()
        event.record(torch.cuda.current_stream(self.device))
        self._compute_done = event
        return event

    @contextlib.contextmanager
    def _side(
        self, stream: torch.cuda.Stream | None, after: torch.cuda.Event | None
    ) -> Iterator[torch.cuda.Stream | None]:
        """Queue the body's copies on ``stream``, after ``after``."""
        if stream is None:
            yield None
            return
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            yield stream

    @staticmethod
    def _done(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        if stream is None:
            return None
        event = _new_event()
        event.record(stream)
        return event

    @staticmethod
    def wait(event: torch.cuda.Event | None) -> None:
        """Block until the batch that returned ``event`` is copied."""
        if event is not None:
            event.synchronize()

    # -- batches ----------------------------------------------------------

    def _layer_views(self, flat: torch.Tensor, k: int) -> list[torch.Tensor]:
        """``flat`` (``k`` blocks' bytes) as each layer's ``k`` rows."""
        views, offset = [], 0
        for blocks, row in zip(self._blocks, self._row_bytes, strict=True):
            size = k * row
            rows = flat[offset : offset + size].view(blocks.dtype)
            views.append(rows.view(k, *blocks.shape[1:]))
            offset += size
        return views

    def chunk_parts(self, region: Region, j: int) -> list[memoryview]:
        """The payload of the region's ``j``-th block, as host buffers."""
        base = bytes_view(region.host)
        parts, offset = [], 0
        for row in self._row_bytes:
            parts.append(base[offset + j * row : offset + (j + 1) * row])
            offset += region.count * row
        return parts

    def _staging(self, region: Region) -> torch.Tensor:
        if self.device.type == "cpu":
            return region.host
        return torch.empty_like(region.host, device=self.device)

    def _index(self, ids: Sequence[int]) -> torch.Tensor:
        """``ids`` on the device, sent from pinned memory: a tensor built
        from a list straight on the device would wait for its copy."""
        index = torch.tensor(ids, dtype=torch.long)
        if self.device.type == "cpu":
            return index
        return index.pin_memory().to(self.device, non_blocking=True)

    def gather(
        self,
        block_ids: Sequence[int],
        region: Region,
        after: torch.cuda.Event | None,
    ) -> torch.cuda.Event | None:
        """Queue the copy of blocks ``block_ids`` (``region.count`` of them)
        into ``region`` through a device staging buffer, after ``after``
        (the forward that computed them)."""
        assert len(block_ids) == region.count
        with self._side(self._save_stream, after) as stream:
            # Allocated on the side stream: reused only after its copies.
            staging = self._staging(region)
            idx = self._index(block_ids)
            for blocks, out in zip(
                self._blocks, self._layer_views(staging, region.count), strict=True
            ):
                torch.index_select(blocks, 0, idx, out=out)
            if staging is not region.host:
                region.host.copy_(staging, non_blocking=self._async_copies)
            return self._done(stream)

    def save_to(
        self,
        block_ids: Sequence[int],
        payloads: Sequence[int],
        after: torch.cuda.Event | None,
    ) -> torch.cuda.Event | None:
        """Queue the copy of blocks ``block_ids`` into host memory, each
        block's payload at its address in ``payloads`` (``HostTier`` slots),
        after ``after``. Pointer copies only (``batched_copies``)."""
        assert self._runs is not None
        with self._side(self._save_stream, after) as stream:
            kv, host, size = self._runs.pointers_at(block_ids, payloads)
            self._copy_batch(kv, host, size, False)
            return self._done(stream)

    def load_from(
        self, block_ids: Sequence[int], payloads: Sequence[int]
    ) -> torch.cuda.Event | None:
        """Queue the copy of the payloads at host addresses ``payloads``
        into blocks ``block_ids``, after the work the caller's stream had
        queued at the last ``mark_compute``. Pointer copies only."""
        assert self._runs is not None
        if not block_ids:
            return None
        with self._side(self._load_stream, self._compute_done) as stream:
            kv, host, size = self._runs.pointers_at(block_ids, payloads)
            # Nothing on the device writes host memory, so the source may be
            # read in any order.
            self._copy_batch(host, kv, size, True)
            return self._done(stream)

    def scatter(
        self, block_ids: Sequence[int], rows: Sequence[int], region: Region
    ) -> torch.cuda.Event | None:
        """Queue the copy of ``region``'s blocks ``rows`` into blocks
        ``block_ids``, after the work the caller's stream had queued at the
        last ``mark_compute`` (the blocks' previous users), through a device
        staging buffer."""
        if not block_ids:
            return None
        with self._side(self._load_stream, self._compute_done) as stream:
            staging = self._staging(region)
            if staging is not region.host:
                staging.copy_(region.host, non_blocking=self._async_copies)
            idx = self._index(block_ids)
            pick = None
            if len(rows) < region.count:
                pick = self._index(rows)
            for blocks, src in zip(
                self._blocks, self._layer_views(staging, region.count), strict=True
            ):
                blocks.index_copy_(0, idx, src if pick is None else src[pick])
            return self._done(stream)

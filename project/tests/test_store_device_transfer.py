"""The batched path of a KV cache on an accelerator, run on CPU tensors.

``DeviceTransfer`` is plain torch: the same gathers and scatters run on a GPU
(with a side stream and pinned memory) and here (no stream, ordinary
memory). Checked byte for byte against the per-block path
(``BlockLayout.staged`` / ``unstage``) for the KV layouts of vLLM's
attention backends and their dtypes; then the worker side over a real
directory store: saves written by the save thread, loads through the pool
in several batches, a damaged chunk, and the protocol that keeps a finished
request's blocks until its saves are written (``get_finished``).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace

import driver_run
import pytest
import torch
from kvlc_store import device_transfer
from kvlc_store.backends import BackendUnavailable, Data, DirectoryBackend
from kvlc_store.chunk import HEADER_BYTES
from kvlc_store.config import parse_config
from kvlc_store.core import StoreCore, make_backend
from kvlc_store.device_transfer import DeviceTransfer, HostPool, host_copy_batch
from kvlc_store.metadata import LoadSpec, SaveSpec, StoreMetadata
from kvlc_store.scheduler_side import SchedulerSide
from kvlc_store.transfer import BlockLayout
from kvlc_store.worker_side import WorkerSide
from redis_server import running_redis

NB = 7  # blocks
BS = 4  # tokens per block
H, D = 2, 8

DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float32]
# On a machine with a GPU the same tests run there too (side stream, events,
# pinned pool).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _random(shape: Sequence[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bits (NaN patterns too: compared as bytes)."""
    g = torch.Generator().manual_seed(seed)
    size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    bits = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
    return bits.view(dtype).view(*shape)


# name -> (allocate one layer's tensor from its physical shape, per block
# rows); each as one of vLLM's attention backends lays its KV cache out.
def _kv_split_blocks_dim1(dtype: torch.dtype, seed: int) -> torch.Tensor:
    # FlashAttention, Triton: [2, num_blocks, block_size, heads, dim]
    return _random((2, NB, BS, H, D), dtype, seed)


def _blocks_dim0_kv_split_dim1(dtype: torch.dtype, seed: int) -> torch.Tensor:
    # FlashInfer: [num_blocks, 2, block_size, heads, dim]
    return _random((NB, 2, BS, H, D), dtype, seed)


def _mla(dtype: torch.dtype, seed: int) -> torch.Tensor:
    # MLA: [num_blocks, block_size, latent dim], no K/V split
    return _random((NB, BS, 3 * D), dtype, seed)


def _cpu_backend(dtype: torch.dtype, seed: int) -> torch.Tensor:
    # vLLM's CPU backend: [2, num_blocks * block_size, heads, dim]
    return _random((2, NB * BS, H, D), dtype, seed)


def _hnd_strided(dtype: torch.dtype, seed: int) -> torch.Tensor:
    # A backend whose stride order keeps heads outside tokens (HND): the
    # logical [2, num_blocks, block_size, heads, dim] is not contiguous.
    return _random((2, NB, H, BS, D), dtype, seed).permute(0, 1, 3, 2, 4)


LAYOUTS: dict[str, Callable[[torch.dtype, int], torch.Tensor]] = {
    "kv-split-blocks-dim1": _kv_split_blocks_dim1,
    "blocks-dim0-kv-split-dim1": _blocks_dim0_kv_split_dim1,
    "mla-blocks-dim0": _mla,
    "cpu-blocks-times-tokens": _cpu_backend,
    "hnd-strided": _hnd_strided,
}


def caches(
    layout: str, dtype: torch.dtype, seed: int, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    make = LAYOUTS[layout]
    # Three layers, named out of order: the payload sorts them by name.
    return {
        name: make(dtype, seed + i).to(device)
        for i, name in enumerate(("l.2", "l.0", "l.1"))
    }


def raw(kv: dict[str, torch.Tensor]) -> list[bytes]:
    """Every layer's storage, as bytes."""
    return [
        bytes(t.cpu().untyped_storage())
        for _, t in sorted(kv.items(), key=lambda x: x[0])
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gather_is_the_per_block_payload(layout: str, dtype: torch.dtype, device: str):
    kv = caches(layout, dtype, 1, device)
    per_block = BlockLayout(kv, NB)
    transfer = DeviceTransfer(per_block, 64 * per_block.block_bytes)
    assert transfer.block_bytes == per_block.block_bytes
    ids = [5, 0, 3, 6]  # scattered, out of order
    region = transfer.pool.take(len(ids))
    transfer.wait(transfer.gather(ids, region, None))
    for j, b in enumerate(ids):
        parts = transfer.chunk_parts(region, j)
        assert b"".join(parts) == bytes(per_block.staged(b).numpy())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_scatter_writes_what_unstage_writes(
    layout: str, dtype: torch.dtype, device: str
):
    """Payloads of other blocks scattered into blocks 1, 4 and 2 (one of a
    batch's rows left out, as a chunk that failed its checks is): the KV
    cache ends byte for byte as after ``unstage`` of the same payloads."""
    source = BlockLayout(caches(layout, dtype, 7), NB)
    payloads = [source.staged(b) for b in (0, 2, 5, 6)]
    targets, rows = [1, 4, 2], [0, 2, 3]

    expected = caches(layout, dtype, 1, device)
    reference = BlockLayout(expected, NB)
    for b, row in zip(targets, rows, strict=True):
        reference.unstage(b, payloads[row])

    kv = caches(layout, dtype, 1, device)
    transfer = DeviceTransfer(BlockLayout(kv, NB), 64 * reference.block_bytes)
    region = transfer.pool.take(len(payloads))
    for j, payload in enumerate(payloads):
        data = memoryview(payload.numpy())
        offset = 0
        for part in transfer.chunk_parts(region, j):
            part[:] = data[offset : offset + part.nbytes]
            offset += part.nbytes
    transfer.wait(transfer.scatter(targets, rows, region))
    assert raw(kv) == raw(expected)


@pytest.mark.parametrize(
    ("layout", "runs_per_layer"),
    [
        ("kv-split-blocks-dim1", 2),
        ("blocks-dim0-kv-split-dim1", 1),
        ("mla-blocks-dim0", 1),
        ("cpu-blocks-times-tokens", 2),
        ("hnd-strided", None),
    ],
)
def test_one_batched_copy_per_batch_and_direction(
    layout: str, runs_per_layer: int | None
):
    """A batch is one call of the batched copy (vLLM's ``swap_blocks_batch``
    on CUDA), one pointer copy per contiguous run of each block in each
    layer; the source is read in any order only for loads (nothing writes
    host memory), never for saves (the forward writes the KV cache). A
    layout whose payload order is not its memory order is staged instead
    (``gather``, ``scatter``) and makes no such call."""
    calls: list[tuple[int, bool]] = []

    def recording(
        src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, any_order: bool
    ) -> None:
        assert src.dtype == dst.dtype == sizes.dtype == torch.int64
        assert src.device.type == dst.device.type == sizes.device.type == "cpu"
        calls.append((len(sizes), any_order))
        host_copy_batch(src, dst, sizes, any_order)

    kv = caches(layout, torch.float16, 1)
    block_layout = BlockLayout(kv, NB)
    transfer = DeviceTransfer(block_layout, 64 * 1024, copy_batch=recording)
    assert transfer.batched_copies == (runs_per_layer is not None)
    if runs_per_layer is None:
        region = transfer.pool.take(3)
        transfer.gather([4, 1, 6], region, None)
        transfer.scatter([2, 0], [0, 2], region)
        assert calls == []
        return
    host = torch.empty(3 * block_layout.block_bytes, dtype=torch.uint8)
    payloads = [host.data_ptr() + j * block_layout.block_bytes for j in range(3)]
    transfer.save_to([4, 1, 6], payloads, None)
    transfer.load_from([2, 0], payloads[:2])
    layers = len(kv)
    assert calls == [(3 * layers * runs_per_layer, False),
                     (2 * layers * runs_per_layer, True)]  # fmt: skip


class _Stream:
    """A CUDA stream stand-in: the events it was told to wait for."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.waited: list[_Event] = []

    def wait_event(self, event: _Event) -> None:
        self.waited.append(event)


class _Event:
    def __init__(self) -> None:
        self.stream: _Stream | None = None

    def record(self, stream: _Stream) -> None:
        self.stream = stream

    def synchronize(self) -> None:
        pass


def test_by_default_loads_and_saves_get_a_side_stream_each(
    monkeypatch: pytest.MonkeyPatch,
):
    """What a CUDA worker's ``DeviceTransfer`` makes when not given streams:
    two, not one shared (a hit would queue behind a multi-GB save)."""
    made: list[_Stream] = []
    monkeypatch.setattr(
        device_transfer,
        "_new_stream",
        lambda device: made.append(_Stream("s")) or made[-1],
    )
    load, save = device_transfer.side_streams(torch.device("cuda"))
    assert load is not save and [load, save] == made


@pytest.mark.parametrize("layout", ["kv-split-blocks-dim1", "hnd-strided"])
def test_loads_and_saves_queue_on_streams_of_their_own(
    layout: str, monkeypatch: pytest.MonkeyPatch
):
    """A load never queues behind a save's copy: saves (``save_to``,
    ``gather``) go on one side stream, loads (``load_from``, ``scatter``) on
    the other; a save waits for the forward that computed its blocks, a load
    for the forwards queued before it (``mark_compute``), and each batch's
    event is recorded on its own stream. CPU tensors, stand-in streams: the
    copies themselves run, in the caller's order."""
    kv = caches(layout, torch.bfloat16, 3, "cpu")
    current: list[_Stream] = []
    compute = _Stream("compute")

    @contextlib.contextmanager
    def on(stream: _Stream) -> Iterator[None]:
        current.append(stream)
        yield
        current.pop()

    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(device_transfer, "_new_event", _Event)
    copies: list[_Stream] = []

    def copy(
        src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, any_order: bool
    ) -> None:
        copies.append(current[-1])
        host_copy_batch(src, dst, sizes, any_order)

    load, save = _Stream("load"), _Stream("save")
    block_bytes = BlockLayout(kv, NB).block_bytes
    transfer = DeviceTransfer(
        BlockLayout(kv, NB), 8 * block_bytes, copy, streams=(load, save)
    )
    before = payloads(kv, [1, 2])
    forward = transfer.mark_compute()
    assert forward is not None and forward.stream is compute
    if transfer.batched_copies:
        host = torch.empty(2 * block_bytes, dtype=torch.uint8)
        slots = [host.data_ptr(), host.data_ptr() + block_bytes]
        saved = transfer.save_to([1, 2], slots, forward)
        loaded = transfer.load_from([5, 6], slots)
        assert copies == [save, load]
    else:
        region = transfer.pool.take(2)
        saved = transfer.gather([1, 2], region, forward)
        loaded = transfer.scatter([5, 6], [0, 1], region)
    assert saved is not None and saved.stream is save
    assert loaded is not None and loaded.stream is load
    assert save.waited == [forward] and load.waited == [forward]
    assert payloads(kv, [5, 6]) == before


def test_pool_hands_out_runs_up_to_half_and_merges_them_back():
    pool = HostPool(10 * 3, 3, pin=False)
    assert (pool.capacity, pool.max_run) == (10, 5)
    a = pool.take(8)  # cut to half the pool
    b = pool.take(2)
    c = pool.take(5)
    assert [(r.start, r.count) for r in (a, b, c)] == [(0, 5), (5, 2), (7, 3)]
    assert a.host.nbytes == 15
    assert pool.try_take(1) is None
    pool.give(b)
    pool.give(a)  # merges with b's run: blocks 0-6 free
    runs = [pool.try_take(9) for _ in range(3)]
    assert [(r.start, r.count) if r else None for r in runs] == [(0, 5), (5, 2), None]
    assert HostPool(10, 100, pin=False).capacity == 1  # less than a block: one


def test_pool_take_waits_for_a_run_given_back():
    pool = HostPool(2, 1, pin=False)
    held = [pool.take(1), pool.take(1)]
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.take(1)))
    waiter.start()
    time.sleep(0.1)
    assert not got
    pool.give(held[1])
    waiter.join(5)
    assert got and got[0].start == 1


# -- the worker side over a real store ---------------------------------------

IDENT = "ident0"


def key(i: int, rank: int = 0) -> str:
    return f"{IDENT}/{i:064x}.{rank}"


class GatedBackend(DirectoryBackend):
    """A directory store whose writes wait for ``gate``, or fail."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, 10**9)
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False

    def put(self, key: str, data: Data) -> int:
        assert self.gate.wait(30)
        if self.fail:
            raise BackendUnavailable("injected")
        return super().put(key, data)


def make(
    tmp_path: Path,
    pool_blocks: int = 64,
    layout: str = "kv-split-blocks-dim1",
    device: str = "cpu",
    tier_blocks: int = 0,
    rank: int = 0,
) -> tuple[StoreCore, WorkerSide, dict[str, torch.Tensor], GatedBackend]:
    """A worker on the batched path; ``tier_blocks`` 0 (the default here)
    keeps no chunk in host memory, so every load reads the store. ``rank``:
    the worker's TP rank, of ``rank + 1`` ranks."""
    kv = caches(layout, torch.bfloat16, 3, device)
    store = tmp_path / "store"
    bb = BlockLayout(kv, NB).block_bytes
    config = parse_config(
        {
            "path": str(store),
            "pinned_buffer": pool_blocks * bb,
            "host_tier": tier_blocks * bb,
        }
    )
    backend = GatedBackend(store)
    core = StoreCore(config, backend, IDENT, rank + 1)
    worker = WorkerSide(core, BS)
    worker.register(kv, NB, rank)  # on a GPU, batched already
    if device == "cpu":
        worker.start_batched_transfers()
    return core, worker, kv, backend


def wait_finished(worker: WorkerSide, req_id: str) -> None:
    deadline = time.monotonic() + 30
    while req_id not in worker.finished_saves(set()):
        assert time.monotonic() < deadline, "saves never reported"
        time.sleep(0.01)


def payloads(kv: dict[str, torch.Tensor], ids: Sequence[int]) -> list[bytes]:
    layout = BlockLayout(kv, NB)
    return [bytes(layout.staged(b).numpy()) for b in ids]


def round_trip(core: StoreCore, worker: WorkerSide, kv: dict[str, torch.Tensor]):
    """5 blocks saved and 3 loaded into other blocks, in several batches of
    a pool of 4 blocks (batches of 2, two in flight): the chunks hold the
    per-block payloads, the loaded blocks the saved ones."""
    bb = BlockLayout(kv, NB).block_bytes
    assert worker._device is not None
    if worker._tier is not None:
        assert worker._tier.max_batch == 2  # pointer copies, through slots
    else:
        assert worker._device.pool.max_run == 2  # staged, through the pool
    saved = payloads(kv, range(5))
    worker.save(
        StoreMetadata(saves=[SaveSpec(b, [key(b)], req_id="r") for b in range(5)])
    )
    worker.finished_saves({"r"})
    wait_finished(worker, "r")
    for b in range(5):
        chunk = core.backend.get(key(b))
        assert chunk is not None and chunk[HEADER_BYTES:] == saved[b]

    worker.start_load(
        StoreMetadata(
            loads=[LoadSpec("q", None, [6, 4, 5], [[key(0)], [key(2)], [key(3)]])],
            sync_loads_first=True,
        )
    )
    assert worker.take_load_errors() == set()
    assert payloads(kv, [6, 4, 5]) == [saved[0], saved[2], saved[3]]
    assert core.stats.data["loaded_bytes"] == 3 * (HEADER_BYTES + bb)
    worker.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["kv-split-blocks-dim1", "hnd-strided"])
def test_saves_then_loads_in_batches_are_exact(
    tmp_path: Path, layout: str, device: str
):
    core, worker, kv, _ = make(tmp_path, 4, layout, device)
    round_trip(core, worker, kv)


def test_saves_then_loads_in_batches_through_redis(tmp_path: Path):
    kv = caches("kv-split-blocks-dim1", torch.bfloat16, 3)
    with running_redis(tmp_path / "redis") as server:
        config = parse_config(
            {
                "backend": "redis",
                "redis_url": server.url,
                "pinned_buffer": 4 * BlockLayout(kv, NB).block_bytes,
                "host_tier": 0,
            }
        )
        core = StoreCore(config, make_backend(config), IDENT, 1)
        worker = WorkerSide(core, BS)
        worker.register(kv, NB, 0)
        worker.start_batched_transfers()
        try:
            round_trip(core, worker, kv)
        finally:
            core.backend.close()


def test_damaged_and_missing_chunks_in_a_batch(tmp_path: Path):
    """One batch: a chunk with a flipped payload bit is a load error and
    deleted, a missing one ends the load there; the good one is loaded and
    the failed blocks are left as they were."""
    core, worker, kv, _ = make(tmp_path)
    saved = payloads(kv, [0, 1])
    worker.save(
        StoreMetadata(saves=[SaveSpec(b, [key(b)], req_id="r") for b in (0, 1)])
    )
    worker.finished_saves({"r"})
    wait_finished(worker, "r")
    path = next((tmp_path / "store" / "chunks").rglob(f"{1:064x}.0"))
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 9] ^= 0x10
    path.write_bytes(bytes(data))
    before = payloads(kv, [3, 4, 5])
    worker.start_load(
        StoreMetadata(
            loads=[LoadSpec("q", None, [3, 4, 5], [[key(0)], [key(1)], [key(9)]])],
            sync_loads_first=True,
        )
    )
    assert worker.take_load_errors() == {4, 5}
    assert payloads(kv, [3, 4, 5]) == [saved[0], before[1], before[2]]
    assert core.stats.data["corrupt_chunks"] == 1
    assert not path.exists()
    worker.close()


def test_finished_request_is_reported_once_its_saves_are_written(tmp_path: Path):
    """``wait_for_save`` returns at once; the request's blocks are reported
    free (``get_finished``'s finished_sending) only after it finished and
    its last chunk is written; a request without such saves never is."""
    core, worker, kv, backend = make(tmp_path)
    backend.gate.clear()  # writes stall
    worker.save(
        StoreMetadata(saves=[SaveSpec(b, [key(b)], req_id="r") for b in (0, 1)])
    )
    worker.save(StoreMetadata(saves=[SaveSpec(2, [key(2)])]))  # no req_id
    assert worker.finished_saves(set()) == set()  # not finished yet
    assert worker.finished_saves({"r", "other"}) == set()  # still writing
    time.sleep(0.1)
    assert worker.finished_saves(set()) == set()
    backend.gate.set()
    wait_finished(worker, "r")
    assert core.backend.get(key(1)) is not None
    assert worker.finished_saves({"r"}) == set()  # reported once
    worker.close()


def test_a_failed_store_drops_the_save_not_the_request(tmp_path: Path):
    core, worker, kv, backend = make(tmp_path)
    backend.fail = True
    worker.save(
        StoreMetadata(saves=[SaveSpec(b, [key(b)], req_id="r") for b in (0, 1)])
    )
    worker.finished_saves({"r"})
    wait_finished(worker, "r")
    assert core.stats.data["store_errors"] == 1  # the second save skipped
    assert core.stats.data.get("stored_chunks", 0) == 0
    worker.close()


def test_preemption_waits_for_the_saves_of_its_blocks(tmp_path: Path):
    """A preempted request's blocks are free in the step that preempted
    it: ``handle_preemptions`` returns only once its saves are done."""
    core, worker, kv, backend = make(tmp_path)
    backend.gate.clear()
    worker.save(StoreMetadata(saves=[SaveSpec(0, [key(0)], req_id="r")]))
    returned = threading.Event()
    t = threading.Thread(
        target=lambda: (
            worker.handle_preemptions(StoreMetadata(preempted={"r"})),
            returned.set(),
        )
    )
    t.start()
    assert not returned.wait(0.2)
    backend.gate.set()
    assert returned.wait(30)
    assert core.backend.get(key(0)) is not None
    worker.close()


def test_lazy_offload_pins_are_released_once_written(tmp_path: Path):
    core, worker, kv, backend = make(tmp_path)
    backend.gate.clear()
    worker.save(StoreMetadata(saves=[SaveSpec(3, [key(3)], pinned=True)]))
    assert worker.take_saved() is None
    backend.gate.set()
    deadline = time.monotonic() + 30
    while (saved := worker.take_saved()) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert saved.done == {3} and not saved.failed
    worker.close()


class _Request:
    def __init__(self, req_id: str, block_hashes: list[bytes]) -> None:
        self.request_id = req_id
        self.block_hashes = block_hashes
        self.num_tokens = self.num_prompt_tokens = len(block_hashes) * BS + 1


def test_scheduler_keeps_the_blocks_of_requests_saved_off_the_forward(
    tmp_path: Path,
):
    """The scheduler side marks the saves of a request with its id, and
    ``request_finished`` then delays freeing its blocks, only with
    ``async_saves`` (a KV cache on an accelerator) and only for requests
    with saves planned; on the CPU nothing changes."""
    store = tmp_path / "store"
    core = StoreCore(
        parse_config({"path": str(store)}), DirectoryBackend(store, 10**9), IDENT, 1
    )
    for async_saves in (False, True):
        scheduler = SchedulerSide(core, BS, worker_hits=False, manager=lambda: None)
        scheduler.async_saves = async_saves
        scheduler.block_ids = lambda req_id: [10, 11, 12]  # type: ignore[method-assign]
        saving = _Request("s", [bytes([i]) * 32 for i in range(2)])
        idle = _Request("i", [bytes([9]) * 32])
        scheduler.arrived(saving)  # type: ignore[arg-type]
        scheduler.arrived(idle)  # type: ignore[arg-type]
        new = SimpleNamespace(req_id="s", num_computed_tokens=0)
        output = SimpleNamespace(
            scheduled_new_reqs=[new],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
            has_sync_kv_loads=True,
            num_scheduled_tokens={"s": 2 * BS + 1},
            preempted_req_ids={"s"},
        )
        meta = scheduler.build_meta(output)  # type: ignore[arg-type]
        assert [s.block_id for s in meta.saves] == [10, 11]
        assert {s.req_id for s in meta.saves} == ({"s"} if async_saves else {None})
        assert meta.preempted == ({"s"} if async_saves else set())
        assert scheduler.finished(saving) is async_saves  # type: ignore[arg-type]
        assert scheduler.finished(idle) is False  # type: ignore[arg-type]


def _step(req_id: str, num_computed: int, scheduled: int) -> SimpleNamespace:
    """A scheduler output with one new request."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=req_id, num_computed_tokens=num_computed)
        ],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        has_sync_kv_loads=False,
        num_scheduled_tokens={req_id: scheduled},
        preempted_req_ids=set(),
    )


def test_blocks_the_prefix_cache_serves_again_are_not_saved_again(
    tmp_path: Path,
):
    """A prompt of 3 blocks and a token, then the same prompt served by
    vLLM's prefix cache (3 blocks computed, 1 token scheduled): its blocks
    were saved for the first request, so the second saves nothing. A prompt
    whose cached prefix this server never saved (a block computed while
    another request decoded) saves it."""
    store = tmp_path / "store"
    core = StoreCore(
        parse_config({"path": str(store)}), DirectoryBackend(store, 10**9), IDENT, 1
    )
    scheduler = SchedulerSide(core, BS, worker_hits=False, manager=lambda: None)
    scheduler.block_ids = lambda req_id: [10, 11, 12]  # type: ignore[method-assign]
    hashes = [bytes([i]) * 32 for i in range(3)]
    for req_id in ("first", "again"):
        scheduler.arrived(_Request(req_id, hashes))  # type: ignore[arg-type]
    meta = scheduler.build_meta(_step("first", 0, 3 * BS + 1))  # type: ignore[arg-type]
    assert [s.block_id for s in meta.saves] == [10, 11, 12]
    meta = scheduler.build_meta(_step("again", 3 * BS, 1))  # type: ignore[arg-type]
    assert meta.saves == []

    decoded = _Request("decoded", [*hashes[:2], bytes([7]) * 32])
    scheduler.arrived(decoded)  # type: ignore[arg-type]
    meta = scheduler.build_meta(_step("decoded", 3 * BS, 1))  # type: ignore[arg-type]
    assert [s.block_id for s in meta.saves] == [12]


def test_vllm_keeps_a_finished_requests_blocks_until_its_saves_are_written(
    tmp_path: Path,
):
    """Under vLLM's real scheduler (``store_delay_free_driver.py``), a
    request computed and finished in one step: on the CPU path its blocks are
    freed at once and nothing is reported; with saves off the forward's path
    they stay held (``delay_free_blocks``) until the worker reports the
    request in ``get_finished``, which it does only once both chunks are
    stored."""
    driver = Path(__file__).resolve().parent / "store_delay_free_driver.py"
    modes = driver_run.run_driver(
        sys.executable, driver, [str(tmp_path / "stores")], tmp_path / "hf"
    )

    sync = modes["sync"]["steps"]
    assert sync[0]["saves"] == [[1, None], [2, None]]
    assert not sync[0]["held"] and sync[0]["free"] and sync[0]["stored"] == 2
    assert all(not step["sending"] for step in sync)

    steps = modes["async"]["steps"]
    assert steps[0]["saves"] == [[1, "r"], [2, "r"]]
    reported = [i for i, step in enumerate(steps) if step["sending"]]
    assert len(reported) == 1 and steps[reported[0]]["sending"] == ["r"]
    assert reported[0] >= 1  # finished_req_ids reach the workers a step later
    assert all(step["held"] and not step["free"] for step in steps[: reported[0]])
    last = steps[reported[0]]
    assert not last["held"] and last["free"] and last["stored"] == 2


def test_pinned_buffer_setting(tmp_path: Path):
    path = str(tmp_path / "store")
    assert parse_config({"path": path}).pinned_buffer_bytes == 256 * 2**20
    assert (
        parse_config({"path": path, "pinned_buffer": "1GiB"}).pinned_buffer_bytes
        == 2**30
    )
    for bad in ("lots", 0, -1, True):
        with pytest.raises(ValueError, match=r"\['pinned_buffer'\] = .*positive size"):
            parse_config({"path": path, "pinned_buffer": bad})

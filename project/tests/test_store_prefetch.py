"""StoreConnector's prefetch for waiting requests, without an engine: the
scheduler side over a real directory store and a real KV tensor, steps driven
by hand. A request still waiting after a step has its stored chunks copied
into the buffer; the step that schedules it reads them there; the buffer
stays under its budget and is empty once no request holds anything (a
request that leaves the queue, finished or aborted, even mid-fetch).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from kvlc_store.backends import DirectoryBackend, Head
from kvlc_store.chunk import HEADER_BYTES
from kvlc_store.config import parse_config
from kvlc_store.core import StoreCore
from kvlc_store.metadata import SaveSpec, StoreMetadata
from kvlc_store.prefetch import DIR_PREFIX, Prefetcher, chunk_file_name
from kvlc_store.scheduler_side import SchedulerSide
from kvlc_store.stats import StoreConnectorStats
from kvlc_store.worker_side import WorkerSide

IDENT = "ident0"
NUM_BLOCKS = 12
BLOCK = 4


class Server:
    """One scheduler side and one worker side (TP 1) over one store."""

    def __init__(self, tmp_path: Path, budget: int, backend: Any = None) -> None:
        store = tmp_path / "store"
        config = parse_config({"path": str(store)})
        self.core = StoreCore(config, DirectoryBackend(store, 10**8), IDENT, 1)
        self.worker = WorkerSide(self.core, BLOCK)
        g = torch.Generator().manual_seed(0)
        self.caches = {
            f"layer.{i}": torch.randn(2, NUM_BLOCKS * BLOCK, 2, 8, generator=g)
            for i in range(2)
        }
        self.worker.register(self.caches, NUM_BLOCKS, 0)
        self.scheduler = SchedulerSide(
            self.core, BLOCK, worker_hits=False, manager=lambda: None
        )
        self.buffer_root = tmp_path / "shm"
        self.buffer_root.mkdir()
        self.prefetcher = Prefetcher(
            backend or DirectoryBackend(store, 10**8),
            budget,
            self.core.stats,
            root=self.buffer_root,
        )
        self.scheduler.prefetcher = self.prefetcher

    def block(self, b: int) -> list[torch.Tensor]:
        return [
            kv[:, b * BLOCK : (b + 1) * BLOCK].clone() for kv in self.caches.values()
        ]

    def store(self, hashes: Sequence[bytes], from_blocks: Sequence[int]) -> None:
        """Save KV blocks ``from_blocks`` as the chunks of ``hashes``."""
        saves = [
            SaveSpec(b, self.core.keys(h))
            for h, b in zip(hashes, from_blocks, strict=True)
        ]
        self.worker.save(StoreMetadata(saves=saves))

    def step(self, scheduled: Sequence[Any] = ()) -> StoreMetadata:
        """The end of one scheduler step that scheduled ``scheduled``."""
        output = SimpleNamespace(
            scheduled_new_reqs=[
                SimpleNamespace(req_id=r.request_id, num_computed_tokens=0)
                for r in scheduled
            ],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
            has_sync_kv_loads=True,
            num_scheduled_tokens={r.request_id: 1 for r in scheduled},
        )
        return self.scheduler.build_meta(output)  # type: ignore[arg-type]

    def schedule(self, request: Any, block_ids: list[int]) -> StoreMetadata:
        """Look ``request`` up, take the whole hit, run the step's loads."""
        offer = self.scheduler.offer(request, 0)
        assert offer is not None
        self.scheduler.commit(request, block_ids, offer, offer.num_tokens)
        meta = self.step([request])
        self.worker.start_load(meta)
        return meta

    def files(self) -> list[str]:
        return sorted(p.name for p in self.prefetcher.dir.iterdir())

    def chunks(self) -> list[str]:
        """The buffer's finished chunks: not a write still in progress (its
        hidden ``.part`` file), which ``files()`` lists too."""
        return [n for n in self.files() if not n.endswith(".part")]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path, budget=10**8)
    yield s
    s.prefetcher.close()


def request(name: str, hashes: Sequence[bytes]) -> Any:
    """A waiting request whose prompt is ``hashes``' blocks and one token."""
    return SimpleNamespace(
        request_id=name,
        block_hashes=list(hashes),
        num_tokens=len(hashes) * BLOCK + 1,
        num_prompt_tokens=len(hashes) * BLOCK + 1,
    )


def hashes(tag: str, n: int) -> list[bytes]:
    return [f"{tag}{i}".encode().ljust(32, b"-") for i in range(n)]


def arrive(server: Server, *requests: Any) -> None:
    for r in requests:
        server.scheduler.arrived(r)  # on_new_request


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def chunk_bytes(server: Server) -> int:
    return HEADER_BYTES + server.worker.layout.block_bytes


def test_waiting_request_loads_from_the_buffer(server: Server):
    hs = hashes("a", 3)
    server.store(hs, [0, 1, 2])
    saved = [server.block(b) for b in (0, 1, 2)]
    r = request("r", hs)
    arrive(server, r)
    server.step()  # r waits: prefetched meanwhile
    wait_for(lambda: len(server.chunks()) == 3, "3 prefetched chunks")
    assert server.prefetcher.used_bytes == 3 * chunk_bytes(server)

    meta = server.schedule(r, [6, 7, 8])
    assert meta.loads[0].num_buffered == 3
    assert meta.buffer_dir == str(server.prefetcher.dir)
    assert server.worker.take_load_errors() == set()
    for b, before in zip((6, 7, 8), saved, strict=True):
        assert all(
            torch.equal(x, y) for x, y in zip(server.block(b), before, strict=True)
        )
    stats = server.core.stats.data
    assert stats["prefetch_loaded_bytes"] == stats["loaded_bytes"] > 0
    assert stats["prefetched_bytes"] == 3 * chunk_bytes(server)

    # Kept while the load may still be in flight, dropped two steps later.
    server.step()
    assert len(server.files()) == 3
    server.step()
    assert server.files() == []
    assert server.prefetcher.used_bytes == 0


def test_buffer_stays_under_its_budget_and_the_rest_loads_from_the_store(
    tmp_path: Path,
):
    probe = Server(tmp_path / "probe", budget=1)
    size = chunk_bytes(probe)
    probe.prefetcher.close()
    server = Server(tmp_path / "real", budget=2 * size + size // 2)
    try:
        hs = hashes("b", 4)
        server.store(hs, [0, 1, 2, 3])
        saved = [server.block(b) for b in range(4)]
        r = request("r", hs)
        arrive(server, r)
        server.step()
        wait_for(lambda: len(server.chunks()) == 2, "2 prefetched chunks")
        time.sleep(0.2)  # the thread waits for space: nothing more comes
        assert len(server.files()) == 2
        assert server.prefetcher.used_bytes == 2 * size

        meta = server.schedule(r, [8, 9, 10, 11])
        assert meta.loads[0].num_buffered == 2
        assert server.worker.take_load_errors() == set()
        for b, before in zip((8, 9, 10, 11), saved, strict=True):
            assert all(
                torch.equal(x, y) for x, y in zip(server.block(b), before, strict=True)
            )
        stats = server.core.stats.data
        assert stats["prefetch_loaded_bytes"] == 2 * size
        assert stats["loaded_bytes"] == 4 * size
    finally:
        server.prefetcher.close()


def test_request_that_leaves_the_queue_drops_its_chunks(server: Server):
    shared = hashes("s", 2)
    server.store(shared + hashes("x", 1) + hashes("y", 1), [0, 1, 2, 3])
    x = request("x", shared + hashes("x", 1))
    y = request("y", shared + hashes("y", 1))
    arrive(server, x, y)
    server.step()
    wait_for(lambda: len(server.chunks()) == 4, "4 prefetched chunks")

    server.scheduler.finished(x)  # aborted while waiting
    # The shared prefix stays for y; x's own block goes.
    names = {
        chunk_file_name(k[0]) for k in map(server.core.keys, shared + hashes("y", 1))
    }
    assert set(server.files()) == names
    server.scheduler.finished(y)
    assert server.files() == []
    assert server.prefetcher.used_bytes == 0


class StallingBackend(DirectoryBackend):
    """A store whose ``peek`` or ``read_into`` (``stall``) waits until ``go``
    is set."""

    def __init__(self, root: Path, stall: str) -> None:
        super().__init__(root, 10**8)
        self.stall = stall
        self.reading = threading.Event()
        self.go = threading.Event()

    def _wait(self, operation: str) -> None:
        if operation == self.stall:
            self.reading.set()
            assert self.go.wait(10)

    def peek(self, keys: Sequence[str], n: int) -> list[Head | None]:
        self._wait("peek")
        return super().peek(keys, n)

    def read_into(
        self,
        keys: Sequence[str],
        head_bytes: int,
        targets: Sequence[Sequence[memoryview]],
    ) -> Iterator[Head | None]:
        self._wait("read_into")
        yield from super().read_into(keys, head_bytes, targets)


@pytest.mark.parametrize("stall", ["peek", "read_into"])
def test_request_aborted_mid_fetch_leaves_nothing(tmp_path: Path, stall: str):
    backend = StallingBackend(tmp_path / "store", stall)
    server = Server(tmp_path, budget=10**8, backend=backend)
    try:
        hs = hashes("m", 2)
        server.store(hs, [0, 1])
        r = request("r", hs)
        arrive(server, r)
        server.step()
        assert backend.reading.wait(10)
        server.scheduler.finished(r)  # while its first chunk is in flight
        backend.go.set()
        time.sleep(0.3)
        assert server.files() == []
        assert server.prefetcher.used_bytes == 0
    finally:
        backend.go.set()
        server.prefetcher.close()


def test_damaged_or_missing_buffer_chunk_is_read_from_the_store(server: Server):
    hs = hashes("d", 2)
    server.store(hs, [0, 1])
    saved = [server.block(b) for b in (0, 1)]
    r = request("r", hs)
    arrive(server, r)
    server.step()
    wait_for(lambda: len(server.chunks()) == 2, "2 prefetched chunks")
    first, second = (server.prefetcher.dir / n for n in server.files())
    data = bytearray(first.read_bytes())
    data[HEADER_BYTES + 3] ^= 0x01
    first.write_bytes(bytes(data))
    second.unlink()

    server.schedule(r, [4, 5])
    assert server.worker.take_load_errors() == set()
    for b, before in zip((4, 5), saved, strict=True):
        assert all(
            torch.equal(x, y) for x, y in zip(server.block(b), before, strict=True)
        )
    stats = server.core.stats.data
    assert stats.get("corrupt_chunks", 0) == 0  # the store's chunks are fine
    assert stats.get("prefetch_loaded_bytes", 0) == 0
    assert all(server.core.backend.get(k[0]) for k in map(server.core.keys, hs))


def test_scheduled_without_a_load_drops_its_chunks(server: Server):
    hs = hashes("n", 2)
    server.store(hs, [0, 1])
    r = request("r", hs)
    arrive(server, r)
    server.step()
    wait_for(lambda: len(server.chunks()) == 2, "2 prefetched chunks")
    server.step([r])  # e.g. found in the local prefix cache: no load
    assert server.files() == []


def test_buffer_of_a_dead_process_is_removed_and_close_removes_its_own(
    tmp_path: Path,
):
    root = tmp_path / "shm"
    root.mkdir()
    dead = root / f"{DIR_PREFIX}999999999-abc"  # no such pid
    dead.mkdir()
    (dead / "chunk").write_bytes(b"x")
    prefetcher = Prefetcher(
        DirectoryBackend(tmp_path / "store", 10**8),
        10**6,
        StoreConnectorStats(),
        root=root,
    )
    assert not dead.exists()
    assert prefetcher.dir.exists()
    prefetcher.close()
    assert list(root.iterdir()) == []


@pytest.mark.parametrize("value", [-1, "lots", True])
def test_config_prefetch_buffer_must_be_a_size(tmp_path: Path, value: object):
    with pytest.raises(ValueError, match="prefetch_buffer"):
        parse_config({"path": str(tmp_path), "prefetch_buffer": value})


def test_config_prefetch_buffer_needs_scheduler_lookups(tmp_path: Path):
    extra = {"path": str(tmp_path), "prefetch_buffer": "1GiB"}
    with pytest.raises(ValueError, match="scheduler_lookup"):
        parse_config({**extra, "scheduler_lookup": False})


def test_config_prefetch_buffer_defaults_to_off(tmp_path: Path):
    assert parse_config({"path": str(tmp_path)}).prefetch_buffer_bytes == 0
    config = parse_config({"path": str(tmp_path), "prefetch_buffer": "1GiB"})
    assert config.prefetch_buffer_bytes == 2**30

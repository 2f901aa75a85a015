"""StoreConnector's asynchronous loads (``load_async``) over a real KV tensor
and a real directory store, without an engine: a load runs on the worker's
thread while the caller goes on, is reported through ``finished_loads``
(vLLM's ``get_finished``) with its failed blocks in the same step, and a
request that finishes while it loads stops at the next block, reports no
errors and releases its lease.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from kvlc_store.async_load import AsyncLoads
from kvlc_store.backends import DirectoryBackend, new_lease_id
from kvlc_store.chunk import HEADER_BYTES
from kvlc_store.config import parse_config
from kvlc_store.core import StoreCore
from kvlc_store.metadata import LoadSpec, SaveSpec, StoreMetadata
from kvlc_store.worker_side import WorkerSide
from test_store_load import BLOCK, IDENT, NUM_BLOCKS, block, key, kv_caches
from test_store_prefetch import StallingBackend


def make(
    tmp_path: Path, backend: DirectoryBackend | None = None
) -> tuple[StoreCore, WorkerSide, dict[str, torch.Tensor]]:
    store = tmp_path / "store"
    config = parse_config({"path": str(store), "load_async": True})
    core = StoreCore(config, backend or DirectoryBackend(store, 10**8), IDENT, 1)
    worker = WorkerSide(core, BLOCK)
    caches = kv_caches()
    worker.register(caches, NUM_BLOCKS, 0)
    return core, worker, caches


def save(worker: WorkerSide, *blocks: int) -> None:
    worker.save(StoreMetadata(saves=[SaveSpec(b, [key(b)]) for b in blocks]))


def leased(core: StoreCore, *blocks: int) -> str:
    lease = new_lease_id()
    keys = [key(b) for b in blocks]
    assert core.backend.lease(keys, lease, 60) == len(keys)
    return lease


def async_load(req_id: str, lease: str, targets: list[int], sources: list[int]):
    return StoreMetadata(
        loads=[
            LoadSpec(
                req_id, lease, targets, [[key(b)] for b in sources], load_async=True
            )
        ]
    )


def test_load_thread_runs_on_the_kv_caches_device(monkeypatch: pytest.MonkeyPatch):
    """A new thread's current CUDA device is 0: the load thread sets the KV
    cache's own, or on TP rank k it would open a context on GPU 0."""
    devices: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    loads = AsyncLoads(lambda spec, buffer_dir, cancelled: set(), torch.device("cuda", 3))
    loads.submit(LoadSpec("r", None, [], [], load_async=True), None)
    deadline = time.monotonic() + 30
    while not loads.take()[0]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    loads.close()
    assert devices == [torch.device("cuda", 3)]


def wait_finished(worker: WorkerSide, finished: set[str] | None = None) -> set[str]:
    """Step until the worker reports a finished load, as vLLM's steps would."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done = worker.finished_loads(finished or set())
        if done:
            return done
        time.sleep(0.01)
    raise AssertionError("no asynchronous load finished in 30 s")


def lease_files(tmp_path: Path) -> list[Path]:
    return list((tmp_path / "store" / "leases").iterdir())


def test_async_load_is_reported_and_exact(tmp_path: Path):
    core, worker, caches = make(tmp_path)
    saved = [block(caches, b) for b in (0, 1)]
    save(worker, 0, 1)
    worker.start_load(async_load("r", leased(core, 0, 1), [4, 5], [0, 1]))
    assert wait_finished(worker) == {"r"}
    assert worker.take_load_errors() == set()
    for b, before in ((4, saved[0]), (5, saved[1])):
        assert all(
            torch.equal(x, y) for x, y in zip(block(caches, b), before, strict=True)
        )
    assert lease_files(tmp_path) == []
    assert core.stats.data["leases_released"] == 1
    worker.close()


def test_failed_blocks_come_with_the_finished_request(tmp_path: Path):
    core, worker, _ = make(tmp_path)
    save(worker, 0, 1)
    path = next((tmp_path / "store" / "chunks").rglob(f"{1:064x}.0"))
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 7] ^= 0x01
    path.write_bytes(bytes(data))
    worker.start_load(async_load("r", leased(core, 0, 1), [3, 4], [0, 1]))
    # Nothing is reported before the request is.
    assert worker.take_load_errors() == set()
    assert wait_finished(worker) == {"r"}
    # In the same step (vLLM calls get_finished, then this).
    assert worker.take_load_errors() == {4}
    assert core.stats.data["load_errors"] == 1
    assert core.stats.data["corrupt_chunks"] == 1
    worker.close()


def test_request_finished_while_loading_stops_and_reports_no_errors(tmp_path: Path):
    stalling = StallingBackend(tmp_path / "store", "read_into")
    core, worker, caches = make(tmp_path, stalling)
    save(worker, 0, 1, 2)
    untouched = block(caches, 5)
    worker.start_load(async_load("r", leased(core, 0, 1, 2), [3, 4, 5], [0, 1, 2]))
    assert stalling.reading.wait(30)
    # The step after the abort: vLLM passes the request in finished_req_ids.
    assert worker.finished_loads({"r", "never-loaded"}) == set()
    stalling.go.set()
    assert wait_finished(worker) == {"r"}
    assert worker.take_load_errors() == set()
    assert "load_errors" not in core.stats.data
    # It stopped before the last block and gave its lease back.
    assert all(
        torch.equal(x, y) for x, y in zip(block(caches, 5), untouched, strict=True)
    )
    assert lease_files(tmp_path) == []
    worker.close()


def test_loads_run_in_order_beside_the_caller(tmp_path: Path):
    """The caller is not held while a load waits; two loads finish in the
    order they were scheduled."""
    stalling = StallingBackend(tmp_path / "store", "read_into")
    core, worker, _ = make(tmp_path, stalling)
    save(worker, 0, 1, 2)
    worker.start_load(async_load("first", leased(core, 0, 1), [3, 4], [0, 1]))
    worker.start_load(async_load("second", leased(core, 2), [5], [2]))
    assert stalling.reading.wait(30)
    assert worker.finished_loads(set()) == set()  # "first" is held in its read
    stalling.go.set()
    done = wait_finished(worker)
    if done == {"first"}:
        done |= wait_finished(worker)
    assert done == {"first", "second"}
    assert lease_files(tmp_path) == []
    worker.close()


@pytest.mark.parametrize(
    "extra, fix",
    [
        ({"scheduler_lookup": False}, "set it to false or scheduler_lookup"),
        ({"prefetch_buffer": "1GiB"}, "set prefetch_buffer to 0"),
        ({"load_async": "sometimes"}, "set true or false"),
    ],
)
def test_bad_load_async_settings_name_the_fix(tmp_path: Path, extra, fix):
    settings = {"path": str(tmp_path), "load_async": True, **extra}
    with pytest.raises(ValueError, match="load_async") as e:
        parse_config(settings)
    assert fix in str(e.value)

"""StoreConnector's worker side over a real KV tensor and a real store,
without an engine: a load reads each chunk once, straight into the KV cache,
and a chunk damaged after the lookup checked its header fails at load, is
deleted and reported as a load error (vLLM then recomputes the block); a
store that fails mid-load (host path and the batched path of a KV cache on
an accelerator) loads the blocks before the failure, counts it and backs
off; each TP rank loads its own KV.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from kvlc_store import core as core_module
from kvlc_store.backends import DirectoryBackend, directory, new_lease_id
from kvlc_store.chunk import FORMAT_VERSION, HEADER_BYTES
from kvlc_store.config import parse_config
from kvlc_store.core import StoreCore, store_identity
from kvlc_store.metadata import LoadSpec, SaveSpec, StoreMetadata
from kvlc_store.scheduler_side import SchedulerSide
from kvlc_store.worker_side import WorkerSide
from test_store_device_transfer import wait_finished

IDENT = "ident0"
NUM_BLOCKS = 6
BLOCK = 4


def kv_caches(seed: int = 0) -> dict[str, torch.Tensor]:
    """Two layers in the ``[2, num_blocks * block, heads, dim]`` layout (K
    and V apart, as vLLM's CPU backend has them), random bf16 content."""
    g = torch.Generator().manual_seed(seed)
    return {
        f"layer.{i}": torch.randn(2, NUM_BLOCKS * BLOCK, 2, 8, generator=g).to(
            torch.bfloat16
        )
        for i in range(2)
    }


def make(
    tmp_path: Path, rank: int = 0, tp_size: int = 1
) -> tuple[StoreCore, WorkerSide, dict[str, torch.Tensor]]:
    # 64 KiB of host memory for the batched path: 128 of these blocks, none
    # kept (host_tier 0), so every load reads the store
    # (test_store_host_tier.py has the tier).
    config = parse_config(
        {"path": str(tmp_path / "store"), "pinned_buffer": 2**16, "host_tier": 0}
    )
    store = DirectoryBackend(tmp_path / "store", 10**8)
    core = StoreCore(config, store, IDENT, tp_size)
    worker = WorkerSide(core, BLOCK)
    caches = kv_caches(seed=rank)
    worker.register(caches, NUM_BLOCKS, rank)
    return core, worker, caches


def key(i: int) -> str:
    return f"{IDENT}/{i:064x}.0"


def block(caches: dict[str, torch.Tensor], b: int) -> list[torch.Tensor]:
    return [kv[:, b * BLOCK : (b + 1) * BLOCK].clone() for kv in caches.values()]


def test_save_then_load_into_other_blocks_is_exact(tmp_path: Path):
    core, worker, caches = make(tmp_path)
    saved = [block(caches, b) for b in (0, 1)]
    worker.save(StoreMetadata(saves=[SaveSpec(0, [key(0)]), SaveSpec(1, [key(1)])]))
    worker.start_load(
        StoreMetadata(
            loads=[LoadSpec("r", None, [4, 5], [[key(0)], [key(1)]])],
            sync_loads_first=True,
        )
    )
    assert worker.take_load_errors() == set()
    for b, before in ((4, saved[0]), (5, saved[1])):
        assert all(
            torch.equal(x, y) for x, y in zip(block(caches, b), before, strict=True)
        )
    assert core.stats.data["loaded_bytes"] > 0


def test_corruption_found_at_load_is_a_load_error(tmp_path: Path):
    core, worker, caches = make(tmp_path)
    worker.save(StoreMetadata(saves=[SaveSpec(b, [key(b)]) for b in (0, 1)]))
    path = next(p for p in (tmp_path / "store" / "chunks").rglob(f"{1:064x}.0"))
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 7] ^= 0x01  # one payload bit: the header stays right
    path.write_bytes(bytes(data))

    # The lookup reads headers only: it offers both blocks.
    scheduler = SchedulerSide(core, BLOCK, worker_hits=False, manager=lambda: None)
    assert scheduler._checked_prefix([[key(0)], [key(1)]]) == 2
    lease = new_lease_id()
    assert core.backend.lease([key(0), key(1)], lease, 60) == 2

    worker.start_load(
        StoreMetadata(
            loads=[LoadSpec("r", lease, [3, 4], [[key(0)], [key(1)]])],
            sync_loads_first=True,
        )
    )
    # Block 4 (the damaged chunk) fails; vLLM recomputes it from there.
    assert worker.take_load_errors() == {4}
    assert core.stats.data["corrupt_chunks"] == 1
    assert core.stats.data["load_errors"] == 1
    assert not path.exists()  # deleted: the recompute stores it again
    assert core.backend.get(key(0)) is not None


def test_sync_load_in_a_step_not_flagged_for_it_fails_its_blocks(tmp_path: Path):
    """vLLM starts a step's loads before the forward only when the step has
    ``has_sync_kv_loads``; a synchronous load without it would be read by
    the forward before it lands, so its blocks fail (recomputed under
    ``recompute``) and stay untouched, and its lease is released."""
    core, worker, caches = make(tmp_path)
    worker.save(StoreMetadata(saves=[SaveSpec(b, [key(b)]) for b in (0, 1)]))
    lease = new_lease_id()
    assert core.backend.lease([key(0), key(1)], lease, 60) == 2
    before = [block(caches, b) for b in (3, 4)]

    worker.start_load(
        StoreMetadata(loads=[LoadSpec("r", lease, [3, 4], [[key(0)], [key(1)]])])
    )
    assert worker.take_load_errors() == {3, 4}
    for b, old in zip((3, 4), before, strict=True):
        assert all(
            torch.equal(x, y) for x, y in zip(block(caches, b), old, strict=True)
        )
    assert list((tmp_path / "store" / "leases").iterdir()) == []


def test_kv_cache_off_the_host_goes_through_the_host_pool(tmp_path: Path):
    """The path of a KV cache on an accelerator, run on host tensors: saves
    gathered into the host pool and written by the save thread, loads read
    into the pool and scattered (test_store_device_transfer.py has more)."""
    core, worker, caches = make(tmp_path)
    worker.start_batched_transfers()
    saved = block(caches, 2)
    worker.save(StoreMetadata(saves=[SaveSpec(2, [key(2)], req_id="w")]))
    worker.finished_saves({"w"})
    wait_finished(worker, "w")
    worker.start_load(
        StoreMetadata(
            loads=[LoadSpec("r", None, [5], [[key(2)]])], sync_loads_first=True
        )
    )
    assert worker.take_load_errors() == set()
    assert all(torch.equal(x, y) for x, y in zip(block(caches, 5), saved, strict=True))


def test_chunks_of_another_format_live_under_other_keys(monkeypatch):
    """The store identity (every key's prefix) includes the chunk format:
    a server never looks up chunks an older connector wrote."""
    config = SimpleNamespace(
        model_config=SimpleNamespace(
            model="m",
            revision=None,
            dtype="bfloat16",
            hf_config=SimpleNamespace(to_dict=dict),
            hf_overrides={},
            quantization=None,
        ),
        cache_config=SimpleNamespace(
            block_size=16,
            prefix_caching_hash_algo="sha256",
            cache_dtype="auto",
            kv_cache_dtype_skip_layers=[],
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    kv_cache_config = SimpleNamespace(kv_cache_groups=[])
    now = store_identity(config, kv_cache_config, None)  # type: ignore[arg-type]
    monkeypatch.setattr(core_module, "FORMAT_VERSION", FORMAT_VERSION - 1)
    assert store_identity(config, kv_cache_config, None) != now  # type: ignore[arg-type]
    monkeypatch.setattr(core_module, "FORMAT_VERSION", FORMAT_VERSION)
    # Nor chunks keyed by an earlier identity scheme (the model's path).
    monkeypatch.setattr(
        core_module, "IDENTITY_VERSION", core_module.IDENTITY_VERSION - 1
    )
    assert store_identity(config, kv_cache_config, None) != now  # type: ignore[arg-type]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def loading(*loads: LoadSpec) -> StoreMetadata:
    """The metadata of a step with ``loads``, one that vLLM flagged
    ``has_sync_kv_loads`` (its runner starts the loads before the forward)."""
    return StoreMetadata(loads=list(loads), sync_loads_first=True)


@pytest.mark.parametrize("path", ["host", "batched"])
@pytest.mark.parametrize("err", [errno.EIO, errno.EACCES], ids=errno.errorcode.get)
def test_store_failing_mid_load_loads_the_blocks_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str, err: int
):
    """The store fails on the second of four chunks (it cannot open that
    file): the first block is loaded, the other three are load errors and
    keep what they held (vLLM recomputes them), the failure is counted
    (``store_errors``) and the store backed off from, nothing is taken for
    a damaged chunk. ``batched``: the path of a KV cache on an accelerator
    (chunks read into the host pool by several threads, then copied)."""
    core, worker, caches = make(tmp_path)
    if path == "batched":
        worker.start_batched_transfers()
    saved = [block(caches, b) for b in range(4)]
    worker.save(
        StoreMetadata(saves=[SaveSpec(b, [key(b)], req_id="s") for b in range(4)])
    )
    worker.finished_saves({"s"})
    deadline = time.monotonic() + 30
    while core.stats.data.get("stored_chunks", 0) < 4:
        assert time.monotonic() < deadline, "saves never written"
        time.sleep(0.01)
    worker.finished_saves(set())
    real_open = os.open

    def failing(file: Any, flags: int, *args: Any) -> int:
        if str(file).endswith(f"{1:064x}.0"):
            raise OSError(err, os.strerror(err))
        return real_open(file, flags, *args)

    monkeypatch.setattr(directory.os, "open", failing)
    before = [block(caches, b) for b in (2, 3, 4, 5)]
    worker.start_load(
        loading(LoadSpec("r", None, [2, 3, 4, 5], [[key(b)] for b in range(4)]))
    )
    assert worker.take_load_errors() == {3, 4, 5}
    assert same(block(caches, 2), saved[0])
    for b, held in zip((3, 4, 5), before[1:], strict=True):
        assert same(block(caches, b), held)
    assert core.stats.data["store_errors"] == 1
    assert core.stats.data["load_errors"] == 3
    assert "corrupt_chunks" not in core.stats.data
    assert not core.usable() and not core.usable("write")
    monkeypatch.undo()
    assert all(core.backend.get(key(b)) is not None for b in range(4))
    worker.close()


def test_each_tp_rank_loads_its_own_kv(tmp_path: Path):
    """Two TP ranks save the same block (same tokens, each its own heads)
    to one store; each loads its own KV back, not the other's."""
    ranks = [make(tmp_path, rank, tp_size=2) for rank in (0, 1)]
    # The block's keys, as the scheduler side hands them to every rank.
    keys = ranks[0][0].keys(bytes([7]) * 32)
    for _, worker, _ in ranks:
        worker.save(StoreMetadata(saves=[SaveSpec(0, keys)]))
    for _, worker, caches in ranks:
        saved = block(caches, 0)
        worker.start_load(loading(LoadSpec("r", None, [3], [keys])))
        assert worker.take_load_errors() == set()
        assert same(block(caches, 3), saved)

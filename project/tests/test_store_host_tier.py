"""The host tier (``host_tier``): chunks kept in host memory in front of the
store, on CPU tensors (the same code moves a GPU's blocks with vLLM's
``swap_blocks_batch`` through pinned memory).

Checked: a slot's bytes are the per-block payload for every layout and dtype
that pointer copies move; its eviction order, pins and waits; and on a
worker over a real directory store, that a saved chunk loads again without
reading the store, that an evicted one is read from the store and kept
again, that a damaged store copy is never what a cached chunk loads, that a
chunk the store did not take is not kept, that a load that raises leaves no
slot pinned, that ``host_tier: 0`` keeps nothing, and that a store failing
mid-load ends the load there and counts only what loaded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from kvlc_store.backends import BackendUnavailable, Head
from kvlc_store.chunk import HEADER_BYTES
from kvlc_store.connector import StoreConnector
from kvlc_store.device_transfer import DeviceTransfer
from kvlc_store.host_tier import HostTier
from kvlc_store.metadata import LoadSpec, SaveSpec, StoreMetadata
from kvlc_store.transfer import BlockLayout
from kvlc_store.worker_side import WorkerSide
from test_store_device_transfer import (
    BS,
    DEVICES,
    DTYPES,
    LAYOUTS,
    NB,
    caches,
    key,
    make,
    payloads,
    raw,
    wait_finished,
)

POINTER_LAYOUTS = [name for name in LAYOUTS if name != "hnd-strided"]


def test_kv_layout_is_offloading_connectors_and_the_cpu_backends():
    """Every server on one store moves blocks in one layout (a chunk is a
    block as the connector sees it): the one OffloadingConnector asks for,
    so MultiConnector can put vLLM's CPU tier in front of the store, and the
    only one vLLM's CPU attention has."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.kv_cache_layout import KVCacheLayout

    config: Any = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=None)
    )
    layout = StoreConnector.get_required_kvcache_layout(config)
    assert layout is not None
    assert layout == OffloadingConnector.get_required_kvcache_layout(config)
    assert KVCacheLayout[layout] in (
        CPUAttentionBackend.supported_kv_cache_layouts() or ()
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", POINTER_LAYOUTS)
def test_slots_hold_the_per_block_payload_both_ways(
    layout: str, dtype: torch.dtype, device: str
):
    """Blocks copied into slots hold ``BlockLayout.staged``'s bytes; slots
    copied into other blocks leave the KV cache as ``unstage`` does."""
    kv = caches(layout, dtype, 1, device)
    reference = BlockLayout(kv, NB)
    transfer = DeviceTransfer(reference, 64 * reference.block_bytes)
    tier = HostTier(8 * reference.block_bytes, reference.block_bytes, False, True)
    slots = tier.reserve(2, wait=False)
    ids = [5, 2]
    transfer.wait(transfer.save_to(ids, [tier.addr(s) for s in slots], None))
    staged = [reference.staged(b) for b in ids]
    for slot, payload in zip(slots, staged, strict=True):
        assert bytes(tier.view(slot)) == bytes(payload.numpy())

    expected = caches(layout, dtype, 1, device)
    unstaged = BlockLayout(expected, NB)
    for b, payload in zip((0, 6), staged, strict=True):
        unstaged.unstage(b, payload)
    transfer.wait(transfer.load_from([0, 6], [tier.addr(s) for s in slots]))
    assert raw(kv) == raw(expected)


def test_least_recently_used_unpinned_slot_is_reused_first():
    tier = HostTier(8, 1, pin=False, cache=True)
    assert (tier.capacity, tier.max_batch) == (8, 2)
    for n in range(4):  # 8 chunks: a..h, two per batch
        slots = tier.reserve(2, wait=False)
        for slot, name in zip(slots, "abcdefgh"[2 * n :], strict=False):
            tier.publish(name, slot)
        tier.unpin(slots)
    assert len(tier) == 8
    used = tier.pin_cached(["a", "z"])  # a is now the most recently used
    assert used[1] is None
    tier.unpin([s for s in used if s is not None])
    held = tier.pin_cached(["b"])  # b pinned: not reusable
    fresh = tier.reserve(2, wait=False)
    assert len(fresh) == 2
    assert tier.pin_cached(["c", "d"]) == [None, None]  # c, d gave their slots
    assert all(s is not None for s in tier.pin_cached(["a", "b", "e"]))
    tier.unpin(held)


def test_a_slot_pinned_twice_is_free_only_after_both_unpin():
    """Two loads copy one chunk out of its slot while a save publishes the
    key in another slot: the old slot is handed out again only once both
    loads unpinned it."""
    tier = HostTier(8, 1, pin=False, cache=True)
    a, b = tier.reserve(2, wait=False)
    tier.publish("k", a)
    tier.unpin([a, b])
    assert tier.pin_cached(["k", "k"]) == [a, a]
    (c,) = tier.reserve(1, wait=False)
    tier.publish("k", c)
    tier.unpin([c])
    tier.unpin([a])
    taken = [s for _ in range(4) for s in tier.reserve(2, wait=False)]
    assert a not in taken and len(taken) == 7  # every other slot
    tier.unpin([a])
    assert tier.reserve(2, wait=False) == [a]


def test_unpublished_slot_is_free_again_and_a_waiter_gets_it():
    tier = HostTier(8, 1, pin=False, cache=False)
    taken = [tier.reserve(2, wait=False) for _ in range(4)]
    assert tier.reserve(1, wait=False) == []
    got: list[list[int]] = []
    waiter = threading.Thread(target=lambda: got.append(tier.reserve(1, wait=True)))
    waiter.start()
    time.sleep(0.1)
    assert not got
    tier.publish("k", taken[0][0])  # without cache: nothing kept
    tier.unpin(taken[0])
    waiter.join(5)
    assert got and len(got[0]) == 1
    assert tier.pin_cached(["k"]) == [None]


def test_slot_a_load_copies_from_stays_its_own_when_the_key_is_saved_again():
    """A load copies key k out of its slot while a save of k publishes it in
    a fresh slot: the old slot is not handed to any writer (whose bytes the
    load would copy) until the load lets go of it."""
    tier = HostTier(8, 1, pin=False, cache=True)
    old = tier.reserve(1, wait=False)
    tier.publish("k", old[0])
    tier.unpin(old)
    loading = tier.pin_cached(["k"])
    assert loading == old
    fresh = tier.reserve(1, wait=False)
    tier.publish("k", fresh[0])
    tier.unpin(fresh)
    taken = [slot for _ in range(4) for slot in tier.reserve(2, wait=False)]
    assert len(taken) == 7 and old[0] not in taken
    tier.unpin(loading)
    assert tier.reserve(1, wait=False) == old


def keys(block: int, ranks: int) -> list[str]:
    """The chunk keys of ``block``, one per TP rank."""
    return [key(block, rank) for rank in range(ranks)]


def saved(
    worker: WorkerSide, blocks: range | list[int], req_id: str, ranks: int = 1
) -> None:
    worker.save(
        StoreMetadata(
            saves=[SaveSpec(b, keys(b, ranks), req_id=req_id) for b in blocks]
        )
    )
    worker.finished_saves({req_id})
    wait_finished(worker, req_id)


def load(
    worker: WorkerSide, targets: list[int], sources: list[int], ranks: int = 1
) -> set[int]:
    spec = LoadSpec("q", None, targets, [keys(b, ranks) for b in sources])
    worker.start_load(StoreMetadata(loads=[spec], sync_loads_first=True))
    return worker.take_load_errors()


class CountingReads:
    """Counts the chunks a worker reads from its store."""

    def __init__(self, worker: WorkerSide, monkeypatch: pytest.MonkeyPatch) -> None:
        self.keys: list[str] = []
        backend = worker._core.backend
        read_into = backend.read_into

        def counting(
            keys: Sequence[str], skip: int, targets: Sequence[Sequence[memoryview]]
        ) -> Iterator[Head | None]:
            self.keys += list(keys)
            return read_into(keys, skip, targets)

        monkeypatch.setattr(backend, "read_into", counting)


def test_saved_chunks_load_from_the_tier_without_reading_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    core, worker, kv, _ = make(tmp_path, tier_blocks=8)
    before = payloads(kv, range(5))
    saved(worker, range(5), "r")
    reads = CountingReads(worker, monkeypatch)
    assert load(worker, [6, 5], [0, 3]) == set()
    assert payloads(kv, [6, 5]) == [before[0], before[3]]
    assert reads.keys == []
    bb = BlockLayout(kv, NB).block_bytes
    assert core.stats.data["host_tier_loaded_bytes"] == 2 * bb
    assert core.stats.data["loaded_bytes"] == 2 * (HEADER_BYTES + bb)
    worker.close()


def test_loaded_tokens_are_counted_by_where_they_came_from(tmp_path: Path):
    """``host_tier_loaded_tokens`` and ``store_loaded_tokens``: what
    ``gpu_ttft.py`` records to tell a hot hit (the tier) from a cold one (a
    fresh server on the same store, its tier empty)."""
    core, worker, kv, _ = make(tmp_path, tier_blocks=8)
    saved(worker, range(3), "r")
    core.stats.take()
    assert load(worker, [4, 5], [0, 1]) == set()
    counted = core.stats.take()
    assert counted is not None
    assert counted.data["host_tier_loaded_tokens"] == 2 * BS
    assert "store_loaded_tokens" not in counted.data

    cold_core, cold, _, _ = make(tmp_path, tier_blocks=8)
    assert load(cold, [4, 5, 6], [0, 1, 2]) == set()
    counted = cold_core.stats.take()
    assert counted is not None
    assert counted.data["store_loaded_tokens"] == 3 * BS
    assert "host_tier_loaded_tokens" not in counted.data
    assert load(cold, [3], [2]) == set()  # kept in its tier by the read
    counted = cold_core.stats.take()
    assert counted is not None and counted.data == {
        "host_tier_loaded_bytes": BlockLayout(kv, NB).block_bytes,
        "loaded_bytes": HEADER_BYTES + BlockLayout(kv, NB).block_bytes,
        "host_tier_loaded_tokens": BS,
    }
    worker.close()
    cold.close()


def test_only_rank_0_counts_loaded_tokens(tmp_path: Path):
    """Every rank loads the same tokens (its own heads of them): a rank
    other than 0 counts its bytes, not the tokens, or TP=2 would report
    twice the tokens the scheduler asked for."""
    core, worker, _, _ = make(tmp_path, tier_blocks=8, rank=1)
    saved(worker, range(3), "r", ranks=2)
    core.stats.take()
    assert load(worker, [4, 5, 6], [0, 1, 2], ranks=2) == set()
    hot = core.stats.take()
    assert hot is not None
    assert hot.data["host_tier_loaded_bytes"] > 0
    assert "host_tier_loaded_tokens" not in hot.data
    cold_core, cold, _, _ = make(tmp_path, tier_blocks=8, rank=1)
    assert load(cold, [4, 5, 6], [0, 1, 2], ranks=2) == set()
    from_store = cold_core.stats.take()
    assert from_store is not None
    assert from_store.data["loaded_bytes"] > 0
    assert "store_loaded_tokens" not in from_store.data
    worker.close()
    cold.close()


def test_evicted_chunk_is_read_from_the_store_and_kept_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A tier of 8 chunks holding 7 saved ones: two more evict the least
    recently used; loading it reads the store once and keeps it again."""
    core, worker, kv, _ = make(tmp_path, tier_blocks=8)
    before = payloads(kv, range(7))
    saved(worker, range(7), "r")
    tier = worker._tier
    assert tier is not None and len(tier) == 7
    reads = CountingReads(worker, monkeypatch)
    assert load(worker, [6], [0]) == set()  # a hit: 0 is the most recent now
    assert reads.keys == []
    slots = tier.reserve(2, wait=False)  # the free slot, then 1's
    for name, slot in zip(("other/a", "other/b"), slots, strict=True):
        tier.publish(name, slot)
    tier.unpin(slots)
    assert tier.pin_cached([key(1)]) == [None]
    assert load(worker, [5], [1]) == set()
    assert reads.keys == [key(1)]
    assert payloads(kv, [5]) == [before[1]]
    assert load(worker, [4], [1]) == set()  # kept: no second read
    assert reads.keys == [key(1)]
    worker.close()


def test_damaged_store_copy_of_a_cached_chunk_is_never_loaded(tmp_path: Path):
    """The tier holds what the save copied from the KV cache: a store copy
    damaged afterwards changes nothing for this worker; a chunk only in the
    store is checked when read, as without the tier."""
    core, worker, kv, _ = make(tmp_path, tier_blocks=8)
    before = payloads(kv, [0, 1])
    saved(worker, [0, 1], "r")
    path = next((tmp_path / "store" / "chunks").rglob(f"{1:064x}.0"))
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 9] ^= 0x10
    path.write_bytes(bytes(data))
    assert load(worker, [3, 4], [0, 1]) == set()
    assert payloads(kv, [3, 4]) == before

    reader_core, reader, reader_kv, _ = make(tmp_path, tier_blocks=8)
    untouched = payloads(reader_kv, [4])
    assert load(reader, [3, 4], [0, 1]) == {4}
    assert payloads(reader_kv, [4]) == untouched
    assert reader_core.stats.data["corrupt_chunks"] == 1
    worker.close()
    reader.close()


def test_chunk_whose_store_write_failed_is_not_kept(tmp_path: Path):
    """A chunk the store did not take is never offered: the tier does not
    keep it, and a chunk it held before stays (nothing pushed it out)."""
    core, worker, kv, backend = make(tmp_path, tier_blocks=8)
    saved(worker, [1], "before")
    backend.fail = True
    saved(worker, [2, 3], "r")
    assert core.stats.data["store_errors"] >= 1
    assert backend.get(key(2)) is None
    tier = worker._tier
    assert tier is not None
    assert tier.pin_cached([key(2), key(3)]) == [None, None]
    assert len(tier) == 1
    assert tier.reserve(tier.max_batch, wait=False) != []
    worker.close()


def test_a_load_that_raises_unpins_its_slots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """An error other than the store's (here a read that raises, as a bug or
    an I/O error outside the backend would) ends the load, and every slot it
    pinned, cached or fresh, is free for the next load and save."""
    core, worker, kv, _ = make(tmp_path, tier_blocks=8)
    saved(worker, [0, 1], "r")
    tier = worker._tier
    assert tier is not None

    def broken(*args: Any, **kwargs: Any) -> Iterator[Head | None]:
        raise RuntimeError("injected")

    monkeypatch.setattr(core.backend, "read_into", broken)
    with pytest.raises(RuntimeError, match="injected"):
        load(worker, [4, 5, 6], [0, 2, 1])
    assert not +tier._pins
    assert len(tier.reserve(tier.max_batch, wait=False)) == tier.max_batch
    worker.close()


def test_host_tier_zero_keeps_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    core, worker, kv, _ = make(tmp_path, tier_blocks=0)
    saved(worker, [0, 1], "r")
    assert worker._tier is not None and len(worker._tier) == 0
    reads = CountingReads(worker, monkeypatch)
    assert load(worker, [4, 5], [0, 1]) == set()
    assert sorted(reads.keys) == [key(0), key(1)]
    assert core.stats.data.get("host_tier_loaded_bytes", 0) == 0
    worker.close()


def test_a_store_failing_mid_read_ends_the_load_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Chunks 0-3 stored, only 1 cached: a store that fails on the read of
    chunk 2 ends the load after block 1 (the cached hit before it still
    loads), counts the failure and backs off."""
    core, worker, kv, _ = make(tmp_path, tier_blocks=0)
    before = payloads(kv, range(4))
    saved(worker, range(4), "r")
    assert worker._tier is not None
    tier = worker._tier
    tier.cache = True
    slots = tier.reserve(1, wait=False)
    tier.view(slots[0])[:] = before[1]
    tier.publish(key(1), slots[0])
    tier.unpin(slots)
    backend = core.backend
    read_into = backend.read_into

    def failing(
        keys: Sequence[str], skip: int, targets: Sequence[Sequence[memoryview]]
    ) -> Iterator[Head | None]:
        for k, head in zip(keys, read_into(keys, skip, targets), strict=False):
            if k == key(2):
                raise BackendUnavailable("injected")
            yield head

    monkeypatch.setattr(backend, "read_into", failing)
    errors = load(worker, [4, 5, 6, 0], [0, 1, 2, 3])
    assert errors == {6, 0}
    assert payloads(kv, [4, 5]) == [before[0], before[1]]
    assert core.stats.data["store_errors"] == 1
    assert not core.usable()
    worker.close()


def test_a_store_failing_mid_load_counts_only_what_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """One batch of five chunks, 0 and 2 cached: 0 (cached) and 1 (read)
    load, the store fails on 3, and 5 (not read) and 2 (cached) after it do
    not load, nor 4 (cached) in the batch that never starts. Every counter
    is what loaded: one block from the tier, one from the store; none
    negative, none for a block after the failure."""
    _, writer, kv, _ = make(tmp_path, tier_blocks=20)
    before = payloads(kv, range(6))
    saved(writer, range(6), "r")
    writer.close()
    core, worker, kv, backend = make(tmp_path, tier_blocks=20)
    assert load(worker, [6, 5, 4], [0, 2, 4]) == set()  # now in its tier
    core.stats.take()
    read_into = backend.read_into

    def failing(
        keys: Sequence[str], skip: int, targets: Sequence[Sequence[memoryview]]
    ) -> Iterator[Head | None]:
        for k, head in zip(keys, read_into(keys, skip, targets), strict=False):
            if k == key(3):
                raise BackendUnavailable("injected")
            yield head

    monkeypatch.setattr(backend, "read_into", failing)
    errors = load(worker, [6, 5, 4, 3, 2, 1], [0, 1, 3, 5, 2, 4])
    assert errors == {4, 3, 2, 1}
    assert payloads(kv, [6, 5]) == before[:2]
    counted = core.stats.take()
    assert counted is not None
    assert all(value >= 0 for value in counted.data.values()), counted.data
    bb = BlockLayout(kv, NB).block_bytes
    assert counted.data == {
        "host_tier_loaded_bytes": bb,
        "host_tier_loaded_tokens": BS,
        "store_loaded_tokens": BS,
        "loaded_bytes": 2 * (HEADER_BYTES + bb),
        "store_errors": 1,
        "load_errors": 4,
    }
    worker.close()

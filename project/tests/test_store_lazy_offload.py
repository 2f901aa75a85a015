"""Lazy offload's scheduler side (kvlc_store.offload.LazyOffload) against the
stack's real SchedulerContext over a real BlockPool."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

scheduler_context = pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.scheduler_context",
    reason="needs the stack's scheduler-context entry",
)

from kvlc_store.offload import LazyOffload, SavedBlocks  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    KVCacheBlock,
    init_none_hash,
    make_block_hash_with_group_id,
)

BLOCK_SIZE = 16


@pytest.fixture(autouse=True)
def _init_none_hash() -> None:
    init_none_hash(sha256)


class CountingContext(scheduler_context.KVConnectorSchedulerContext):
    """Counts the blocks iter_free_blocks() yields, to bound a step's scan."""

    yielded = 0

    def iter_free_blocks(self) -> Iterator[Any]:
        for block in super().iter_free_blocks():
            self.yielded += 1
            yield block


def plain_hash(block_id: int) -> bytes:
    return sha256(("block", block_id))


def make_pool(num_blocks: int = 10) -> tuple[BlockPool, CountingContext]:
    pool = BlockPool(
        num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=BLOCK_SIZE
    )
    return pool, CountingContext(pool)


def cache_and_free(pool: BlockPool, num_blocks: int) -> list[KVCacheBlock]:
    """Allocate blocks, give each a prefix-cache entry (as cache_full_blocks
    does) and free them: they go to the free queue's far end, cached."""
    blocks = pool.get_new_blocks(num_blocks)
    for block in blocks:
        key = make_block_hash_with_group_id(plain_hash(block.block_id), 0)
        pool._insert_block_hash(key, block, num_tokens=None)
    pool.free_blocks(blocks)
    return blocks


def free_queue(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def plan(lazy: LazyOffload) -> list[int]:
    saves: list[tuple[int, bytes]] = []
    lazy.plan(lambda block_id, block_hash: saves.append((block_id, block_hash)))
    for block_id, block_hash in saves:
        assert block_hash == plain_hash(block_id)
    return [block_id for block_id, _ in saves]


def test_only_the_eviction_end_is_stored_and_pinned_until_saved():
    pool, context = make_pool()
    cache_and_free(pool, 6)  # free queue: 7 8 9 (uncached) 1..6 (cached)
    assert free_queue(pool) == [7, 8, 9, 1, 2, 3, 4, 5, 6]
    lazy = LazyOffload(context, window=5, known_stored=100)

    assert plan(lazy) == [1, 2]
    assert lazy.num_pinned == 2
    # Pinned: neither allocatable nor evicted, and still prefix-cache hits.
    assert free_queue(pool) == [7, 8, 9, 3, 4, 5, 6]
    assert all(b.block_id not in (1, 2) for b in pool.get_new_blocks(7))
    assert pool.blocks[1].block_hash is not None
    assert plan(lazy) == []  # Nothing pinned twice, nothing else in reach.

    lazy.on_saved(SavedBlocks(done={1, 2}))
    assert lazy.num_pinned == 0
    assert pool.blocks[1].ref_cnt == 0 and pool.blocks[2].ref_cnt == 0
    assert free_queue(pool)[-2:] == [1, 2]


def test_each_step_scans_only_the_window_and_skips_stored_blocks():
    pool, context = make_pool(12)
    cache_and_free(pool, 8)  # free queue: 9 10 11 1..8
    lazy = LazyOffload(context, window=4, known_stored=100)
    for block_id in (1, 2, 3, 4, 5, 6, 7, 8):
        if block_id != 2:
            lazy.mark_stored(plain_hash(block_id))

    assert plan(lazy) == []  # 9 10 11 1: none to save
    assert context.yielded == 4
    assert plan(lazy) == []
    assert context.yielded == 8  # The window again, no further.

    pool.get_new_blocks(2)  # 9 and 10 leave from the eviction end.
    assert plan(lazy) == [2]  # 11 1 2 3: 2 is pinned.
    assert context.yielded == 12


def test_failed_save_is_released_and_tried_again():
    pool, context = make_pool()
    cache_and_free(pool, 3)  # free queue: 4..9 (uncached) 1 2 3
    lazy = LazyOffload(context, window=7, known_stored=100)
    assert plan(lazy) == [1]
    lazy.on_saved(SavedBlocks(done={1}, failed={1}))
    assert lazy.num_pinned == 0 and pool.blocks[1].ref_cnt == 0
    # Block 1 went back to the far end; not known as stored, so when the
    # window reaches it again it is pinned again.
    assert free_queue(pool) == [4, 5, 6, 7, 8, 9, 2, 3, 1]
    pool.get_new_blocks(6)
    assert plan(lazy) == [2, 3, 1]


def test_the_window_follows_blocks_taken_from_it():
    pool, context = make_pool()
    cache_and_free(pool, 2)  # free queue: 3..9 (uncached) 1 2
    lazy = LazyOffload(context, window=3, known_stored=100)
    assert plan(lazy) == []  # examined 3 4 5
    pool.touch([pool.blocks[5]])  # A request takes block 5.
    pool.get_new_blocks(5)  # 3 4 6 7 8 leave too.
    assert free_queue(pool) == [9, 1, 2]
    assert plan(lazy) == [1, 2]


def test_a_block_that_left_the_window_and_came_back_does_not_hide_it():
    """A prefix hit takes a block of the window and frees it again: free, but
    now at the far end. The next step still examines the eviction end."""
    pool, context = make_pool()
    cache_and_free(pool, 9)  # free queue: 1..9, all cached
    lazy = LazyOffload(context, window=3, known_stored=100)
    for block_id in range(1, 10):
        if block_id != 4:
            lazy.mark_stored(plain_hash(block_id))
    assert plan(lazy) == []  # examined 1 2 3
    pool.touch([pool.blocks[3]])
    pool.free_blocks([pool.blocks[3]])
    assert free_queue(pool) == [1, 2, 4, 5, 6, 7, 8, 9, 3]
    pool.get_new_blocks(2)  # 1 and 2 leave from the eviction end.
    assert plan(lazy) == [4]


def test_known_stored_is_bounded():
    _, context = make_pool()
    lazy = LazyOffload(context, window=1, known_stored=2)
    for block_id in (1, 2, 3):
        lazy.mark_stored(plain_hash(block_id))
    assert list(lazy._stored) == [plain_hash(2), plain_hash(3)]

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for the SchedulerContext handed to KV connectors by
KVConnectorBase_V1.bind_scheduler_context(), against the real BlockPool,
KVCacheManager and Scheduler."""

import random
from typing import Any

import pytest
import torch

from tests.v1.kv_connector.unit.utils import (
    MockKVConnector,
    create_request,
    create_scheduler,
    create_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.scheduler_context import (
    BlockPoolSchedulerContext,
    SchedulerContext,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlock,
    init_none_hash,
    make_block_hash_with_group_id,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)

pytestmark = pytest.mark.cpu_test

MODULE = "tests.v1.kv_connector.unit.test_scheduler_context"
BLOCK_SIZE = 16


class ContextRecordingConnector(MockKVConnector):
    """Records every SchedulerContext it is bound to."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bound_contexts: list[SchedulerContext] = []

    def bind_scheduler_context(self, scheduler_context: SchedulerContext) -> None:
        self.bound_contexts.append(scheduler_context)


KVConnectorFactory.register_connector(
    "ContextRecordingConnector", MODULE, "ContextRecordingConnector"
)


@pytest.fixture(autouse=True)
def _init_none_hash() -> None:
    init_none_hash(sha256)


def _make_context(num_blocks: int = 10) -> tuple[BlockPoolSchedulerContext, BlockPool]:
    pool = BlockPool(
        num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=BLOCK_SIZE
    )
    return BlockPoolSchedulerContext(pool), pool


def _queue_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def _content_hash(block_id: int) -> bytes:
    return sha256(("block", block_id))


def _cache(pool: BlockPool, block: KVCacheBlock, group_id: int = 0) -> None:
    """Give a block a prefix-cache entry, as cache_full_blocks() does."""
    key = make_block_hash_with_group_id(_content_hash(block.block_id), group_id)
    pool._insert_block_hash(key, block, num_tokens=None)


def _ids(blocks: Any) -> list[int]:
    return [b.block_id for b in blocks]


def _full_attention(block_size: int = BLOCK_SIZE) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )


def _make_manager(num_blocks: int = 32) -> KVCacheManager:
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["full"], _full_attention())],
    )
    return KVCacheManager(
        config,
        max_model_len=8192,
        enable_caching=True,
        hash_block_size=BLOCK_SIZE,
        scheduler_block_size=BLOCK_SIZE,
    )


# ---------------------------------------------------------------------------
# get_block and the block views
# ---------------------------------------------------------------------------


def test_get_block_returns_the_pools_own_block():
    context, pool = _make_context()
    for block_id in range(10):
        view = context.get_block(block_id)
        assert view is pool.blocks[block_id]
        assert view.block_id == block_id
    null = context.get_block(0)
    assert null.is_null and null is pool.null_block
    view = context.get_block(3)
    assert (
        view.ref_cnt,
        view.is_null,
        view.block_hash,
        view.content_hash,
        view.group_id,
        view.block_hash_num_tokens,
    ) == (0, False, None, None, None, None)


@pytest.mark.parametrize("block_id", [-1, 10, 1000, "3", 2.0, True, None])
def test_unknown_block_id_raises_and_changes_nothing(block_id: Any):
    context, pool = _make_context()
    before = _queue_ids(pool)
    with pytest.raises(ValueError, match=r"unknown block id .*valid ids are 0\.\.9"):
        context.get_block(block_id)
    for method in (context.touch, context.free_blocks):
        with pytest.raises(ValueError, match=r"unknown block id"):
            method([3, block_id])
    if block_id is not None:  # None: scan from the front
        with pytest.raises(ValueError, match=r"unknown block id"):
            context.iter_free_blocks(block_id)
    with pytest.raises(ValueError, match=r"unknown block id"):
        context.get_block_hashes(block_id)
    assert pool.blocks[3].ref_cnt == 0
    assert _queue_ids(pool) == before


def test_view_is_live_and_reports_the_stored_hash_and_group():
    context, pool = _make_context()
    view = context.get_block(4)
    _cache(pool, pool.blocks[4], group_id=3)
    assert view.block_hash == pool.blocks[4].block_hash
    assert view.block_hash == make_block_hash_with_group_id(_content_hash(4), 3)
    assert view.content_hash == _content_hash(4)
    assert view.group_id == 3
    pool.evict_blocks({4})
    assert view.block_hash is None
    assert view.content_hash is None and view.group_id is None


# ---------------------------------------------------------------------------
# touch / free_blocks: reference counting by block id
# ---------------------------------------------------------------------------


def test_touch_takes_free_block_out_of_queue_and_free_returns_it():
    context, pool = _make_context()
    num_free = context.get_num_free_blocks()
    assert num_free == pool.get_num_free_blocks() == 9
    context.touch([5])
    assert pool.blocks[5].ref_cnt == 1
    assert 5 not in _queue_ids(pool)
    assert context.get_num_free_blocks() == num_free - 1
    # A touched block is never handed out.
    allocated = pool.get_new_blocks(num_free - 1)
    assert 5 not in _ids(allocated)
    pool.free_blocks(allocated)
    context.free_blocks([5])
    assert pool.blocks[5].ref_cnt == 0
    assert 5 in _queue_ids(pool)
    assert context.get_num_free_blocks() == num_free


def test_touch_twice_needs_two_frees():
    context, pool = _make_context()
    context.touch(iter([2, 2]))
    assert pool.blocks[2].ref_cnt == 2
    context.free_blocks([2])
    assert pool.blocks[2].ref_cnt == 1 and 2 not in _queue_ids(pool)
    context.free_blocks([2])
    assert pool.blocks[2].ref_cnt == 0 and 2 in _queue_ids(pool)


def test_free_returns_cached_blocks_to_lru_tail_and_uncached_to_front():
    context, pool = _make_context()
    _cache(pool, pool.blocks[2])
    context.touch([2, 3])
    context.free_blocks([2, 3])
    ids = _queue_ids(pool)
    assert ids[0] == 3
    assert ids[-1] == 2
    # A cached block keeps its prefix-cache entry across touch and free.
    assert context.get_block(2).block_hash is not None


def test_references_outlive_the_request_that_allocated_the_blocks():
    manager = _make_manager()
    context = BlockPoolSchedulerContext(manager.block_pool)
    request = create_request(request_id=1, num_tokens=3 * BLOCK_SIZE)
    blocks = manager.allocate_slots(request, 3 * BLOCK_SIZE)
    assert blocks is not None
    (block_ids,) = blocks.get_block_ids()
    assert len(block_ids) == 3
    context.touch(block_ids)
    assert [context.get_block(i).ref_cnt for i in block_ids] == [2, 2, 2]
    manager.free(request)
    assert [context.get_block(i).ref_cnt for i in block_ids] == [1, 1, 1]
    assert not set(block_ids) & set(_queue_ids(manager.block_pool))
    context.free_blocks(reversed(block_ids))
    assert [context.get_block(i).ref_cnt for i in block_ids] == [0, 0, 0]
    assert set(block_ids) <= set(_queue_ids(manager.block_pool))


def test_null_block_raises_and_changes_nothing():
    context, pool = _make_context()
    before = _queue_ids(pool)
    with pytest.raises(ValueError, match="block 0 is the null block"):
        context.touch([4, 0])
    assert pool.blocks[4].ref_cnt == 0
    assert _queue_ids(pool) == before
    context.touch([4])
    with pytest.raises(ValueError, match="block 0 is the null block"):
        context.free_blocks([4, 0])
    assert pool.blocks[4].ref_cnt == 1


def test_free_below_zero_raises_and_changes_nothing():
    context, pool = _make_context()
    with pytest.raises(ValueError, match=r"block 6 has 0 reference\(s\)"):
        context.free_blocks([6])
    context.touch([6, 7])
    before = _queue_ids(pool)
    with pytest.raises(
        ValueError, match=r"block 6 has 1 reference\(s\) but is freed 2"
    ):
        context.free_blocks([7, 6, 6])
    assert (pool.blocks[6].ref_cnt, pool.blocks[7].ref_cnt) == (1, 1)
    assert _queue_ids(pool) == before


# ---------------------------------------------------------------------------
# iter_free_blocks
# ---------------------------------------------------------------------------


def test_iter_free_blocks_is_eviction_order_and_resumes():
    context, pool = _make_context()
    pool.free_blocks(reversed(pool.get_new_blocks(4)))  # reorder the queue
    expected = _queue_ids(pool)
    assert _ids(context.iter_free_blocks()) == expected
    it = context.iter_free_blocks()
    first = [next(it).block_id for _ in range(3)]
    rest = _ids(context.iter_free_blocks(after_block_id=first[-1]))
    assert first + rest == expected
    assert list(context.iter_free_blocks(after_block_id=expected[-1])) == []


def test_resume_after_a_touched_block_raises_naming_it():
    context, _ = _make_context()
    cursor = _ids(context.iter_free_blocks())[2]
    context.touch([cursor])
    with pytest.raises(ValueError, match=rf"block {cursor} has left the free queue"):
        context.iter_free_blocks(after_block_id=cursor)
    # Restarting from the front works and skips the touched block.
    assert cursor not in _ids(context.iter_free_blocks())


def test_resume_after_a_block_that_left_and_came_back_raises():
    """The cursor was allocated and freed again: it is free, but at the far
    end of the queue. Resuming after it would skip the whole queue, including
    the blocks about to be evicted."""
    context, pool = _make_context()
    for block in pool.blocks[1:]:
        _cache(pool, block)
    cursor = _ids(context.iter_free_blocks())[0]
    allocated = pool.get_new_blocks(1)
    assert _ids(allocated) == [cursor]
    _cache(pool, allocated[0])
    pool.free_blocks(allocated)
    assert context.get_block(cursor).ref_cnt == 0
    assert _queue_ids(pool)[-1] == cursor
    with pytest.raises(ValueError, match=rf"block {cursor} has left the free queue"):
        context.iter_free_blocks(after_block_id=cursor)
    # A prefix-cache hit (touch) and free counts the same.
    cursor = _ids(context.iter_free_blocks())[3]
    pool.touch([pool.blocks[cursor]])
    pool.free_blocks([pool.blocks[cursor]])
    with pytest.raises(ValueError, match=rf"block {cursor} has left the free queue"):
        context.iter_free_blocks(after_block_id=cursor)
    # A scan that reaches it again makes it a valid cursor again.
    assert _ids(context.iter_free_blocks())[-1] == cursor
    assert list(context.iter_free_blocks(after_block_id=cursor)) == []


def test_resume_after_a_block_no_scan_yielded_raises():
    context, pool = _make_context()
    with pytest.raises(ValueError, match="block 5 has left the free queue"):
        context.iter_free_blocks(after_block_id=5)
    with pytest.raises(ValueError, match="block 0 has left the free queue"):
        context.iter_free_blocks(after_block_id=0)


def test_iter_free_blocks_empty_queue():
    context, pool = _make_context()
    blocks = pool.get_new_blocks(pool.get_num_free_blocks())
    assert list(context.iter_free_blocks()) == []
    pool.free_blocks(blocks)


def test_touching_yielded_blocks_does_not_stop_iteration():
    context, pool = _make_context()
    expected = _queue_ids(pool)
    # Without the context, 0.32.0's iteration stops at the first touch.
    legacy = pool.free_block_queue.iter_blocks_after(None)
    pool.touch([next(legacy)])
    assert list(legacy) == []
    pool.free_blocks([pool.blocks[expected[0]]])
    expected = _queue_ids(pool)

    seen = []
    for block in context.iter_free_blocks():
        seen.append(block.block_id)
        context.touch([block.block_id])
    assert seen == expected
    assert context.get_num_free_blocks() == 0


def test_touching_blocks_ahead_skips_them():
    context, pool = _make_context()
    expected = _queue_ids(pool)
    skipped = (expected[2], expected[4], expected[-1])
    seen = []
    for block in context.iter_free_blocks():
        seen.append(block.block_id)
        if block.block_id == expected[1]:
            # The next block, one further on, and the last one of the scan.
            context.touch(skipped)
    assert seen == [i for i in expected if i not in skipped]


def test_touching_every_remaining_block_ends_the_scan():
    context, pool = _make_context()
    it = context.iter_free_blocks()
    first = next(it)
    context.touch(_queue_ids(pool))
    assert list(it) == []
    assert first.ref_cnt == 1


def test_blocks_freed_during_a_scan_are_not_yielded():
    context, pool = _make_context()
    held = pool.get_new_blocks(2)
    _cache(pool, held[0])
    expected = _queue_ids(pool)
    seen = []
    for block in context.iter_free_blocks():
        seen.append(block.block_id)
        if len(seen) == 1:
            # Cached: to the tail, after the scan's end; uncached: to the front.
            context.free_blocks(_ids(held))
    assert seen == expected
    assert _ids(context.iter_free_blocks(seen[-1])) == [held[0].block_id]


def test_touch_and_free_of_each_yielded_block_terminates():
    context, pool = _make_context()
    for block in pool.blocks[1:]:
        _cache(pool, block)
    expected = _queue_ids(pool)
    seen = []
    for block in context.iter_free_blocks():
        seen.append(block.block_id)
        assert len(seen) <= len(expected)
        context.touch([block.block_id])
        context.free_blocks([block.block_id])
    assert seen == expected
    assert _queue_ids(pool) == expected


def test_scheduler_allocating_during_a_scan_skips_those_blocks():
    context, pool = _make_context()
    expected = _queue_ids(pool)
    it = context.iter_free_blocks()
    assert next(it).block_id == expected[0]
    # The scheduler allocates from the front: the yielded block and the next.
    assert _ids(pool.get_new_blocks(2)) == expected[:2]
    assert _ids(it) == expected[2:]


def test_scheduler_taking_the_scans_last_block_never_yields_the_sentinel():
    """0.32.0's free queue ends in a sentinel block; a scan that lost its
    last block must stop instead of walking into it."""
    context, pool = _make_context()
    expected = _queue_ids(pool)
    it = context.iter_free_blocks()
    assert next(it).block_id == expected[0]
    # A prefix-cache hit on the scan's last block, then everything else.
    pool.touch([pool.blocks[expected[-1]]])
    assert _ids(it) == expected[1:-1]
    it = context.iter_free_blocks()
    next(it)
    pool.get_new_blocks(pool.get_num_free_blocks())
    assert list(it) == []
    sentinel = pool.free_block_queue.fake_free_list_tail
    assert all(b is not sentinel for b in context.iter_free_blocks())


@pytest.mark.parametrize("seed", range(20))
def test_iteration_under_random_touch_free_and_allocation(seed: int):
    """Each block after the start is yielded once, in order, if it has not
    left the free queue before it is reached; nothing else is yielded.
    Connector references and scheduler allocations interleave."""
    rng = random.Random(seed)
    context, pool = _make_context(num_blocks=40)
    held = pool.get_new_blocks(10)
    for block in pool.blocks[1::3]:
        _cache(pool, block)
    start = rng.choice([None, *_ids(context.iter_free_blocks())[:5]])
    snapshot = _queue_ids(pool)
    if start is not None:
        snapshot = snapshot[snapshot.index(start) + 1 :]
    left: set[int] = set()
    touched: list[int] = []
    position = 0
    for block in context.iter_free_blocks(start):
        while snapshot[position] in left:
            position += 1
        assert block.block_id == snapshot[position]
        assert block.ref_cnt == 0
        position += 1
        for _ in range(rng.randrange(3)):
            action = rng.random()
            if action < 0.4 or not touched:
                candidates = [
                    b for b in pool.blocks[1:] if b.ref_cnt == 0 or rng.random() < 0.1
                ]
                victim = rng.choice(candidates)
                if victim.ref_cnt == 0:
                    left.add(victim.block_id)
                context.touch([victim.block_id])
                touched.append(victim.block_id)
            elif action < 0.6 and pool.get_num_free_blocks():
                allocated = pool.get_new_blocks(1)
                left.update(_ids(allocated))
                held.extend(allocated)
            else:
                context.free_blocks([touched.pop(rng.randrange(len(touched)))])
        if rng.random() < 0.2 and held:
            pool.free_blocks([held.pop()])
    assert all(i in left for i in snapshot[position:])
    context.free_blocks(touched)
    pool.free_blocks(held)
    assert context.get_num_free_blocks() == 39
    assert sorted(_queue_ids(pool)) == list(range(1, 40))


def test_abandoned_iterators_are_forgotten():
    context, pool = _make_context()
    it = context.iter_free_blocks()
    next(it)
    never_started = context.iter_free_blocks()
    assert len(context._scans) == 2
    del it, never_started
    assert len(context._scans) == 0
    context.touch([5])
    assert context.get_block(5).ref_cnt == 1


def test_pool_reports_to_the_context_only_once_it_scans():
    context, pool = _make_context()
    context.touch([3])
    context.free_blocks([3])
    assert pool.free_queue_observers == []
    list(context.iter_free_blocks())
    list(context.iter_free_blocks())
    assert pool.free_queue_observers == [context]


# ---------------------------------------------------------------------------
# Prefix-cache lookups
# ---------------------------------------------------------------------------


def test_get_cached_block_by_content_hash_and_group():
    context, pool = _make_context()
    _cache(pool, pool.blocks[4], group_id=1)
    assert context.get_cached_block(_content_hash(4), 1) is pool.blocks[4]
    assert context.get_cached_block(_content_hash(4), 0) is None
    assert context.get_cached_block(_content_hash(5), 1) is None
    pool.evict_blocks({4})
    assert context.get_cached_block(_content_hash(4), 1) is None


def test_get_block_hashes_lists_the_primary_then_partial_entries():
    context, pool = _make_context()
    assert context.get_block_hashes(4) == []
    primary = make_block_hash_with_group_id(_content_hash(4), 0)
    partial = make_block_hash_with_group_id(sha256("partial"), 0)
    pool._insert_block_hash(primary, pool.blocks[4], num_tokens=None)
    pool._insert_block_hash(partial, pool.blocks[4], num_tokens=None)
    assert context.get_block_hashes(4) == [primary, partial]
    assert context.get_block_hashes(4)[0] == context.get_block(4).block_hash
    assert context.get_cached_block(sha256("partial"), 0) is pool.blocks[4]
    pool.evict_blocks({4})
    assert context.get_block_hashes(4) == []


# ---------------------------------------------------------------------------
# Binding
# ---------------------------------------------------------------------------


def _make_scheduler(kv_connector: str = "ContextRecordingConnector") -> Any:
    vllm_config = create_vllm_config(
        kv_connector=kv_connector,
        kv_connector_module_path=MODULE,
        kv_role="kv_both",
        kv_connector_extra_config={"matched_tokens": 0, "is_async": False},
        block_size=BLOCK_SIZE,
    )
    return create_scheduler(vllm_config, num_blocks=64)


def test_scheduler_binds_one_context_over_its_own_state():
    scheduler = _make_scheduler()
    connector = scheduler.connector
    assert isinstance(connector, ContextRecordingConnector)
    assert len(connector.bound_contexts) == 1
    context = connector.bound_contexts[0]
    assert isinstance(context, BlockPoolSchedulerContext)
    assert context.block_pool is scheduler.kv_cache_manager.block_pool
    assert context.get_num_free_blocks() == 63

    requests = [create_request(request_id=i, num_tokens=20 + i) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    output = scheduler.schedule()
    assert output.num_scheduled_tokens
    for request in requests:
        (block_ids,) = scheduler.kv_cache_manager.get_block_ids(request.request_id)
        assert all(context.get_block(i).ref_cnt == 1 for i in block_ids)
    # The scheduler's own allocations keep a connector's cursor exact: it
    # allocates the new request's blocks from the front of the free queue.
    cursor = next(context.iter_free_blocks()).block_id
    scheduler.add_request(create_request(request_id=9, num_tokens=20))
    scheduler.schedule()
    assert context.get_block(cursor).ref_cnt == 1
    with pytest.raises(ValueError, match=f"block {cursor} has left"):
        context.iter_free_blocks(cursor)


def test_multi_connector_forwards_the_context():
    first = object.__new__(ContextRecordingConnector)
    first.bound_contexts = []
    second = object.__new__(ContextRecordingConnector)
    second.bound_contexts = []
    connector = object.__new__(MultiConnector)
    connector._connectors = [first, second]
    context, _ = _make_context()
    connector.bind_scheduler_context(context)
    assert first.bound_contexts == [context]
    assert second.bound_contexts == [context]


# ---------------------------------------------------------------------------
# The deprecated bind_gpu_block_pool()
# ---------------------------------------------------------------------------


class LegacyPoolConnector(MockKVConnector):
    """An out-of-tree connector still written against bind_gpu_block_pool()."""

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self.gpu_block_pool = gpu_block_pool


def test_bind_gpu_block_pool_still_called_with_one_deprecation_warning(
    caplog_vllm: pytest.LogCaptureFixture,
):
    manager = _make_manager()
    connectors = [object.__new__(LegacyPoolConnector) for _ in range(2)]
    for connector in connectors:
        connector.bind_kv_cache_manager(manager)
        assert connector.gpu_block_pool is manager.block_pool
    warnings = [
        r for r in caplog_vllm.records if "bind_gpu_block_pool()" in r.getMessage()
    ]
    assert len(warnings) == 1
    assert "LegacyPoolConnector overrides bind_gpu_block_pool()" in (
        warnings[0].getMessage()
    )
    assert "bind_scheduler_context()" in warnings[0].getMessage()


def test_connectors_without_override_get_no_warning(
    caplog_vllm: pytest.LogCaptureFixture,
):
    manager = _make_manager()
    connector = object.__new__(ContextRecordingConnector)
    connector.bind_kv_cache_manager(manager)
    assert not [
        r for r in caplog_vllm.records if "bind_gpu_block_pool()" in r.getMessage()
    ]
    assert type(connector).bind_gpu_block_pool is KVConnectorBase_V1.bind_gpu_block_pool

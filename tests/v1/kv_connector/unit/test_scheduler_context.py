# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for the SchedulerContext handed to KV connectors by
KVConnectorBase_V1.bind_scheduler_context(), against the real BlockPool,
KVCacheManager and Scheduler."""

import itertools
from typing import Any

import numpy as np
import pytest
import torch

from tests.v1.kv_connector.unit.utils import (
    MockKVConnector,
    create_request,
    create_scheduler,
    create_vllm_config,
)
from tests.v1.simple_kv_offload.test_scheduler import (
    _BYTES_PER_BLOCK,
    _make_kv_cache_config,
    _make_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    _binds_only_the_block_pool,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (
    MooncakeStoreConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.scheduler_context import (
    KVConnectorSchedulerContext,
    SchedulerContext,
)
from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
    SimpleCPUOffloadConnector,
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


def _make_context(
    num_blocks: int = 10,
) -> tuple[KVConnectorSchedulerContext, BlockPool]:
    pool = BlockPool(
        num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=BLOCK_SIZE
    )
    return KVConnectorSchedulerContext(pool), pool


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
    with pytest.raises(
        ValueError,
        match=rf"unknown block id .* of type {type(block_id).__name__}; "
        r"block ids are integers 0\.\.9",
    ):
        context.get_block(block_id)
    for method in (context.touch, context.free_blocks):
        with pytest.raises(ValueError, match=r"unknown block id"):
            method([3, block_id])
    with pytest.raises(ValueError, match=r"unknown block id"):
        context.get_block_hashes(block_id)
    assert pool.blocks[3].ref_cnt == 0
    assert _queue_ids(pool) == before


@pytest.mark.parametrize(
    "given",
    [
        [np.int64(3), np.int32(4), 5],
        np.array([3, 4, 5]),
        np.array([3, 4, 5], dtype=np.int32),
        torch.tensor([3, 4, 5]),
        (i for i in (3, 4, 5)),
    ],
    ids=["numpy_ints", "int64_array", "int32_array", "tensor", "generator"],
)
def test_integer_ids_of_any_type_are_accepted(given: Any):
    """Block tables are often numpy or torch arrays: their integers are ids,
    and an array or tensor is taken whole."""
    context, pool = _make_context()
    ids = list(given) if isinstance(given, list) else given
    context.touch(ids)
    assert [pool.blocks[i].ref_cnt for i in (3, 4, 5)] == [1, 1, 1]
    assert context.get_block(np.int64(3)) is pool.blocks[3]
    context.free_blocks([3, 4, 5])
    assert [pool.blocks[i].ref_cnt for i in (3, 4, 5)] == [0, 0, 0]
    assert context.get_block_hashes(np.int64(3)) == []


@pytest.mark.parametrize("given", [[3, np.float64(4.0)], [3, torch.tensor(4)]])
def test_other_id_types_raise_and_change_nothing(given: list[Any]):
    """A tensor element is rejected: converting ids one by one would cost
    tens of times BlockPool's own calls; pass the tensor itself."""
    context, pool = _make_context()
    with pytest.raises(ValueError, match="pass a numpy array or tensor of ids"):
        context.touch(given)
    assert pool.blocks[3].ref_cnt == 0


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
    context = KVConnectorSchedulerContext(manager.block_pool)
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
    with pytest.raises(
        ValueError, match=r"block 6 is freed 1 time\(s\) but this context holds 0"
    ):
        context.free_blocks([6])
    context.touch([6, 7])
    before = _queue_ids(pool)
    with pytest.raises(
        ValueError, match=r"block 6 is freed 2 time\(s\) but this context holds 1"
    ):
        context.free_blocks([7, 6, 6])
    assert (pool.blocks[6].ref_cnt, pool.blocks[7].ref_cnt) == (1, 1)
    assert _queue_ids(pool) == before
    context.free_blocks([7, 6])
    assert (pool.blocks[6].ref_cnt, pool.blocks[7].ref_cnt) == (0, 0)


def test_connector_cannot_free_a_reference_a_request_holds():
    """free_blocks() drops only references this context took: a request's
    blocks stay allocated whatever the connector frees."""
    manager = _make_manager()
    context = KVConnectorSchedulerContext(manager.block_pool)
    request = create_request(request_id=1, num_tokens=2 * BLOCK_SIZE)
    blocks = manager.allocate_slots(request, 2 * BLOCK_SIZE)
    assert blocks is not None
    (block_ids,) = blocks.get_block_ids()
    with pytest.raises(ValueError, match="this context holds 0 of its 1 reference"):
        context.free_blocks(block_ids)
    context.touch(block_ids[:1])
    with pytest.raises(ValueError, match="this context holds 0 of its 1 reference"):
        context.free_blocks(block_ids)
    assert [context.get_block(i).ref_cnt for i in block_ids] == [2, 1]
    context.free_blocks(block_ids[:1])
    assert [context.get_block(i).ref_cnt for i in block_ids] == [1, 1]
    assert not set(block_ids) & set(_queue_ids(manager.block_pool))


def test_deprecated_pool_binding_checks_frees_against_the_blocks_references():
    """Bound through bind_gpu_block_pool(), a connector may have taken
    references through the pool itself: its frees are checked against the
    block's references, as in 0.32.0."""
    pool = BlockPool(num_gpu_blocks=10, enable_caching=True, hash_block_size=BLOCK_SIZE)
    context = KVConnectorSchedulerContext(pool, count_references=False)
    pool.touch([pool.blocks[3]])
    context.free_blocks([3])
    assert pool.blocks[3].ref_cnt == 0
    with pytest.raises(ValueError, match="this context holds 0 of its 0 reference"):
        context.free_blocks([3])


# ---------------------------------------------------------------------------
# iter_free_blocks
# ---------------------------------------------------------------------------


def test_iter_free_blocks_is_eviction_order():
    context, pool = _make_context()
    pool.free_blocks(reversed(pool.get_new_blocks(4)))  # reorder the queue
    expected = _queue_ids(pool)
    assert expected != sorted(expected)
    assert _ids(context.iter_free_blocks()) == expected


def test_iter_free_blocks_empty_queue():
    context, pool = _make_context()
    blocks = pool.get_new_blocks(pool.get_num_free_blocks())
    assert list(context.iter_free_blocks()) == []
    pool.free_blocks(blocks)


def test_scan_then_touch_pins_the_blocks_next_to_be_evicted():
    """The lazy offloader's pattern: scan the first blocks, then touch the
    cached ones; the scheduler then allocates around them."""
    context, pool = _make_context()
    for block in pool.blocks[1:10:2]:
        _cache(pool, block)
    window = list(itertools.islice(context.iter_free_blocks(), 4))
    pinned = [b.block_id for b in window if b.block_hash is not None]
    assert pinned and len(pinned) < 4
    context.touch(pinned)
    allocated = _ids(pool.get_new_blocks(4))
    assert not set(pinned) & set(allocated)
    assert all(context.get_block(i).block_hash is not None for i in pinned)
    context.free_blocks(pinned)
    assert _ids(context.iter_free_blocks())[-len(pinned) :] == pinned


def test_scan_resumes_after_a_free_block():
    context, pool = _make_context()
    queue = _queue_ids(pool)
    assert _ids(context.iter_free_blocks(queue[2])) == queue[3:]
    assert list(context.iter_free_blocks(queue[-1])) == []


def test_scan_resumed_after_a_block_that_left_the_queue_starts_at_the_front():
    """0.32.0's lazy offloader resets its cursor when the block it stopped
    at was allocated; the context does the same for every connector."""
    context, pool = _make_context()
    (allocated,) = pool.get_new_blocks(1)
    assert _ids(context.iter_free_blocks(allocated.block_id)) == _queue_ids(pool)


@pytest.mark.parametrize("block_id", [0, 10, -1])
def test_scan_after_the_null_block_or_an_unknown_id_raises(block_id: int):
    context, _ = _make_context()
    with pytest.raises(ValueError, match="iter_free_blocks"):
        list(context.iter_free_blocks(block_id))


def test_scan_never_yields_the_sentinel():
    """0.32.0's free queue ends in a sentinel block, which is no block."""
    context, pool = _make_context()
    sentinel = pool.free_block_queue.fake_free_list_tail
    assert _ids(context.iter_free_blocks()) == _queue_ids(pool)
    assert all(b is not sentinel for b in context.iter_free_blocks())


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
    assert isinstance(context, KVConnectorSchedulerContext)
    assert context.get_block(1) is scheduler.kv_cache_manager.block_pool.blocks[1]
    assert context.get_num_free_blocks() == 63

    requests = [create_request(request_id=i, num_tokens=20 + i) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    output = scheduler.schedule()
    assert output.num_scheduled_tokens
    for request in requests:
        (block_ids,) = scheduler.kv_cache_manager.get_block_ids(request.request_id)
        assert all(context.get_block(i).ref_cnt == 1 for i in block_ids)
    # The scheduler allocates the new request's blocks from the front of
    # the free queue, which a scan no longer yields.
    front = next(context.iter_free_blocks()).block_id
    scheduler.add_request(create_request(request_id=9, num_tokens=20))
    scheduler.schedule()
    assert context.get_block(front).ref_cnt == 1
    assert front not in _ids(context.iter_free_blocks())


def test_multi_connector_binds_each_child_its_own_context():
    """Each child counts its own references: one cannot free a block another
    touched."""
    first = object.__new__(ContextRecordingConnector)
    first.bound_contexts = []
    second = object.__new__(ContextRecordingConnector)
    second.bound_contexts = []
    connector = object.__new__(MultiConnector)
    connector._connectors = [first, second]
    context, pool = _make_context()
    connector.bind_scheduler_context(context)
    [first_context] = first.bound_contexts
    [second_context] = second.bound_contexts
    assert first_context is not second_context
    assert isinstance(first_context, KVConnectorSchedulerContext)
    assert first_context.get_block(4) is pool.blocks[4]
    second_context.touch([4])
    with pytest.raises(ValueError, match="this context holds 0"):
        first_context.free_blocks([4])
    assert pool.blocks[4].ref_cnt == 1


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


class MooncakeStoreSubclass(MooncakeStoreConnector):
    """A connector built on the Mooncake store connector, which binds the
    context."""


class VllmNamedLegacyConnector(LegacyPoolConnector):
    """An override in a module whose name starts with "vllm."."""

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self.gpu_block_pool = gpu_block_pool


VllmNamedLegacyConnector.__module__ = "vllm.plugins.legacy_connector"


class MigratedPoolConnector(MockKVConnector):
    """A connector outside vLLM that binds the context and keeps its
    bind_gpu_block_pool() for older vLLM releases."""

    def bind_scheduler_context(self, scheduler_context: SchedulerContext) -> None:
        self.scheduler_context = scheduler_context

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self.gpu_block_pool = gpu_block_pool


class SimpleCPUOffloadPoolSubclass(SimpleCPUOffloadConnector):
    """A subclass that overrides only the deprecated method again."""

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        super().bind_gpu_block_pool(gpu_block_pool)


@pytest.mark.parametrize(
    "connector_cls,warned",
    [
        (LegacyPoolConnector, True),
        (VllmNamedLegacyConnector, True),
        (SimpleCPUOffloadPoolSubclass, True),
        (MigratedPoolConnector, False),
        (MooncakeStoreSubclass, False),
        (MooncakeStoreConnector, False),
        (SimpleCPUOffloadConnector, False),
        (MultiConnector, False),
        (ContextRecordingConnector, False),
    ],
)
def test_deprecation_warning_follows_the_overrides(
    connector_cls: type[KVConnectorBase_V1], warned: bool
):
    """Told when the class that overrides bind_gpu_block_pool() does not
    also override bind_scheduler_context(), wherever the class lives."""
    assert _binds_only_the_block_pool(connector_cls) is warned


def test_connector_keeping_the_old_method_beside_the_new_is_not_warned(
    caplog_vllm: pytest.LogCaptureFixture,
):
    """A connector that has moved to the context but keeps its
    bind_gpu_block_pool() for older vLLM releases has nothing to change."""
    manager = _make_manager()
    connector = object.__new__(MigratedPoolConnector)
    connector.bind_kv_cache_manager(manager)
    assert connector.gpu_block_pool is manager.block_pool
    assert not [
        r for r in caplog_vllm.records if "bind_gpu_block_pool()" in r.getMessage()
    ]


class PoolForwardingComposite(MockKVConnector):
    """A composite connector outside vLLM written against 0.32.0: like
    0.32.0's MultiConnector, it forwards bind_gpu_block_pool() only."""

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        for child in self.children:
            child.bind_gpu_block_pool(gpu_block_pool)


def test_simple_cpu_offload_still_bound_through_bind_gpu_block_pool():
    """SimpleCPUOffloadConnector implemented bind_gpu_block_pool() in 0.32.0:
    a composite forwarding only that call must still bind its manager, or
    offload silently stores nothing."""
    vllm_config = _make_vllm_config()
    assert vllm_config.kv_transfer_config is not None
    vllm_config.kv_transfer_config.kv_connector_extra_config = {
        "cpu_bytes_to_use_per_rank": _BYTES_PER_BLOCK * 4
    }
    child = SimpleCPUOffloadConnector(
        vllm_config, KVConnectorRole.SCHEDULER, _make_kv_cache_config(num_blocks=16)
    )
    composite = object.__new__(PoolForwardingComposite)
    composite.children = [child]
    manager = _make_manager()
    composite.bind_kv_cache_manager(manager)
    composite.bind_scheduler_context(KVConnectorSchedulerContext(manager.block_pool))

    assert child.scheduler_manager is not None
    context = child.scheduler_manager._scheduler_context
    assert isinstance(context, KVConnectorSchedulerContext)
    assert context.get_block(5) is manager.block_pool.blocks[5]
    context.touch([5])
    assert manager.block_pool.blocks[5].ref_cnt == 1

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a KV connector may see and do on the scheduler's KV cache.

The scheduler builds one SchedulerContext over its block pool and hands it to
KVConnectorBase_V1.bind_scheduler_context() once. Connectors name blocks by
id, as block tables and KVCacheBlocks.get_block_ids() do, and read them
through KVCacheBlockView; no signature names a vLLM-internal type, so the
block pool can change without breaking connectors.

BlockPoolSchedulerContext is vLLM's implementation over the real BlockPool. It
hands out vLLM's own KVCacheBlock objects, which satisfy KVCacheBlockView
structurally: no wrapper objects on the hot path. The contract (lifetimes,
reference counting, iteration) is written down in
docs/design/kv_connector_scheduler_context.md.
"""

import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool, FreeQueueObserver
    from vllm.v1.core.kv_cache_utils import KVCacheBlock


class KVCacheBlockView(Protocol):
    """Read-only view of one block of the scheduler's KV cache.

    A view is the block itself, not a snapshot: its fields change as the
    scheduler allocates, caches and evicts. A connector may keep a view for
    the lifetime of the SchedulerContext it came from; the block id stays
    the same, the contents do not. Never write to a view.
    """

    @property
    def block_id(self) -> int:
        """The block's index in the pool, as in block tables."""
        ...

    @property
    def ref_cnt(self) -> int:
        """References held by requests and connectors; 0 means free."""
        ...

    @property
    def is_null(self) -> bool:
        """The placeholder block, never allocated, cached or freed."""
        ...

    @property
    def block_hash(self) -> bytes | None:
        """The block's prefix-cache key as stored (content hash and KV cache
        group); None when the block is not cached."""
        ...

    @property
    def content_hash(self) -> bytes | None:
        """block_hash without the KV cache group, as in
        Request.block_hashes; None when the block is not cached."""
        ...

    @property
    def group_id(self) -> int | None:
        """The KV cache group of block_hash; None when not cached."""
        ...

    @property
    def block_hash_num_tokens(self) -> int | None:
        """Prefix tokens block_hash covers when that is not the block
        boundary (a partial-block entry); None otherwise."""
        ...


class SchedulerContext(Protocol):
    """The scheduler's KV cache state as a KV connector may use it.

    Scheduler side only. Every method must be called from the scheduler's
    thread, inside a connector callback (bind_scheduler_context() and later
    scheduler-side methods); none may be called from a worker.

    Blocks are named by id. Reference counting: touch() takes one reference
    per id, free_blocks() drops one. A block with references is never
    allocated to a request or evicted. A connector must drop every reference
    it took (for example when its transfer finished or the request was
    aborted).
    """

    def get_block(self, block_id: int) -> KVCacheBlockView:
        """The block with this id. Raises ValueError for an unknown id."""
        ...

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one reference on each block (an id listed twice gets two).

        A free block leaves the free queue: it is not evicted and keeps its
        prefix-cache entry. Raises ValueError, and changes nothing, for the
        null block or an unknown id.
        """
        ...

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in eviction priority order.

        A block left without references returns to the free queue: cached
        blocks at the most recently used end (evicted last, in the order
        given), uncached ones at the front. Raises ValueError, and changes
        nothing, for the null block, an unknown id, or more frees than the
        block has references.
        """
        ...

    def iter_free_blocks(
        self, after_block_id: int | None = None
    ) -> Iterator[KVCacheBlockView]:
        """Free blocks in eviction order (next to be evicted first).

        Starts at the front of the free queue, or right after
        after_block_id in O(1), which must be a block a scan of this
        context yielded and that has not left the free queue since, not even
        briefly (a block that is allocated or touched and freed again is no
        longer where the scan saw it). Otherwise the call itself raises
        ValueError naming it, and the caller restarts from the front
        (after_block_id=None).

        The scan covers the blocks that were in the free queue, after the
        start, when it started; each is yielded at most once, and only if it
        is still free when reached. The scheduler and touch()/free_blocks()
        may run between two steps of the scan: blocks that leave the free
        queue are skipped, blocks that enter it are not yielded (resume
        later to see them).
        """
        ...

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue (allocatable, possibly cached)."""
        ...

    def get_cached_block(
        self, content_hash: bytes, group_id: int
    ) -> KVCacheBlockView | None:
        """The block the prefix cache holds under this content hash (as in
        Request.block_hashes) for KV cache group group_id; None on a miss."""
        ...

    def get_block_hashes(self, block_id: int) -> list[bytes]:
        """Every prefix-cache key the block is registered under: its
        block_hash first, then the keys of partial-block hits it also
        serves. Empty when the block is not cached."""
        ...


class _FreeQueueScan:
    """Remaining range of one iter_free_blocks() scan: the next block to
    yield and the last block the scan covers, both in the free queue."""

    __slots__ = ("next_block", "last_block", "__weakref__")

    def __init__(
        self, next_block: "KVCacheBlock | None", last_block: "KVCacheBlock"
    ) -> None:
        self.next_block = next_block
        self.last_block = last_block

    def before_leave(self, leaving_ids: set[int]) -> None:
        """Blocks with these ids are about to leave the free queue; the
        queue's links are still intact."""
        block = self.next_block
        while block is not None and block.block_id in leaving_ids:
            block = None if block is self.last_block else block.next_free_block
        self.next_block = block
        if block is None:
            return
        # The walk back stops at next_block at the latest: it stays.
        last_block = self.last_block
        while last_block.block_id in leaving_ids:
            prev_block = last_block.prev_free_block
            assert prev_block is not None
            last_block = prev_block
        self.last_block = last_block

    def after_popleft(self, free_list_head: "KVCacheBlock") -> None:
        """Blocks were just taken from the front of the free queue."""
        block = self.next_block
        if block is None or block.prev_free_block is not None:
            return
        # Everything up to next_block left; the rest of the range follows
        # the new front, unless last_block left too.
        if self.last_block.prev_free_block is None:
            self.next_block = None
        else:
            self.next_block = free_list_head.next_free_block


class BlockPoolSchedulerContext:
    """SchedulerContext over the scheduler's BlockPool.

    Args:
        block_pool: the pool whose blocks connectors see.

    """

    def __init__(self, block_pool: "BlockPool") -> None:
        self.block_pool = block_pool
        self._blocks = block_pool.blocks
        self._free_queue = block_pool.free_block_queue
        # Blocks a scan yielded that have not left the free queue since: the
        # only valid resume points.
        self._resumable: set[int] = set()
        self._scans: weakref.WeakSet[_FreeQueueScan] = weakref.WeakSet()
        self._observing = False

    def _lookup(self, block_id: int, what: str) -> "KVCacheBlock":
        if (
            not isinstance(block_id, int)
            or isinstance(block_id, bool)
            or not 0 <= block_id < len(self._blocks)
        ):
            raise ValueError(
                f"{what}: unknown block id {block_id!r}; valid ids are "
                f"0..{len(self._blocks) - 1}"
            )
        return self._blocks[block_id]

    def _lookup_referenceable(
        self, block_ids: Iterable[int], what: str
    ) -> list["KVCacheBlock"]:
        blocks = [self._lookup(block_id, what) for block_id in block_ids]
        for block in blocks:
            if block.is_null:
                raise ValueError(
                    f"{what}: block {block.block_id} is the null block, which "
                    "holds no KV and is never referenced"
                )
        return blocks

    def get_block(self, block_id: int) -> KVCacheBlockView:
        return self._lookup(block_id, "get_block")

    def touch(self, block_ids: Iterable[int]) -> None:
        self.block_pool.touch(self._lookup_referenceable(block_ids, "touch"))

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        blocks = self._lookup_referenceable(block_ids, "free_blocks")
        num_frees: dict[int, int] = {}
        for block in blocks:
            num_frees[block.block_id] = num_frees.get(block.block_id, 0) + 1
        for block_id, count in num_frees.items():
            ref_cnt = self._blocks[block_id].ref_cnt
            if count > ref_cnt:
                raise ValueError(
                    f"free_blocks: block {block_id} has {ref_cnt} reference(s) "
                    f"but is freed {count} time(s); free only blocks you "
                    "touched, once per touch"
                )
        self.block_pool.free_blocks(blocks)

    def iter_free_blocks(
        self, after_block_id: int | None = None
    ) -> Iterator[KVCacheBlockView]:
        if not self._observing:
            # From the first scan on, the pool reports blocks leaving the
            # free queue; connectors that never scan cost it nothing.
            observer: FreeQueueObserver = self
            self.block_pool.free_queue_observers.append(observer)
            self._observing = True
        queue = self._free_queue
        if after_block_id is None:
            start = queue.fake_free_list_head
        else:
            start = self._lookup(after_block_id, "iter_free_blocks")
            if after_block_id not in self._resumable:
                raise ValueError(
                    f"iter_free_blocks: block {after_block_id} has left the "
                    "free queue since a scan yielded it (or no scan did), so "
                    "the scan cannot resume after it; restart with "
                    "after_block_id=None"
                )
        last_block = queue.fake_free_list_tail.prev_free_block
        assert last_block is not None
        next_block = None if start is last_block else start.next_free_block
        scan = _FreeQueueScan(next_block, last_block)
        self._scans.add(scan)
        return self._scan(scan)

    def _scan(self, scan: _FreeQueueScan) -> Iterator[KVCacheBlockView]:
        try:
            while (block := scan.next_block) is not None:
                scan.next_block = (
                    None if block is scan.last_block else block.next_free_block
                )
                self._resumable.add(block.block_id)
                yield block
        finally:
            self._scans.discard(scan)

    def before_touch(self, blocks: Sequence["KVCacheBlock"]) -> None:
        """FreeQueueObserver: the free ones among blocks are about to leave
        the free queue."""
        leaving_ids = {block.block_id for block in blocks}
        self._resumable -= leaving_ids
        for scan in list(self._scans):
            scan.before_leave(leaving_ids)

    def after_popleft(self, blocks: Sequence["KVCacheBlock"]) -> None:
        """FreeQueueObserver: blocks were just taken from the front of the
        free queue."""
        if self._resumable:
            self._resumable.difference_update(block.block_id for block in blocks)
        for scan in list(self._scans):
            scan.after_popleft(self._free_queue.fake_free_list_head)

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_cached_block(
        self, content_hash: bytes, group_id: int
    ) -> KVCacheBlockView | None:
        return self.block_pool.cached_block_hash_to_block.get_one_block(
            make_block_hash_with_group_id(BlockHash(content_hash), group_id)
        )

    def get_block_hashes(self, block_id: int) -> list[bytes]:
        block = self._lookup(block_id, "get_block_hashes")
        if block.block_hash is None:
            return []
        return [
            block.block_hash,
            *self.block_pool.cached_block_hashes_by_block.get(block_id, ()),
        ]


if TYPE_CHECKING:
    # vLLM's own objects satisfy the protocols; mypy checks it here.
    def _check_structural_types(
        block: "KVCacheBlock", context: BlockPoolSchedulerContext
    ) -> tuple[KVCacheBlockView, SchedulerContext, "FreeQueueObserver"]:
        return block, context, context

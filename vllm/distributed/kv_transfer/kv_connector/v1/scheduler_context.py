# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a KV connector may see and do on the scheduler, behind protocols.

The scheduler builds one SchedulerContext after its KV cache manager and hands
it to KVConnectorBase_V1.bind_scheduler_context() once. Connectors program
against the protocols below only; no signature names a vLLM-internal type, so
the block pool and the scheduler can change without breaking connectors.

BlockPoolSchedulerContext is vLLM's implementation over the real BlockPool,
KVCacheManager and waiting queues. It hands out vLLM's own KVCacheBlock and
Request objects, which satisfy the view protocols structurally: no wrapper
objects on the hot path. The contract (lifetimes, reference counting,
iteration) is written down in docs/design/kv_connector_scheduler_context.md.
"""

import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request


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
        """The prefix-cache key as stored (block hash and KV cache group);
        None when the block is not cached."""
        ...

    @property
    def group_id(self) -> int | None:
        """The KV cache group of block_hash; None when not cached."""
        ...


class WaitingRequestView(Protocol):
    """Read-only view of a request waiting to be scheduled."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int:
        """Tokens already computed (e.g. before a preemption)."""
        ...

    @property
    def block_hashes(self) -> Sequence[bytes]:
        """Hashes of the request's full blocks of hash_block_size tokens,
        without KV cache group, as prefix caching computes them."""
        ...


class SchedulerContext(Protocol):
    """The scheduler's KV cache state as a KV connector may use it.

    Scheduler side only. Every method must be called from the scheduler's
    thread, inside a connector callback (bind_scheduler_context() and later
    scheduler-side methods); none may be called from a worker.

    Reference counting: touch() takes one reference per block, free_blocks()
    drops one. A block with references is never allocated to a request or
    evicted. A connector must drop every reference it took (for example
    when its transfer finished or the request was aborted).
    """

    def get_block(self, block_id: int) -> KVCacheBlockView:
        """The block with this id. Raises ValueError for an unknown id."""
        ...

    def touch(self, blocks: Iterable[KVCacheBlockView]) -> None:
        """Take one reference on each block (a block listed twice gets two).

        A free block leaves the free queue: it is not evicted and keeps its
        prefix-cache entry. Raises ValueError, and changes nothing, if a
        block is the null block or not one of this context's blocks.
        """
        ...

    def free_blocks(self, blocks: Iterable[KVCacheBlockView]) -> None:
        """Drop one reference on each block, in eviction priority order.

        A block left without references returns to the free queue: cached
        blocks at the most recently used end (evicted last, in the order
        given), uncached ones at the front. Raises ValueError, and changes
        nothing, for the null block, a foreign block, or more frees than the
        block has references.
        """
        ...

    def iter_free_blocks(
        self, after_block: KVCacheBlockView | None = None
    ) -> Iterator[KVCacheBlockView]:
        """Free blocks in eviction order (next to be evicted first).

        Starts at the front of the free queue, or right after after_block,
        which must still be free (a previously yielded block, to resume a
        scan in O(1)); if it has left the free queue, ValueError names it and
        the caller restarts with None.

        The scan covers the blocks that were in the free queue when it
        started; each is yielded only if still free when reached. touch()
        and free_blocks() through this context while iterating neither stop
        nor corrupt the scan. Blocks that become free during the scan are
        not yielded (resume later to see them). The iterator is only valid
        within the connector call that created it.
        """
        ...

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue (allocatable, possibly cached)."""
        ...

    def get_request_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one new list per KV cache group; empty
        lists for a request that holds no blocks."""
        ...

    def iter_waiting_requests(self) -> Iterator[WaitingRequestView]:
        """Requests waiting to be scheduled, in the order the scheduler
        considers them. Do not schedule, free or change the queues while
        iterating."""
        ...


class _FreeQueueScan:
    """Position of one iter_free_blocks() scan: the next block to yield and
    the last block the scan covers. touch() keeps both in the free queue."""

    __slots__ = ("next_block", "last_block", "__weakref__")

    def __init__(
        self, next_block: "KVCacheBlock | None", last_block: "KVCacheBlock"
    ) -> None:
        self.next_block = next_block
        self.last_block = last_block

    def on_leave(self, block: "KVCacheBlock") -> None:
        """Called right before block leaves the free queue."""
        if block is self.next_block:
            self.next_block = (
                None if block is self.last_block else block.next_free_block
            )
        if block is self.last_block and self.next_block is not None:
            prev_block = block.prev_free_block
            assert prev_block is not None
            self.last_block = prev_block


class BlockPoolSchedulerContext:
    """SchedulerContext over the scheduler's BlockPool, KVCacheManager and
    waiting queues.

    Args:
        block_pool: the pool whose blocks connectors see.
        kv_cache_manager: answers get_request_block_ids(); without it every
            request holds no blocks.
        waiting_queues: the scheduler's waiting queues, in the order it
            drains them.

    """

    def __init__(
        self,
        block_pool: "BlockPool",
        kv_cache_manager: "KVCacheManager | None" = None,
        waiting_queues: Sequence[Iterable["Request"]] = (),
    ) -> None:
        self.block_pool = block_pool
        self._blocks = block_pool.blocks
        self._free_queue = block_pool.free_block_queue
        self._kv_cache_manager = kv_cache_manager
        self._num_groups = (
            len(kv_cache_manager.kv_cache_config.kv_cache_groups)
            if kv_cache_manager is not None
            else 1
        )
        self._waiting_queues = tuple(waiting_queues)
        self._scans: weakref.WeakSet[_FreeQueueScan] = weakref.WeakSet()

    def _own_block(self, block: KVCacheBlockView, what: str) -> "KVCacheBlock":
        block_id = getattr(block, "block_id", None)
        if (
            isinstance(block_id, int)
            and 0 <= block_id < len(self._blocks)
            and self._blocks[block_id] is block
        ):
            return self._blocks[block_id]
        raise ValueError(
            f"{what}: {block!r} is not a block of this scheduler context; pass "
            "blocks obtained from get_block() or iter_free_blocks()"
        )

    def get_block(self, block_id: int) -> KVCacheBlockView:
        if (
            not isinstance(block_id, int)
            or isinstance(block_id, bool)
            or not 0 <= block_id < len(self._blocks)
        ):
            raise ValueError(
                f"get_block: unknown block id {block_id!r}; valid ids are "
                f"0..{len(self._blocks) - 1}"
            )
        return self._blocks[block_id]

    def touch(self, blocks: Iterable[KVCacheBlockView]) -> None:
        own = [self._own_block(b, "touch") for b in blocks]
        for block in own:
            if block.is_null:
                raise ValueError(
                    "touch: block 0 is the null block, which holds no KV and "
                    "cannot be referenced"
                )
        if not self._scans:
            self.block_pool.touch(own)
            return
        scans = list(self._scans)
        for block in own:
            if block.ref_cnt == 0:
                for scan in scans:
                    scan.on_leave(block)
            self.block_pool.touch([block])

    def free_blocks(self, blocks: Iterable[KVCacheBlockView]) -> None:
        own = [self._own_block(b, "free_blocks") for b in blocks]
        num_frees: dict[int, int] = {}
        for block in own:
            if block.is_null:
                raise ValueError(
                    "free_blocks: block 0 is the null block, which is never referenced"
                )
            num_frees[block.block_id] = num_frees.get(block.block_id, 0) + 1
        for block_id, count in num_frees.items():
            ref_cnt = self._blocks[block_id].ref_cnt
            if count > ref_cnt:
                raise ValueError(
                    f"free_blocks: block {block_id} has {ref_cnt} reference(s) "
                    f"but is freed {count} time(s); free only blocks you "
                    "touched, once per touch"
                )
        self.block_pool.free_blocks(own)

    def iter_free_blocks(
        self, after_block: KVCacheBlockView | None = None
    ) -> Iterator[KVCacheBlockView]:
        queue = self._free_queue
        if after_block is None:
            start = queue.fake_free_list_head
        else:
            start = self._own_block(after_block, "iter_free_blocks")
            if start.prev_free_block is None:
                raise ValueError(
                    f"iter_free_blocks: block {start.block_id} is no longer "
                    f"free (ref_cnt={start.ref_cnt}), so the scan cannot "
                    "resume after it; restart with after_block=None"
                )
        last_block = queue.fake_free_list_tail.prev_free_block
        assert last_block is not None
        next_block = start.next_free_block
        if start is last_block or next_block is queue.fake_free_list_tail:
            next_block = None
        scan = _FreeQueueScan(next_block, last_block)
        self._scans.add(scan)
        return self._scan(scan)

    def _scan(self, scan: _FreeQueueScan) -> Iterator[KVCacheBlockView]:
        try:
            while (block := scan.next_block) is not None:
                if block.prev_free_block is None or block.ref_cnt != 0:
                    raise RuntimeError(
                        f"iter_free_blocks: block {block.block_id} left the "
                        "free queue outside this scheduler context while "
                        "iterating; iterate within one connector call and "
                        "resume with after_block"
                    )
                scan.next_block = (
                    None if block is scan.last_block else block.next_free_block
                )
                yield block
        finally:
            self._scans.discard(scan)

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_request_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        if self._kv_cache_manager is None:
            return tuple([] for _ in range(self._num_groups))
        return self._kv_cache_manager.get_block_ids(request_id)

    def iter_waiting_requests(self) -> Iterator[WaitingRequestView]:
        for queue in self._waiting_queues:
            yield from queue


if TYPE_CHECKING:
    # vLLM's own objects satisfy the views; mypy checks it here.
    def _check_structural_types(
        block: "KVCacheBlock", request: "Request", context: BlockPoolSchedulerContext
    ) -> tuple[KVCacheBlockView, WaitingRequestView, SchedulerContext]:
        return block, request, context

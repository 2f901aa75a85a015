# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a KV connector may see and do on the scheduler's KV cache.

The scheduler builds one KVConnectorSchedulerContext over its block pool and
hands it to KVConnectorBase_V1.bind_scheduler_context() once. Connectors name
blocks by id and read them through KVCacheBlockView, which vLLM's KVCacheBlock
satisfies structurally (no wrappers). The contract (lifetimes, reference
counting, iteration) is in docs/design/kv_connector_scheduler_context.md.
"""

from collections import Counter
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
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

    Called only from the scheduler's thread, inside scheduler-side connector
    callbacks. Ids may be ints or numpy integers, or a whole numpy array or
    tensor. touch() takes one reference per id and free_blocks() drops one;
    a referenced block is never allocated or evicted. The context counts its
    connector's references, so a connector frees only its own, and must drop
    each one.
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
        """Drop one reference this context took on each block, in eviction
        priority order.

        A block left without references returns to the free queue: cached
        blocks at the most recently used end (evicted last, in the order
        given), uncached ones at the front. Raises ValueError, and changes
        nothing, for the null block, an unknown id, or more frees of a block
        than this context touched it and has not freed it yet.
        """
        ...

    def new_context(self) -> "SchedulerContext":
        """A context over the same KV cache that counts its own references.

        For a connector that binds others (MultiConnector binds one per
        child), so that each frees only what it touched.
        """
        ...

    def iter_free_blocks(
        self, after_block_id: int | None = None
    ) -> Iterator[KVCacheBlockView]:
        """Free blocks in eviction order (next to be evicted first), from the
        front or from the block after after_block_id.

        A scan resumed after a block that has left the free queue starts at
        the front; one resumed after a block freed again since continues
        from that block's new place. Stop iterating before calling touch()
        or free_blocks(): collect the ids to act on first. Raises ValueError
        for the null block or an unknown id.
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


_INT = frozenset({int})


class KVConnectorSchedulerContext:
    """SchedulerContext over the scheduler's BlockPool.

    Args:
        block_pool: the pool whose blocks connectors see.
        count_references: check each free against the references this
            context took (the default). False only for the deprecated
            bind_gpu_block_pool() path, whose connectors may have touched the
            pool itself: frees are checked against ref_cnt, as in 0.32.0.

    """

    def __init__(self, block_pool: "BlockPool", count_references: bool = True) -> None:
        self._block_pool = block_pool
        self._count_references = count_references
        self._blocks = block_pool.blocks
        self._free_queue = block_pool.free_block_queue
        self._null_block_id = block_pool.null_block.block_id
        # References this context took with touch() and has not freed, by
        # block id (a list: the per-id bookkeeping runs for every id of
        # every call).
        self._touched = [0] * len(self._blocks)

    def _lookup(self, block_id: int, what: str) -> "KVCacheBlock":
        return self._blocks[self._index(block_id, what)]

    def _index(self, block_id: int, what: str) -> int:
        if isinstance(block_id, int | np.integer) and not isinstance(block_id, bool):
            index = int(block_id)
            if 0 <= index < len(self._blocks):
                return index
        raise ValueError(
            f"{what}: unknown block id {block_id!r} of type "
            f"{type(block_id).__name__}; block ids are integers "
            f"0..{len(self._blocks) - 1} (int or numpy integers; pass a numpy "
            "array or tensor of ids as a whole)"
        )

    def _referenceable_ids(self, block_ids: Iterable[int], what: str) -> list[int]:
        """The ids as a list of ints, all checked before the caller changes
        anything. Runs for every touch() and free_blocks(), with up to
        thousands of ids a step, so the checks are bulk operations."""
        if isinstance(block_ids, np.ndarray | torch.Tensor):
            ids = block_ids.tolist()
        else:
            ids = list(block_ids)
        if not ids:
            return ids
        types = set(map(type, ids))
        if not _INT.issuperset(types):
            if all(t is int or issubclass(t, np.integer) for t in types):
                # Numpy integers, as block tables hold them.
                ids = np.array(ids, dtype=np.int64).tolist()
            else:
                ids = [self._index(block_id, what) for block_id in ids]
        if min(ids) < 0 or max(ids) >= len(self._blocks):
            for block_id in ids:
                self._index(block_id, what)
        if self._null_block_id in ids:
            raise ValueError(
                f"{what}: block {self._null_block_id} is the null block, which "
                "holds no KV and is never referenced"
            )
        return ids

    def get_block(self, block_id: int) -> KVCacheBlockView:
        return self._lookup(block_id, "get_block")

    def touch(self, block_ids: Iterable[int]) -> None:
        ids = self._referenceable_ids(block_ids, "touch")
        blocks = self._blocks
        self._block_pool.touch([blocks[block_id] for block_id in ids])
        touched = self._touched
        for block_id in ids:
            touched[block_id] += 1

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        ids = self._referenceable_ids(block_ids, "free_blocks")
        if not ids:
            return
        touched = self._touched
        if len(set(ids)) == len(ids):
            # Each id once, the common case: checked in bulk.
            held = touched.__getitem__ if self._count_references else self._held
            if min(map(held, ids)) < 1:
                self._raise_over_free(Counter(ids))
        else:
            self._raise_over_free(Counter(ids))
        if self._count_references:
            for block_id in ids:
                touched[block_id] -= 1
        else:
            for block_id in ids:
                touched[block_id] = max(touched[block_id] - 1, 0)
        blocks = self._blocks
        self._block_pool.free_blocks([blocks[block_id] for block_id in ids])

    def _raise_over_free(self, frees: Counter[int]) -> None:
        """Raise for the first id freed more often than this context holds
        it; return if there is none."""
        for block_id, count in frees.items():
            held = self._held(block_id)
            if count > held:
                raise ValueError(
                    f"free_blocks: block {block_id} is freed {count} time(s) "
                    f"but this context holds {held} of its "
                    f"{self._blocks[block_id].ref_cnt} reference(s); free only "
                    "blocks you touched, once per touch"
                )

    def _held(self, block_id: int) -> int:
        """The references on a block that this context may drop."""
        if self._count_references:
            return self._touched[block_id]
        return self._blocks[block_id].ref_cnt

    def new_context(self) -> "KVConnectorSchedulerContext":
        return KVConnectorSchedulerContext(self._block_pool)

    def iter_free_blocks(
        self, after_block_id: int | None = None
    ) -> Iterator[KVCacheBlockView]:
        cursor = None
        if after_block_id is not None:
            cursor = self._lookup(after_block_id, "iter_free_blocks")
            if cursor.is_null:
                raise ValueError(
                    f"iter_free_blocks: block {after_block_id} is the null "
                    "block, which is never in the free queue"
                )
            if cursor.ref_cnt > 0:
                cursor = None
        return self._free_queue.iter_blocks_after(cursor)

    def get_num_free_blocks(self) -> int:
        return self._block_pool.get_num_free_blocks()

    def get_cached_block(
        self, content_hash: bytes, group_id: int
    ) -> KVCacheBlockView | None:
        return self._block_pool.cached_block_hash_to_block.get_one_block(
            make_block_hash_with_group_id(BlockHash(content_hash), group_id)
        )

    def get_block_hashes(self, block_id: int) -> list[bytes]:
        block = self._lookup(block_id, "get_block_hashes")
        if block.block_hash is None:
            return []
        return [
            block.block_hash,
            *self._block_pool.cached_block_hashes_by_block.get(block.block_id, ()),
        ]


if TYPE_CHECKING:
    # vLLM's own objects satisfy the protocols; mypy checks it here.
    def _check_structural_types(
        block: "KVCacheBlock", context: KVConnectorSchedulerContext
    ) -> tuple[KVCacheBlockView, SchedulerContext]:
        return block, context

"""Lazy offload (``offload: lazy``): store cached blocks as they near eviction.

Eager offload writes every prompt block right after the step that filled it,
whether or not the local prefix cache would ever drop it. Lazy offload only
looks at the eviction end of the scheduler's free queue, through the stack's
``SchedulerContext`` (``bind_scheduler_context``): the first
``window`` free blocks are the ones the next steps may evict, so a cached
block among them that the store lacks is pinned with ``touch`` (it can be
neither evicted nor reallocated while the workers read it), saved by the
workers at the end of the step, and released with ``free_blocks`` when the
workers report the save done (``SavedBlocks``, the connector's worker
metadata). A pinned block keeps its prefix-cache entry, so requests still hit
it meanwhile.

The scan resumes where the previous step's stopped (``iter_free_blocks``
after the last block it kept), so a step examines only the blocks that
entered the window since, not the whole window again.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorWorkerMetadata,
)
from vllm.v1.core.kv_cache_utils import BlockHashWithGroupId, get_block_hash


@dataclass
class SavedBlocks(KVConnectorWorkerMetadata):
    """Worker to scheduler: pinned blocks whose save this step ended.

    ``failed`` are the ones some rank could not write (store down): they are
    released all the same, but not remembered as stored.
    """

    done: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, SavedBlocks)
        return SavedBlocks(self.done | other.done, self.failed | other.failed)


class LazyOffload:
    """Scheduler side of lazy offload, over one ``SchedulerContext``.

    Args:
        context: the scheduler context bound to the connector.
        window: how many blocks at the eviction end of the free queue to keep
            stored.
        known_stored: how many block hashes to remember as stored, so a
            block that comes back to the window is not written again.
    """

    def __init__(self, context: Any, window: int, known_stored: int) -> None:
        self._context = context
        self._window = window
        self._known_stored = known_stored
        # Free blocks already examined, in free-queue order from the eviction
        # end, with the hash each had then; the last one is the scan cursor.
        self._examined: deque[tuple[Any, BlockHashWithGroupId | None]] = deque()
        self._stored: OrderedDict[bytes, None] = OrderedDict()
        self._pinned: dict[int, tuple[Any, bytes]] = {}

    @property
    def num_pinned(self) -> int:
        return len(self._pinned)

    def mark_stored(self, block_hash: bytes) -> None:
        """Remember that the store holds ``block_hash`` (saved or loaded)."""
        self._stored[block_hash] = None
        self._stored.move_to_end(block_hash)
        while len(self._stored) > self._known_stored:
            self._stored.popitem(last=False)

    def plan(self, save: Callable[[int, bytes], None]) -> None:
        """Pin the window's cached blocks the store lacks and call
        ``save(block_id, block_hash)`` for each. Scheduler thread, inside
        ``build_connector_meta``."""
        # Blocks allocated or hit since the last step left the queue; a block
        # that left from the middle of the window still counts until it
        # reaches the front, so the window is at most that much shorter.
        while self._examined and not self._unchanged(*self._examined[0]):
            self._examined.popleft()
        cursor = None
        if self._examined:
            cursor = self._examined[-1][0]
            if not self._unchanged(*self._examined[-1]):
                self._examined.clear()
                cursor = None
        pin: list[tuple[Any, bytes]] = []
        if len(self._examined) < self._window:
            scan = self._context.iter_free_blocks(cursor)
            for block in scan:
                block_hash = block.block_hash
                plain = None
                if block_hash is not None and block.group_id == 0:
                    plain = bytes(get_block_hash(block_hash))
                if plain is not None and plain not in self._stored:
                    # Pinned blocks leave the free queue, so they are not
                    # kept as examined (nor as the cursor).
                    pin.append((block, plain))
                else:
                    self._examined.append((block, block_hash))
                if len(self._examined) + len(pin) >= self._window:
                    break
            scan.close()
        if pin:
            self._context.touch([block for block, _ in pin])
        for block, plain in pin:
            self._pinned[block.block_id] = (block, plain)
            save(block.block_id, plain)

    def _unchanged(self, block: Any, block_hash: BlockHashWithGroupId | None) -> bool:
        return bool(block.ref_cnt == 0 and block.block_hash == block_hash)

    def on_saved(self, saved: SavedBlocks) -> None:
        """Release the pins of saves the workers finished. Scheduler thread,
        from ``update_connector_output``."""
        release = []
        for block_id in saved.done | saved.failed:
            entry = self._pinned.pop(block_id, None)
            if entry is None:
                continue
            block, plain = entry
            release.append(block)
            if block_id not in saved.failed:
                self.mark_stored(plain)
        if release:
            self._context.free_blocks(release)

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
entered the window since, not the whole window again. The context refuses to
resume after a block that has left the free queue since the scan saw it (even
if it is back, now at the far end); the scan then restarts from the eviction
end.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorWorkerMetadata,
)


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
        # Ids of the free blocks already examined, in free-queue order from
        # the eviction end; the last one is the scan cursor.
        self._examined: deque[int] = deque()
        self._stored: OrderedDict[bytes, None] = OrderedDict()
        # Pinned block id -> the content hash being saved.
        self._pinned: dict[int, bytes] = {}

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
        while self._examined and not self._in_place(self._examined[0]):
            self._examined.popleft()
        scan = None
        if self._examined:
            try:
                scan = self._context.iter_free_blocks(self._examined[-1])
            except ValueError:
                # The cursor left the queue since: restart from the front.
                self._examined.clear()
        pin: list[tuple[int, bytes]] = []
        if len(self._examined) < self._window:
            if scan is None:
                scan = self._context.iter_free_blocks()
            for block in scan:
                content_hash = block.content_hash if block.group_id == 0 else None
                if content_hash is not None and content_hash not in self._stored:
                    # Pinned blocks leave the free queue, so they are not
                    # kept as examined (nor as the cursor).
                    pin.append((block.block_id, bytes(content_hash)))
                else:
                    self._examined.append(block.block_id)
                if len(self._examined) + len(pin) >= self._window:
                    break
        if scan is not None:
            scan.close()
        if pin:
            self._context.touch([block_id for block_id, _ in pin])
        for block_id, content_hash in pin:
            self._pinned[block_id] = content_hash
            save(block_id, content_hash)

    def _in_place(self, block_id: int) -> bool:
        """Whether the block is still where the scan saw it: the context
        resumes after such a block only."""
        try:
            self._context.iter_free_blocks(block_id).close()
        except ValueError:
            return False
        return True

    def on_saved(self, saved: SavedBlocks) -> None:
        """Release the pins of saves the workers finished. Scheduler thread,
        from ``update_connector_output``."""
        release = []
        for block_id in saved.done | saved.failed:
            content_hash = self._pinned.pop(block_id, None)
            if content_hash is None:
                continue
            release.append(block_id)
            if block_id not in saved.failed:
                self.mark_stored(content_hash)
        if release:
            self._context.free_blocks(release)

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

Each step scans the window from the eviction end again: blocks the store
already holds are skipped by a lookup in ``known_stored``, and a step never
looks at more than ``window`` blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice
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
        pin: list[tuple[int, bytes]] = []
        for block in islice(self._context.iter_free_blocks(), self._window):
            content_hash = block.content_hash if block.group_id == 0 else None
            if content_hash is not None and content_hash not in self._stored:
                pin.append((block.block_id, bytes(content_hash)))
        # After the scan: a touched block leaves the free queue.
        if pin:
            self._context.touch([block_id for block_id, _ in pin])
        for block_id, content_hash in pin:
            self._pinned[block_id] = content_hash
            save(block_id, content_hash)

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

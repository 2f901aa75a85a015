"""Test-only ``AIBrixHookConnector`` for ``test_aibrix_e2e.py``: between the
hook's lookup (which pinned the hits) and the load, it deletes every cache
entry of the requests about to load, from L1 and L2 through AIBrix's own
``delete``, and then lets "other traffic" write over all the memory the cache
has free, as other requests or a second server sharing the L2 can do at that
moment. It logs one line per request with what a fresh lookup then finds
(nothing, if the eviction was real), for the test to check.

Writing over all free memory is what makes a lost pin visible: AIBrix's CPU
pool hands out fresh memory from its slab (1 GiB at least, whatever the L1
capacity) before it reuses freed blocks, so a smaller write would not land on
the blocks a missing pin let go.
"""

from __future__ import annotations

import logging
from typing import Any

from aibrix_kvcache import TokenListView  # type: ignore[import-untyped]
from kvlc_aibrix.cache import acquire_prefix, release_all
from kvlc_aibrix.connector import AIBrixHookConnector

logger = logging.getLogger(f"vllm.{__name__}")

# The other traffic's blocks per allocation and what it writes into them.
FLOOD_BLOCKS = 64
FLOOD_VALUE = 3.0


class EvictingAIBrixHookConnector(AIBrixHookConnector):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        cache = self._cache
        assert cache is not None
        for req_id in sorted({lease.req_id for lease in self._pending}):
            tokens = self._tracked[req_id].tokens
            deleted = sum(
                cache.delete(prefix, chunk).is_ok()
                for prefix, chunk, _, _ in cache.cache_chunk_keys(tokens[:0], tokens)
            )
            flooded = self._flood_free_memory()
            aligned = len(tokens) - len(tokens) % cache.block_size
            leases = acquire_prefix(cache, "check", tokens, 0, aligned)
            found = sum(lease.num_tokens for lease in leases)
            release_all(leases)
            logger.warning(
                "EVICTED %d chunks of request %s before its load, then wrote "
                "over %d free cache blocks; a new lookup finds %d tokens",
                deleted,
                req_id,
                flooded,
                found,
            )
        super().start_load_kv(forward_context, **kwargs)

    def _flood_free_memory(self) -> int:
        """Allocate every block the cache can hand out, fill it with
        ``FLOOD_VALUE`` and release it; returns the number of blocks."""
        cache = self._cache
        assert cache is not None
        # allocate_for only sizes the blocks: the tokens are never a key.
        tokens = TokenListView([0] * (FLOOD_BLOCKS * cache.block_size))
        handles = []
        try:
            while (status := cache.allocate_for(None, tokens)).is_ok():
                handles.append(status.value)
                for tensor in status.value.to_tensors():
                    tensor.fill_(FLOOD_VALUE)
        finally:
            for handle in handles:
                handle.release()
        return sum(len(handle) for handle in handles)

"""kvlc_aibrix against the real ``aibrix_kvcache`` cache manager (L1 only,
CPU): a pinned prefix outlives its eviction, and blocks round-trip between a
vLLM-shaped KV cache and AIBrix's blocks byte for byte."""

from __future__ import annotations

import os

import pytest

try:
    import torch
    from aibrix_kvcache import TokenListView
    from kvlc_aibrix.blocks import BlockCopier
    from kvlc_aibrix.cache import acquire_prefix, open_cache, release_all, store
except ImportError as e:
    if os.environ.get("KVLC_REQUIRE_E2E") == "1":
        raise
    pytest.skip(f"kvlc-aibrix is not installed: {e}", allow_module_level=True)

BLOCK = 16
LAYERS = 2
HEADS = 1
HEAD_SIZE = 8
NUM_BLOCKS = 12


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("AIBRIX_KV_CACHE_OL_L1_CACHE_CAPACITY_GB", "0.001")
    monkeypatch.delenv("AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND", raising=False)
    monkeypatch.setenv("AIBRIX_KV_CACHE_OL_BLOCK_SIZE", "-1")
    cache = open_cache(
        block_ntokens=BLOCK,
        dtype=torch.bfloat16,
        heads=list(range(HEADS)),
        layers=list(range(LAYERS)),
        head_size=HEAD_SIZE,
        max_model_len=16 * BLOCK,
        max_num_batched_tokens=16 * BLOCK,
    )
    yield cache
    cache.close()


def kv_caches(blocks_first: bool) -> list[torch.Tensor]:
    """Per-layer KV caches in the two layouts vLLM's backends use."""
    shape = (
        (NUM_BLOCKS, 2, BLOCK, HEADS, HEAD_SIZE)
        if blocks_first
        else (2, NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE)
    )
    return [torch.randn(shape).to(torch.bfloat16) for _ in range(LAYERS)]


def block_of(kv: torch.Tensor, block_id: int) -> torch.Tensor:
    dim = 0 if kv.shape[0] == NUM_BLOCKS else 1
    return kv.narrow(dim, block_id, 1)


@pytest.mark.parametrize("blocks_first", [True, False])
def test_pinned_prefix_survives_eviction_before_its_load(cache, blocks_first: bool):
    tokens = TokenListView(list(range(1000, 1000 + 4 * BLOCK)))
    source = kv_caches(blocks_first)
    copier = BlockCopier(source, NUM_BLOCKS, BLOCK, [], [])
    copier.check_block_shape(cache.block_spec.block_shape, torch.bfloat16)
    assert not copier.use_aibrix_op  # CPU: torch copies
    src_ids = [3, 7, 1, 9]
    stored = store(
        cache, tokens, 0, 4 * BLOCK, lambda first, t: copier.save(src_ids, first, t)
    )
    assert stored == 4 * BLOCK

    # The worker hook's lookup: pin the prefix.
    leases = acquire_prefix(cache, "r", tokens, 0, 4 * BLOCK)
    assert sum(lease.num_tokens for lease in leases) == 4 * BLOCK
    # Evicted before the load: a new lookup misses...
    for prefix, chunk, _, _ in cache.cache_chunk_keys(tokens[:0], tokens):
        assert cache.delete(prefix, chunk).is_ok()
    assert acquire_prefix(cache, "other", tokens, 0, 4 * BLOCK) == []
    # ... and allocating over the freed space must not reuse pinned memory.
    junk = TokenListView(list(range(5000, 5000 + 4 * BLOCK)))
    store(cache, junk, 0, 4 * BLOCK, lambda first, t: [b.fill_(7) for b in t])

    # The load still writes what was stored, into other blocks.
    target = kv_caches(blocks_first)
    loader = BlockCopier(target, NUM_BLOCKS, BLOCK, [], [])
    dst_ids = [0, 2, 4, 6]
    try:
        for lease in leases:
            loader.load(dst_ids, lease.first_token, lease.tensors())
    finally:
        release_all(leases)
    for layer in range(LAYERS):
        for s, d in zip(src_ids, dst_ids, strict=True):
            assert torch.equal(block_of(target[layer], d), block_of(source[layer], s))


def test_acquire_prefix_stops_at_the_first_missing_chunk(cache):
    tokens = TokenListView(list(range(8 * BLOCK)))
    fill = lambda first, t: [b.fill_(1) for b in t]  # noqa: E731
    # The cache keys 4-block chunks: store only the first.
    assert store(cache, tokens, 0, 4 * BLOCK, fill) == 4 * BLOCK
    leases = acquire_prefix(cache, "r", tokens, 0, 8 * BLOCK)
    try:
        assert [(x.first_token, x.num_tokens) for x in leases] == [(0, 4 * BLOCK)]
    finally:
        release_all(leases)
    assert leases == []

"""AIBrix's KV cache manager, opened for one worker, and the two things the
connector does with it: pin a cached prefix (a lease) and store new blocks.

The cache is ``aibrix_kvcache.BaseKVCacheManager`` as AIBrix ships it: its L1
CPU cache and, when ``AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND`` is set, its L2
(``SHFS``: a directory several servers share). It is configured by AIBrix's
own ``AIBRIX_KV_CACHE_OL_*`` environment variables.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from aibrix_kvcache import (  # type: ignore[import-untyped]
    BaseKVCacheManager,
    KVCacheBlockLayout,
    KVCacheBlockSpec,
    KVCacheConfig,
    KVCacheHandle,
    KVCacheTensorSpec,
    ModelSpec,
    TokenListView,
)
from aibrix_kvcache import cache_manager as aibrix_cache_manager

logger = logging.getLogger(f"vllm.{__name__}")


def open_cache(
    *,
    block_ntokens: int,
    dtype: torch.dtype,
    heads: list[int],
    layers: list[int],
    head_size: int,
    max_model_len: int,
    max_num_batched_tokens: int,
) -> BaseKVCacheManager:
    """Open AIBrix's cache manager for one worker's slice of the KV (its
    heads and layers: AIBrix keys L2 entries by them, so TP ranks sharing an
    L2 directory never read each other's blocks).

    AIBrix pins its CPU pool when ``AIBRIX_KV_CACHE_OL_DEVICE`` is ``cpu``;
    pinning needs an accelerator, so without one it is turned off through
    AIBrix's own switch for that (a module flag of ``cache_manager``).
    """
    if not torch.cuda.is_available():
        aibrix_cache_manager.TESTING_DISABLE_PIN_MEMORY = True
    spec = KVCacheBlockSpec(
        block_ntokens=block_ntokens,
        block_dtype=dtype,
        block_layout=KVCacheBlockLayout.LCND,
        tensor_spec=KVCacheTensorSpec(heads=heads, layers=layers, head_size=head_size),
    )
    config = KVCacheConfig(
        block_spec=spec,
        model_spec=ModelSpec(max_model_len, max_num_batched_tokens),
    )
    return BaseKVCacheManager(config=config)


@dataclass
class Lease:
    """Blocks of one cache chunk, pinned until :meth:`release`: AIBrix's
    handle holds a reference on their memory, so an eviction from L1 (or a
    deletion from L2) after the lookup cannot free or change them.
    """

    req_id: str
    # The prompt position of the first token the chunk holds.
    first_token: int
    num_tokens: int
    handle: KVCacheHandle

    def tensors(self) -> Sequence[torch.Tensor]:
        """One tensor per cache block, in AIBrix's block shape."""
        return list(self.handle.to_tensors())

    def release(self) -> None:
        self.handle.release()


def acquire_prefix(
    cache: BaseKVCacheManager,
    req_id: str,
    tokens: TokenListView,
    start: int,
    end: int,
) -> list[Lease]:
    """Pin the cached blocks of ``tokens[start:end]`` (both multiples of the
    cache block size), chunk by chunk as AIBrix keys them, up to the first
    chunk it does not hold whole. The caller owns the leases: every one must
    be released; on an error here the ones already taken are released.
    """
    leases: list[Lease] = []
    try:
        for prefix, chunk, _next, _all in cache.cache_chunk_keys(
            tokens[:start], tokens[start:end]
        ):
            status = cache.acquire(prefix, chunk)
            if not status.is_ok():
                if not status.is_not_found():
                    logger.warning("AIBrix cache lookup failed: %s", status)
                break
            num_tokens, handle = status.value
            leases.append(Lease(req_id, len(prefix), num_tokens, handle))
            if num_tokens < len(chunk):
                break
    except BaseException:
        release_all(leases)
        raise
    return leases


def release_all(leases: list[Lease]) -> None:
    """Release every lease, even if one release fails (the first error is
    raised after the others were released)."""
    error: BaseException | None = None
    for lease in leases:
        try:
            lease.release()
        except BaseException as e:  # noqa: BLE001 - release the rest first
            error = error or e
    leases.clear()
    if error is not None:
        raise error


def store(
    cache: BaseKVCacheManager,
    tokens: TokenListView,
    start: int,
    end: int,
    fill: Callable[[int, Sequence[torch.Tensor]], None],
) -> int:
    """Store the blocks of ``tokens[start:end]`` (multiples of the cache block
    size) that the cache lacks, as AIBrix's own connector does after a step:
    per chunk, skip the blocks it holds, allocate the rest, let
    ``fill(first_token, tensors)`` copy the engine's KV into them, and put
    them. Returns the number of tokens put.
    """
    block = cache.block_size
    stored = 0
    for prefix, chunk, _next, everything in cache.cache_chunk_keys(
        tokens[:start], tokens[start:end]
    ):
        exists = cache.exists(prefix, chunk)
        if exists.is_ok():
            held = exists.value
            if len(chunk) - held < block:
                continue
            cut = len(prefix) + held
            prefix, chunk = everything[:cut], everything[cut : cut + len(chunk) - held]
        status = cache.allocate_for(prefix, chunk)
        if not status.is_ok():
            logger.warning("AIBrix cache allocation failed: %s", status)
            break
        handle = status.value
        tensors = handle.to_tensors()
        try:
            fill(len(prefix), tensors)
        except BaseException:
            handle.release()
            raise
        length = len(tensors) * block
        put = cache.put(prefix, chunk[:length], handle)  # put owns the handle
        if not put.is_ok():
            logger.warning("AIBrix cache put failed: %s", put)
            break
        stored += put.value
        if put.value != length:
            break
    return stored

"""Copies between vLLM's paged KV cache and AIBrix's cache blocks.

Two ways, chosen once per worker:

* AIBrix's compiled op (``reshape_and_cache_multi_layer`` and
  ``reshape_and_offload_multi_layer``), when the KV cache is on a CUDA device
  and ``aibrix_kvcache._aibrix_C`` loaded: the path AIBrix's own connector
  takes, with its block layout ``LCND`` (FlashAttention / FlashInfer caches);
* ``torch`` copies otherwise (CPU: the op is built against CUDA and does not
  load). Each AIBrix block then holds, per layer, the bytes of one engine
  block in the engine's own layout; both sides of the copy use the same
  layout, so what one server stores another with the same model, dtype and
  attention backend loads.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch


def aibrix_op_available() -> bool:
    """Whether AIBrix's compiled cache ops are registered with torch."""
    try:
        import aibrix_kvcache._custom_ops  # type: ignore[import-untyped]  # noqa: F401

        return hasattr(torch.ops._aibrix_C_cache_ops, "reshape_and_cache_multi_layer")
    except (ImportError, AttributeError, RuntimeError):
        return False


class BlockCopier:
    """Moves whole engine blocks between ``layers`` (vLLM's KV cache tensors,
    in AIBrix's layer order) and AIBrix block tensors."""

    def __init__(
        self,
        layers: list[torch.Tensor],
        num_blocks: int,
        block_ntokens: int,
        k_scales: list[torch.Tensor],
        v_scales: list[torch.Tensor],
    ) -> None:
        self.layers = layers
        self.block_ntokens = block_ntokens
        self.k_scales = k_scales
        self.v_scales = v_scales
        self.use_aibrix_op = layers[0].is_cuda and aibrix_op_available()
        self.blocks_first = layers[0].shape[0] == num_blocks
        # The dimension of each layer's tensor that indexes blocks: vLLM's
        # CPU and GPU backends put it first or right after the K/V split.
        self._dims: list[int] = []
        for kv in layers:
            if kv.shape[0] == num_blocks:
                self._dims.append(0)
            elif kv.dim() >= 2 and kv.shape[0] == 2 and kv.shape[1] == num_blocks:
                self._dims.append(1)
            else:
                raise ValueError(
                    f"AIBrixHookConnector: cannot find the block dimension of a "
                    f"KV cache of shape {tuple(kv.shape)} ({num_blocks} blocks)"
                )

    def check_block_shape(self, block_shape: Sequence[int], dtype: torch.dtype) -> None:
        """Fail early if an AIBrix block cannot hold one engine block per
        layer (torch path) - a different dtype or a padded engine layout."""
        if self.use_aibrix_op:
            return
        per_layer = 1
        for n in block_shape[1:]:
            per_layer *= n
        for kv, dim in zip(self.layers, self._dims, strict=True):
            engine = kv.narrow(dim, 0, 1)
            if engine.numel() != per_layer or kv.dtype != dtype:
                raise ValueError(
                    f"AIBrixHookConnector: an engine block of shape "
                    f"{tuple(engine.shape)} ({kv.dtype}) does not fill an AIBrix "
                    f"block layer of {per_layer} {dtype} values; set "
                    f"AIBRIX_KV_CACHE_OL_BLOCK_SIZE to the engine's block size"
                )

    def _slots(
        self, block_ids: list[int], first_token: int, num_tokens: int
    ) -> torch.Tensor:
        pos = torch.arange(first_token, first_token + num_tokens)
        ids = torch.tensor(block_ids, dtype=torch.long)[pos // self.block_ntokens]
        slots = ids * self.block_ntokens + pos % self.block_ntokens
        return slots.to(self.layers[0].device)

    def load(
        self,
        block_ids: list[int],
        first_token: int,
        blocks: Sequence[torch.Tensor],
    ) -> None:
        """Write AIBrix ``blocks`` (from prompt position ``first_token``) into
        the request's engine blocks ``block_ids`` (all of the request's)."""
        if self.use_aibrix_op:
            from aibrix_kvcache._custom_ops import (
                reshape_and_cache_multi_layer,
            )

            n = len(blocks) * blocks[0].shape[2]  # LCND: tokens are dim 2
            reshape_and_cache_multi_layer(
                list(blocks), self.layers, self._slots(block_ids, first_token, n),
                self.block_ntokens, "auto", self.k_scales, self.v_scales,
                "LCND", self.blocks_first,
            )  # fmt: skip
            return
        for engine, cached in self._pairs(block_ids, first_token, blocks):
            engine.copy_(cached.reshape(engine.shape))

    def save(
        self,
        block_ids: list[int],
        first_token: int,
        blocks: Sequence[torch.Tensor],
    ) -> None:
        """Read the request's engine blocks from prompt position
        ``first_token`` on into the AIBrix ``blocks``."""
        if self.use_aibrix_op:
            from aibrix_kvcache._custom_ops import (
                reshape_and_offload_multi_layer,
            )

            n = len(blocks) * blocks[0].shape[2]
            reshape_and_offload_multi_layer(
                list(blocks), self.layers, self._slots(block_ids, first_token, n),
                self.block_ntokens, "auto", self.k_scales, self.v_scales,
                "LCND", self.blocks_first,
            )  # fmt: skip
            return
        for engine, cached in self._pairs(block_ids, first_token, blocks):
            cached.copy_(engine.reshape(cached.shape))

    def _pairs(
        self,
        block_ids: list[int],
        first_token: int,
        blocks: Sequence[torch.Tensor],
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer of each AIBrix block beside the engine block it mirrors
        (a view into the KV cache): load and save copy the same pairs, in
        opposite directions."""
        first = first_token // self.block_ntokens
        for i, block in enumerate(blocks):
            for layer, (kv, dim) in enumerate(
                zip(self.layers, self._dims, strict=False)
            ):
                yield kv.narrow(dim, block_ids[first + i], 1), block[layer]

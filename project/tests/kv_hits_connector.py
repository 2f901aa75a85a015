"""A KV connector for the before_update_states end-to-end tests.

Its worker side keeps KV blocks on disk, keyed by the prompt and the TP rank:

* ``capture``: after the forward step that prefilled a prompt, save the
  prompt's blocks (the KV the model computed) and report no hits;
* ``load``: for a prompt saved before, report ``hit_tokens`` (per TP rank, so
  ranks can disagree) from ``before_update_states`` and write the saved blocks
  back in ``start_load_kv``, before the forward;
* ``garbage``: the same report, but write random values instead.

With ``"hit_on": "continuation"`` (chunked prefill), ``load`` reports the hit
in the request's second chunk instead of its first, and writes back the saved
blocks from that chunk on.

Every rank appends the number of tokens each forward step computed to
``<path>/steps-rank<r>.jsonl`` (measured from the step's slot mapping).
The scheduler side matches nothing: every hit comes from the worker hook.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class _EmptyMetadata(KVConnectorMetadata):
    pass


class RecordedKVConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.mode: str = extra["mode"]
        self.path = Path(extra["path"])
        self.hit_tokens: list[int] = extra.get("hit_tokens", [0])
        self.hit_on: str = extra.get("hit_on", "first")
        self.block_size = vllm_config.cache_config.block_size
        # Saved prompts of running requests waiting for their second chunk:
        # (file, block ids so far, prompt length).
        self.continuations: dict[str, tuple[Path, list[int], int]] = {}
        self.num_blocks = kv_cache_config.num_blocks
        self.kv_caches: dict[str, torch.Tensor] = {}
        # Blocks to save after this step's forward, or to write before it.
        self.to_save: list[tuple[Path, list[int]]] = []
        # (file, block ids of the request, index of the first block to write)
        self.to_load: list[tuple[Path, list[int], int]] = []

    # Worker side.

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches

    def _file(self, prompt_token_ids: list[int]) -> Path:
        key = hashlib.sha256(json.dumps(prompt_token_ids).encode()).hexdigest()[:16]
        return self.path / f"kv-{key}-rank{get_tensor_model_parallel_rank()}.pt"

    def before_update_states(self, scheduler_output: SchedulerOutput) -> dict[str, int]:
        hits: dict[str, int] = {}
        rank = get_tensor_model_parallel_rank()
        for req in scheduler_output.scheduled_new_reqs:
            assert req.prompt_token_ids is not None
            file = self._file(req.prompt_token_ids)
            if self.mode == "capture":
                self.to_save.append((file, req.block_ids[0]))
            elif not file.exists():
                continue
            elif self.hit_on == "continuation":
                self.continuations[req.req_id] = (
                    file,
                    list(req.block_ids[0]),
                    len(req.prompt_token_ids),
                )
            else:
                self.to_load.append((file, req.block_ids[0], 0))
                hits[req.req_id] = self.hit_tokens[rank % len(self.hit_tokens)]
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, num_computed, new_block_ids in zip(
            cached.req_ids, cached.num_computed_tokens, cached.new_block_ids
        ):
            if req_id not in self.continuations:
                continue
            file, block_ids, prompt_len = self.continuations.pop(req_id)
            # This connector loads whole blocks: a prompt past its end
            # (decoding) or a chunk starting inside a block (a short prompt
            # split by the shared token budget) gets no hit.
            if num_computed >= prompt_len or num_computed % self.block_size:
                continue
            if new_block_ids is not None:
                block_ids += new_block_ids[0]
            self.to_load.append((file, block_ids, num_computed // self.block_size))
            hits[req_id] = self.hit_tokens[rank % len(self.hit_tokens)]
        return hits

    def _block_dim(self, kv: torch.Tensor) -> int:
        return list(kv.shape).index(self.num_blocks)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        slot_mapping = forward_context.slot_mapping
        if isinstance(slot_mapping, dict) and slot_mapping:
            num_tokens = next(iter(slot_mapping.values())).shape[0]
            rank = get_tensor_model_parallel_rank()
            with open(self.path / f"steps-rank{rank}.jsonl", "a") as f:
                f.write(json.dumps({"num_tokens": num_tokens}) + "\n")
        for file, block_ids, first in self.to_load:
            saved = torch.load(file)
            for name, kv in self.kv_caches.items():
                dim = self._block_dim(kv)
                index = torch.tensor(block_ids[first : saved[name].shape[dim]])
                blocks = saved[name].narrow(dim, first, len(index))
                if self.mode == "garbage":
                    blocks = torch.randn_like(blocks) * 10
                kv.index_copy_(dim, index, blocks.to(kv.dtype))
        self.to_load.clear()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: Any,
        **kwargs: Any,
    ) -> None:
        return

    def wait_for_save(self) -> None:
        for file, block_ids in self.to_save:
            saved = {
                name: kv.index_select(self._block_dim(kv), torch.tensor(block_ids))
                for name, kv in self.kv_caches.items()
            }
            torch.save(saved, file)
        self.to_save.clear()

    # Scheduler side: no matches, the worker hook reports them.

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        return

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> KVConnectorMetadata:
        return _EmptyMetadata()

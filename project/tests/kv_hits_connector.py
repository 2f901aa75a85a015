"""A KV connector for the before_update_states end-to-end tests.

Each request says what the connector does with it, in its sampling params'
``extra_args["recorded_kv"]``: ``{"mode": ..., "path": DIR, "hit_tokens":
[per TP rank], "hit_on": "first"|"continuation"}``; a request without them is
left alone. One engine thus runs a capture, then loads of what it saved.
The worker side keeps KV blocks on disk under ``path``, keyed by the prompt
and the TP rank:

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
``<path>/steps-rank<r>.jsonl`` (measured from the step's slot mapping), the
``path`` of the latest new request: the runs of one engine come one after
another.
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
        self.block_size = vllm_config.cache_config.block_size
        # Where this run's steps are recorded (the latest new request's path).
        self.path: Path | None = None
        # Saved prompts of running requests waiting for their second chunk:
        # (file, block ids so far, prompt length, hit tokens, garbage).
        self.continuations: dict[str, tuple[Path, list[int], int, int, bool]] = {}
        self.num_blocks = kv_cache_config.num_blocks
        self.kv_caches: dict[str, torch.Tensor] = {}
        # Blocks to save after this step's forward, or to write before it.
        self.to_save: list[tuple[Path, list[int]]] = []
        # (file, block ids of the request, index of the first block to write,
        # garbage instead of the saved blocks)
        self.to_load: list[tuple[Path, list[int], int, bool]] = []

    # Worker side.

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches

    @staticmethod
    def _file(path: Path, prompt_token_ids: list[int]) -> Path:
        key = hashlib.sha256(json.dumps(prompt_token_ids).encode()).hexdigest()[:16]
        return path / f"kv-{key}-rank{get_tensor_model_parallel_rank()}.pt"

    def before_update_states(self, scheduler_output: SchedulerOutput) -> dict[str, int]:
        hits: dict[str, int] = {}
        rank = get_tensor_model_parallel_rank()
        for req in scheduler_output.scheduled_new_reqs:
            assert req.prompt_token_ids is not None
            extra_args = req.sampling_params and req.sampling_params.extra_args
            run = (extra_args or {}).get("recorded_kv")
            if run is None:
                continue
            self.path = Path(run["path"])
            mode = run["mode"]
            hit_tokens = run.get("hit_tokens", [0])
            hit = hit_tokens[rank % len(hit_tokens)]
            file = self._file(self.path, req.prompt_token_ids)
            if mode == "capture":
                self.to_save.append((file, req.block_ids[0]))
            elif not file.exists():
                continue
            elif run.get("hit_on", "first") == "continuation":
                self.continuations[req.req_id] = (
                    file,
                    list(req.block_ids[0]),
                    len(req.prompt_token_ids),
                    hit,
                    mode == "garbage",
                )
            else:
                self.to_load.append((file, req.block_ids[0], 0, mode == "garbage"))
                hits[req.req_id] = hit
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, num_computed, new_block_ids in zip(
            cached.req_ids, cached.num_computed_tokens, cached.new_block_ids
        ):
            if req_id not in self.continuations:
                continue
            file, block_ids, prompt_len, hit, garbage = self.continuations.pop(req_id)
            # This connector loads whole blocks: a prompt past its end
            # (decoding) or a chunk starting inside a block (a short prompt
            # split by the shared token budget) gets no hit.
            if num_computed >= prompt_len or num_computed % self.block_size:
                continue
            if new_block_ids is not None:
                block_ids += new_block_ids[0]
            first = num_computed // self.block_size
            self.to_load.append((file, block_ids, first, garbage))
            hits[req_id] = hit
        return hits

    def _block_dim(self, kv: torch.Tensor) -> int:
        return list(kv.shape).index(self.num_blocks)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        slot_mapping = forward_context.slot_mapping
        if isinstance(slot_mapping, dict) and slot_mapping and self.path:
            num_tokens = next(iter(slot_mapping.values())).shape[0]
            rank = get_tensor_model_parallel_rank()
            with open(self.path / f"steps-rank{rank}.jsonl", "a") as f:
                f.write(json.dumps({"num_tokens": num_tokens}) + "\n")
        for file, block_ids, first, garbage in self.to_load:
            saved = torch.load(file)
            for name, kv in self.kv_caches.items():
                dim = self._block_dim(kv)
                index = torch.tensor(block_ids[first : saved[name].shape[dim]])
                blocks = saved[name].narrow(dim, first, len(index)).to(kv.dtype)
                if garbage:
                    blocks = torch.randn_like(blocks) * 10
                else:
                    # The output must come from this write: an engine that
                    # ran the capture before must not have left this KV in
                    # these blocks (its free blocks are handed out least
                    # recently used first, and runs use a few of many).
                    assert not torch.equal(kv.index_select(dim, index), blocks), (
                        f"blocks {index.tolist()} already hold the KV to load"
                    )
                kv.index_copy_(dim, index, blocks)
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

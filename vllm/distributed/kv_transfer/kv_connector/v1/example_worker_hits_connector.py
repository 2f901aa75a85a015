# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An example KV connector whose workers report their own hits through
KVConnectorBase_V1.before_update_states() (see docs/features/disagg_prefill.md).

Each worker keeps the KV of full prompt blocks in its process memory, keyed
by vLLM's block hashes (Request.block_hashes, sent by the scheduler side in
the connector metadata) inside a namespace for what the hashes leave out.
It is an example, not a cache: nothing is evicted, at most
``max_stored_blocks`` blocks (extra config, default 256) are kept, on the
device of the KV cache, only requests scheduled for the first time are stored
or hit, and the KV layout per layer must be ``[2, num_blocks, ...]``
(FlashAttention's and the CPU backend's).

Use it with::

    --kv-transfer-config '{"kv_connector": "ExampleWorkerHitsConnector",
        "kv_connector_module_path":
        "vllm.distributed.kv_transfer.kv_connector.v1.example_worker_hits_connector",
        "kv_role": "kv_both"}'
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.v1.core.sched.output import SchedulerOutput

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import BlockHash
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# (namespace, block hash) -> the block's KV per layer.
StoreKey = tuple[str, "BlockHash"]


@dataclass
class ExampleWorkerHitsRequest:
    block_hashes: list["BlockHash"]
    block_ids: list[int]
    # Full prompt blocks whose KV is in place once this step ran.
    num_full_blocks: int


@dataclass
class ExampleWorkerHitsMetadata(KVConnectorMetadata):
    # Requests scheduled for the first time in this step.
    requests: dict[str, ExampleWorkerHitsRequest] = field(default_factory=dict)


def store_namespace(vllm_config: "VllmConfig", tp_rank: int) -> str:
    """What a block's KV depends on besides its block hash. Block hashes
    cover the tokens, multimodal inputs, the LoRA adapter and cache_salt,
    not the model, the tensor-parallel layout, the dtype or the block size:
    keys of a store that outlives one engine must include them."""
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    return "|".join(
        [
            model_config.model,
            model_config.revision or "",
            str(model_config.dtype),
            cache_config.cache_dtype,
            str(cache_config.block_size),
            f"tp{vllm_config.parallel_config.tensor_parallel_size}",
            f"rank{tp_rank}",
        ]
    )


class ExampleWorkerHitsConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig",
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        # Scheduler side: block hashes of requests allocated in this pass.
        self._new_block_hashes: dict[str, list[BlockHash]] = {}
        # Worker side.
        self.store: dict[StoreKey, dict[str, torch.Tensor]] = {}
        # Each stored block is a copy outside vLLM's KV cache budget.
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.max_stored_blocks = int(extra.get("max_stored_blocks", 256))
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.namespace = ""
        # Request id -> (block id, key) of each block reported as a hit.
        self._reported: dict[str, list[tuple[int, StoreKey]]] = {}
        self._to_load: list[tuple[int, StoreKey]] = []

    # ==============================
    # Scheduler side
    # ==============================
    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int, bool]:
        # Hits are found on the workers (before_update_states), not here.
        return 0, False

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        self._new_block_hashes[request.request_id] = list(request.block_hashes)

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> KVConnectorMetadata:
        meta = ExampleWorkerHitsMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            block_hashes = self._new_block_hashes.get(new_req.req_id, [])
            num_tokens = min(
                new_req.num_computed_tokens
                + scheduler_output.num_scheduled_tokens[new_req.req_id],
                len(new_req.prompt_token_ids or ()),
            )
            meta.requests[new_req.req_id] = ExampleWorkerHitsRequest(
                block_hashes=block_hashes,
                block_ids=list(new_req.block_ids[0]),
                num_full_blocks=min(num_tokens // self.block_size, len(block_hashes)),
            )
        self._new_block_hashes = {}
        return meta

    # ==============================
    # Worker side
    # ==============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        self.namespace = store_namespace(
            self._vllm_config, get_tensor_model_parallel_rank()
        )

    def key(self, block_hash: "BlockHash") -> StoreKey:
        return (self.namespace, block_hash)

    def before_update_states(self, scheduler_output: SchedulerOutput) -> dict[str, int]:
        meta = scheduler_output.kv_connector_metadata
        assert isinstance(meta, ExampleWorkerHitsMetadata)
        hits: dict[str, int] = {}
        for new_req in scheduler_output.scheduled_new_reqs:
            req = meta.requests.get(new_req.req_id)
            if req is None or new_req.num_computed_tokens % self.block_size:
                continue
            first = new_req.num_computed_tokens // self.block_size
            blocks: list[tuple[int, StoreKey]] = []
            for block_id, block_hash in zip(
                req.block_ids[first:], req.block_hashes[first:]
            ):
                if self.key(block_hash) not in self.store:
                    break
                blocks.append((block_id, self.key(block_hash)))
            if blocks:
                self._reported[new_req.req_id] = blocks
                hits[new_req.req_id] = len(blocks) * self.block_size
        return hits

    def on_external_hits_applied(self, applied: dict[str, int]) -> None:
        # Load only what every rank agreed on; the rest is computed.
        for req_id, num_tokens in applied.items():
            num_blocks = -(-num_tokens // self.block_size)
            self._to_load.extend(self._reported.get(req_id, [])[:num_blocks])
        self._reported.clear()

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        for block_id, key in self._to_load:
            for layer_name, kv_cache in self.kv_caches.items():
                kv_cache[:, block_id].copy_(self.store[key][layer_name])
        self._to_load.clear()

    def wait_for_layer_load(self, layer_name: str) -> None:
        # start_load_kv() copied every layer already.
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: "AttentionMetadata",
        **kwargs: Any,
    ) -> None:
        # Saved in wait_for_save(), once every layer ran.
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ExampleWorkerHitsMetadata)
        for req in meta.requests.values():
            for block_id, block_hash in zip(
                req.block_ids[: req.num_full_blocks],
                req.block_hashes[: req.num_full_blocks],
            ):
                key = self.key(block_hash)
                if len(self.store) >= self.max_stored_blocks:
                    return
                if key not in self.store:
                    self.store[key] = {
                        name: kv_cache[:, block_id].clone()
                        for name, kv_cache in self.kv_caches.items()
                    }

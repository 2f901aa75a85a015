"""vLLM's real V1 ``Scheduler`` with no model and no workers.

For drivers and benchmarks that step the scheduler by hand: the caller picks
the model, scheduler, cache and connector configs; the harness adds a KV
cache of ``num_blocks`` blocks in one full-attention group (one layer, one
head of size 1: the scheduler only counts blocks) and builds the scheduler
the way the engine core does. Uses only APIs the unpatched vLLM 0.32.0 has,
so the same code runs against every build being compared.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.structured_output import StructuredOutputManager


def one_group_kv_cache_config(num_blocks: int, block_size: int) -> KVCacheConfig:
    """A KV cache of ``num_blocks`` blocks, one full-attention layer."""
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            )
        ],
    )


def make_scheduler(
    *,
    model_config: ModelConfig,
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    kv_transfer_config: KVTransferConfig | None,
    num_blocks: int,
    device_config: DeviceConfig | None = None,
) -> Scheduler:
    """A scheduler over ``num_blocks`` KV blocks of ``cache_config.block_size``
    tokens, with the connector of ``kv_transfer_config`` (None: no connector)
    and stats on."""
    # As asked, even if the platform's config check would pick another size.
    block_size = cache_config.block_size
    # VllmConfig's own default DeviceConfig unless the caller names one.
    extra: dict[str, Any] = {}
    if device_config is not None:
        extra["device_config"] = device_config
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer_config,
        **extra,
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=one_group_kv_cache_config(num_blocks, block_size),
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
    )

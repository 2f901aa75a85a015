"""Build the patched LMCacheConnectorV1 on the real ``lmcache`` adapter; print JSON.

Run with the python of build/venv-lmcache (see project/ci/venv-lmcache):
``python lmcache_hma_driver.py MODEL_DIR``. Prints one line starting with
``RESULT ``: the installed versions, the hybrid KV cache manager decision, and
per case the group the connector selected (or the error it raised), how many
times LMCache's adapter was built and the block ids its ``request_finished``
received.
"""

from __future__ import annotations

import json
import sys
from importlib import metadata
from typing import Any

BLOCK_SIZE = 128  # the CPU block size


def main() -> None:
    import torch
    from lmcache.integration.vllm import vllm_v1_adapter
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_transfer.kv_connector.factory import (
        KVConnectorFactory,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorRole,
        supports_hma,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import (
        LMCacheConnectorV1,
    )
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheSpec,
        SlidingWindowSpec,
    )

    real_impl = vllm_v1_adapter.LMCacheConnectorV1Impl
    built: list[Any] = []
    finished: list[list[int]] = []

    class CountingImpl(real_impl):
        """The real adapter, counting constructions and finished block ids."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

        def request_finished(self, request: Any, block_ids: list[int]) -> Any:
            finished.append(list(block_ids))
            return super().request_finished(request, block_ids)

    class HybridDeclaringImpl(CountingImpl):
        """The real adapter, declaring that it follows the connector's group
        (what an LMCache release with hybrid support declares)."""

        kv_cache_group_id: int | None = None

    full = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype=torch.float32
    )
    sliding = SlidingWindowSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=1,
        head_size=64,
        dtype=torch.float32,
        sliding_window=BLOCK_SIZE,
    )

    def kv_cache_config(*specs: KVCacheSpec) -> KVCacheConfig:
        return KVCacheConfig(
            num_blocks=16,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], spec)
                for i, spec in enumerate(specs)
            ],
        )

    vllm_config = VllmConfig(
        model_config=ModelConfig(model=sys.argv[1], max_model_len=1024),
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="LMCacheConnectorV1", kv_role="kv_both"
        ),
    )
    assert vllm_config.kv_transfer_config is not None

    class FinishedRequest:
        request_id = "req-0"
        status = None
        kv_transfer_params = None

    def build(impl: type, specs: tuple[KVCacheSpec, ...]) -> dict[str, Any]:
        vllm_v1_adapter.LMCacheConnectorV1Impl = impl
        built.clear()
        finished.clear()
        case: dict[str, Any] = {}
        try:
            connector = LMCacheConnectorV1(
                vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config(*specs)
            )
        except ValueError as e:
            case["error"] = str(e)
        else:
            case["kv_cache_group_id"] = connector.kv_cache_group_id
            case["kv_cache_config_public"] = (
                connector.kv_cache_config is connector._kv_cache_config
            )
            block_ids = tuple([10 * g + 1, 10 * g + 2] for g in range(len(specs)))
            case["finished_result"] = connector.request_finished_all_groups(
                FinishedRequest(), block_ids
            )
        case["adapters_built"] = len(built)
        case["finished_block_ids"] = list(finished)
        return case

    def build_unwrapped(impl: type, specs: tuple[KVCacheSpec, ...]) -> dict[str, Any]:
        """build() on the adapter class itself, its __init__ counted in place."""
        real_init = impl.__init__

        def counting_init(self: Any, *args: Any, **kwargs: Any) -> None:
            real_init(self, *args, **kwargs)
            built.append(self)

        impl.__init__ = counting_init
        try:
            return build(impl, specs)
        finally:
            impl.__init__ = real_init

    result = {
        "lmcache": metadata.version("lmcache"),
        "vllm": metadata.version("vllm"),
        "adapter": f"{real_impl.__module__}.{real_impl.__qualname__}",
        "supports_hma": supports_hma(LMCacheConnectorV1),
        "supports_hma_config": KVConnectorFactory.supports_hma_config(
            vllm_config.kv_transfer_config
        ),
        "disable_hybrid_kv_cache_manager": (
            vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
        ),
        "single_group": build(CountingImpl, (full,)),
        "single_group_plain_adapter": build_unwrapped(real_impl, (full,)),
        "hybrid_real_adapter": build_unwrapped(real_impl, (sliding, full)),
        "hybrid_declaring_adapter": build(HybridDeclaringImpl, (sliding, full)),
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

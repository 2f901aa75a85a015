"""The patched LMCacheConnectorV1 on the real ``lmcache`` adapter; prints JSON.

Run with the python of build/venv-lmcache (``./wb venv --lmcache``):

``python lmcache_hma_driver.py connector MODEL_DIR``
    builds the connector (scheduler role) on LMCache's own adapter and prints
    ``RESULT {...}``: the installed versions, the hybrid KV cache manager
    decision with the warnings logged for it, and per case the groups the
    connector forwards and reports restored (or the error it raised), how many
    times the adapter was built and the block ids its ``request_finished``
    received.

``python lmcache_hma_driver.py decide MODEL_DIR``
    builds a ``VllmConfig`` with ``LMCacheConnectorV1`` in a process that has
    not imported ``lmcache`` and prints ``RESULT {...}``: the hybrid KV cache
    manager decision, whether ``lmcache`` got imported making it and what
    that import cost (the first config less the same config built again);
    then the decision for ``LMCacheMPConnector``, LMCache's multi-process
    connector.

``python lmcache_hma_driver.py repeat MODEL_DIR``
    starts one engine on MODEL_DIR with ``LMCacheConnectorV1``, LMCache's own
    adapter on its local CPU backend and vLLM's prefix cache off, sends one
    prompt twice and prints ``RESULT {...}``: per request the greedy token ids
    and the prompt tokens served from a cache (on a GPU the second request
    loads the prompt from LMCache; LMCache 0.5.6 has no CPU transfer path, so
    on the CPU build both compute it).

``python lmcache_hma_driver.py refused MODEL_DIR``
    starts an engine with the connector of lmcache_hma_adapters.py (LMCache's
    adapter declaring the full attention group alone) and prints
    ``RESULT {...}``: whether the engine started, and the error it raised.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from importlib import metadata
from typing import Any

BLOCK_SIZE = 128  # the CPU block size


class _Warnings(logging.Handler):
    """Collects the warnings vLLM logs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _collect_warnings() -> _Warnings:
    handler = _Warnings()
    logging.getLogger("vllm").addHandler(handler)
    return handler


def connector_cases(model: str) -> dict[str, Any]:
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

    class SelectingImpl(CountingImpl):
        """The real adapter declaring the group it selects, the full attention
        one (what an LMCache release with hybrid support declares)."""

        def __init__(self, vllm_config: Any, role: Any, parent: Any) -> None:
            self._parent = parent
            super().__init__(vllm_config, role, parent)

        def get_kv_cache_group_ids(self) -> tuple[int, ...]:
            groups = self._parent.kv_cache_config.kv_cache_groups
            return next(
                (i,)
                for i, group in enumerate(groups)
                if isinstance(group.kv_cache_spec, FullAttentionSpec)
            )

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

    def make_vllm_config() -> VllmConfig:
        return VllmConfig(
            model_config=ModelConfig(model=model, max_model_len=1024),
            cache_config=CacheConfig(block_size=BLOCK_SIZE),
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=KVTransferConfig(
                kv_connector="LMCacheConnectorV1", kv_role="kv_both"
            ),
        )

    def decide(impl: type) -> dict[str, Any]:
        vllm_v1_adapter.LMCacheConnectorV1Impl = impl
        warnings = _collect_warnings()
        vllm_config = make_vllm_config()
        logging.getLogger("vllm").removeHandler(warnings)
        assert vllm_config.kv_transfer_config is not None
        return {
            "supports_hma_config": KVConnectorFactory.supports_hma_config(
                vllm_config.kv_transfer_config
            ),
            "disable_hybrid_kv_cache_manager": (
                vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
            ),
            "warnings": warnings.messages,
            "adapters_built": len(built),
        }

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
                make_vllm_config(), KVConnectorRole.SCHEDULER, kv_cache_config(*specs)
            )
        except ValueError as e:
            case["error"] = str(e)
        else:
            case["kv_cache_config_public"] = (
                connector.kv_cache_config is connector._kv_cache_config
            )
            case["loaded_group_ids"] = list(
                connector.get_loaded_kv_cache_group_ids(FinishedRequest())
            )
            block_ids = tuple([10 * g + 1, 10 * g + 2] for g in range(len(specs)))
            case["finished_result"] = connector.request_finished_all_groups(
                FinishedRequest(), block_ids
            )
        case["adapters_built"] = len(built)
        case["finished_block_ids"] = list(finished)
        return case

    return {
        "lmcache": metadata.version("lmcache"),
        "vllm": metadata.version("vllm"),
        "adapter": f"{real_impl.__module__}.{real_impl.__qualname__}",
        "supports_hma": supports_hma(LMCacheConnectorV1),
        "real_adapter_decision": decide(real_impl),
        "selecting_adapter_decision": decide(SelectingImpl),
        "single_group": build(CountingImpl, (full,)),
        "real_adapter_two_groups": build(CountingImpl, (sliding, full)),
        "hybrid_selecting_adapter": build(SelectingImpl, (sliding, full)),
    }


def decide(model: str) -> dict[str, Any]:
    import time

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

    def make_config(kv_connector: str) -> tuple[VllmConfig, float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        vllm_config = VllmConfig(
            model_config=ModelConfig(model=model, max_model_len=1024),
            cache_config=CacheConfig(block_size=BLOCK_SIZE),
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=KVTransferConfig(
                kv_connector=kv_connector, kv_role="kv_both"
            ),
        )
        return vllm_config, time.perf_counter() - wall, time.process_time() - cpu

    # The API server's cost of the decision: the first config imports the
    # adapter (LMCache's engine and its dependencies), the same config built
    # again does not.
    modules_before = len(sys.modules)
    vllm_config, first_s, first_cpu_s = make_config("LMCacheConnectorV1")
    imported = len(sys.modules) - modules_before
    _, again_s, again_cpu_s = make_config("LMCacheConnectorV1")
    mp_config = make_config("LMCacheMPConnector")[0]
    assert vllm_config.kv_transfer_config is not None
    assert mp_config.kv_transfer_config is not None
    mp_cls = KVConnectorFactory.get_connector_class(mp_config.kv_transfer_config)
    return {
        "supports_hma_config": KVConnectorFactory.supports_hma_config(
            vllm_config.kv_transfer_config
        ),
        "disable_hybrid_kv_cache_manager": (
            vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
        ),
        "lmcache_imported": "lmcache" in sys.modules,
        "adapter_import": {
            "modules": imported,
            "wall_s": round(first_s - again_s, 2),
            "cpu_s": round(first_cpu_s - again_cpu_s, 2),
        },
        # LMCache's multi-process connector, which the warning names.
        "mp_connector": {
            "class": f"{mp_cls.__module__}.{mp_cls.__qualname__}",
            "supports_hma_config": KVConnectorFactory.supports_hma_config(
                mp_config.kv_transfer_config
            ),
            "disable_hybrid_kv_cache_manager": (
                mp_config.scheduler_config.disable_hybrid_kv_cache_manager
            ),
        },
    }


def repeat(model: str) -> dict[str, Any]:
    # LMCache's in-process engine reads its configuration from the
    # environment when the adapter is built: a CPU backend, chunks of one
    # vLLM block.
    os.environ.update(
        LMCACHE_LOCAL_CPU="True",
        LMCACHE_MAX_LOCAL_CPU_SIZE="1",
        LMCACHE_CHUNK_SIZE=str(BLOCK_SIZE),
        LMCACHE_TRACK_USAGE="false",
    )
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model,
        max_model_len=1024,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=False,
        kv_transfer_config=KVTransferConfig(
            kv_connector="LMCacheConnectorV1", kv_role="kv_both"
        ),
        gpu_memory_utilization=0.1,
        # The subject is the connector's HMA decision, not the compiled path.
        enforce_eager=True,
    )
    vllm_config = llm.llm_engine.vllm_config
    # Four full blocks and a partial one: past the sliding window (128
    # tokens), so the sliding-window layer attends over part of the prefix.
    prompt = TokensPrompt(prompt_token_ids=[(7 * i) % 500 + 3 for i in range(600)])
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    requests = []
    for _ in range(2):
        [output] = llm.generate([prompt], params)
        requests.append(
            {
                "token_ids": list(output.outputs[0].token_ids),
                "num_cached_tokens": output.num_cached_tokens,
            }
        )
    return {
        "layer_types": getattr(vllm_config.model_config.hf_config, "layer_types", None),
        "disable_hybrid_kv_cache_manager": (
            vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
        ),
        "requests": requests,
    }


def refused(model: str) -> dict[str, Any]:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    try:
        LLM(
            model=model,
            max_model_len=1024,
            block_size=BLOCK_SIZE,
            kv_transfer_config=KVTransferConfig(
                kv_connector="FullAttentionOnlyLMCacheConnector",
                kv_connector_module_path="lmcache_hma_adapters",
                kv_role="kv_both",
            ),
            gpu_memory_utilization=0.1,
            enforce_eager=True,
        )
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"started": False, "error": f"{type(e).__name__}: {e}"}
    return {"started": True}


def main() -> None:
    mode, model = sys.argv[1:3]
    modes = {
        "connector": connector_cases,
        "decide": decide,
        "repeat": repeat,
        "refused": refused,
    }
    result = modes[mode](model)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

"""StoreConnector on the path of a KV cache on a GPU, over a KV cache in
host memory: what ``gpu_ttft.py`` serves where there is no GPU (``--tiny``),
so the benchmark's own steps run through the connector code they time on a
GPU: the host tier, saves on a thread, and finished requests' blocks kept
until their saves are written, which is what makes vLLM refuse a
prefix-cache reset until a later step (``gpu_ttft.py``'s ``reset``).

The test suite runs the same path on CPU tensors without an engine
(``test_store_device_transfer.py``, ``test_store_host_tier.py``); this runs
it under vLLM's engine.
"""

from __future__ import annotations

from typing import Any

import torch
from kvlc_store.connector import StoreConnector


class BatchedStoreConnector(StoreConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        # What StoreConnector sets for a device other than the CPU.
        self._scheduler.async_saves = True

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self._worker.start_batched_transfers()

"""Connector module for the refused-adapter engine case of
test_lmcache_hma_real.py, loaded with ``kv_connector_module_path``.

Importing it imports LMCache's real vLLM adapter and replaces it by a subclass
that declares the KV cache group it selects, the first full attention one, as
LMCache #3284 did: what a hybrid-capable release would look like if it left
the sliding-window group out. Being imported before the vLLM config is built
(the factory imports this module to find the connector class), the adapter
keeps the hybrid KV cache manager on, and building the connector must refuse
it.
"""

from __future__ import annotations

from typing import Any

from lmcache.integration.vllm import vllm_v1_adapter
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import (
    LMCacheConnectorV1,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec

_RealImpl: Any = vllm_v1_adapter.LMCacheConnectorV1Impl


class FullAttentionOnlyImpl(_RealImpl):
    """LMCache's adapter declaring the full attention group alone."""

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


vllm_v1_adapter.LMCacheConnectorV1Impl = FullAttentionOnlyImpl


class FullAttentionOnlyLMCacheConnector(LMCacheConnectorV1):
    """LMCacheConnectorV1 over the adapter above."""

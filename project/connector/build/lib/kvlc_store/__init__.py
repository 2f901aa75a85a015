"""kvlc-store-connector: a content-addressed KV cache store for vLLM.

Installed, it is the connector ``StoreConnector`` by name: its
``vllm.general_plugins`` entry point (``kvlc_store.plugin``) registers it with
vLLM. ``kv_connector_module_path = "kvlc_store"`` works too. The connector
(and so vLLM) is imported on first use, so the store, chunk and config
modules stay usable without vLLM.
"""

from typing import Any

__all__ = ["StoreConnector"]


def __getattr__(name: str) -> Any:
    if name == "StoreConnector":
        from kvlc_store.connector import StoreConnector

        return StoreConnector
    raise AttributeError(f"module 'kvlc_store' has no attribute {name!r}")

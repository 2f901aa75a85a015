"""AIBrix's KV offloading (``aibrix_kvcache``) as a vLLM KV connector that
uses the stack's ``before_update_states`` hook instead of patching vLLM.

Name it in ``--kv-transfer-config`` with
``"kv_connector": "AIBrixHookConnector", "kv_connector_module_path": "kvlc_aibrix"``.
"""

from kvlc_aibrix.connector import AIBrixHookConnector, AIBrixStepMetadata

__all__ = ["AIBrixHookConnector", "AIBrixStepMetadata"]

"""A conformance kit for vLLM KV connectors.

``run_conformance(kv_transfer_config)`` runs the lifecycle contract's
scenarios against any connector, by its ``--kv-transfer-config``, on an
in-process vLLM engine serving a tiny model on the CPU, and returns a
``Report`` of one ``ScenarioResult`` (PASS, FAIL or N/A, with one line of why)
per scenario. The ``vllm-kv-conformance`` command (``cli.py``) and the pytest
plugin (``pytest_plugin.py``) are its two front ends. Importing this package
does not import vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_kv_conformance.results import Report, ScenarioResult, Status

if TYPE_CHECKING:
    from vllm_kv_conformance.runner import run_conformance

__all__ = ["Report", "ScenarioResult", "Status", "run_conformance"]


def __getattr__(name: str) -> Any:
    if name == "run_conformance":
        from vllm_kv_conformance.runner import run_conformance

        return run_conformance
    raise AttributeError(name)

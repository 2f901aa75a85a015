"""The patched LMCacheConnectorV1 with the real ``lmcache`` 0.5.6 installed.

``lmcache`` 0.5.6 downgrades numpy, protobuf, opentelemetry and grpcio, so it
lives in its own environment, build/venv-lmcache (the patched vLLM plus
``lmcache==0.5.6``), made by ``./wb venv --lmcache``. This test runs
lmcache_hma_driver.py there and checks, with LMCache's own adapter:

* VllmConfig keeps the hybrid KV cache manager on for LMCacheConnectorV1;
* one KV cache group: the connector is built on the real adapter, selects
  group 0 and forwards its block ids to the adapter's ``request_finished``;
* full attention + sliding window with 0.5.6's adapter, which reads group 0's
  block ids for every layer: refused with an error naming the fix, before the
  adapter is built (no LMCache service started);
* the same hybrid config with the real adapter declaring ``kv_cache_group_id``
  (as a release with hybrid support does): built, the full attention group
  selected and its block ids forwarded.

Without build/venv-lmcache the test is skipped, or fails when
KVLC_REQUIRE_E2E=1 (CI).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

VENV = REPO / "build" / "venv-lmcache"
PYTHON = VENV / "bin" / "python"
RECIPE = "./wb venv --lmcache"
HERE = Path(__file__).resolve().parent
DEMO = REPO / "project" / "demo"


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not PYTHON.exists():
        reason = f"{VENV.relative_to(REPO)} is missing: create it with {RECIPE}"
        if os.environ.get("KVLC_REQUIRE_E2E") == "1":
            pytest.fail(f"{reason} (KVLC_REQUIRE_E2E=1)")
        pytest.skip(reason)
    model = tmp_path_factory.mktemp("model")
    subprocess.run([str(PYTHON), str(DEMO / "make_model.py"), str(model)], check=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONHASHSEED="0")
    proc = subprocess.run(
        [str(PYTHON), str(HERE / "lmcache_hma_driver.py"), str(model)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return dict(json.loads(line.removeprefix("RESULT ")))


def test_real_lmcache_and_patched_vllm(result: dict[str, Any]) -> None:
    assert result["lmcache"] == "0.5.6"
    assert "+kvlc" in result["vllm"]
    assert result["adapter"] == (
        "lmcache.integration.vllm.vllm_v1_adapter.LMCacheConnectorV1Impl"
    )


def test_hybrid_allocator_stays_on(result: dict[str, Any]) -> None:
    assert result["supports_hma"] is True
    assert result["supports_hma_config"] is True
    assert result["disable_hybrid_kv_cache_manager"] is False


def test_single_group_on_real_adapter(result: dict[str, Any]) -> None:
    case = result["single_group"]
    assert "error" not in case, case.get("error")
    assert case["adapters_built"] == 1
    assert case["kv_cache_group_id"] == 0
    assert case["kv_cache_config_public"] is True
    assert case["finished_block_ids"] == [[1, 2]]
    assert case["finished_result"][0] is False


def test_single_group_on_unmodified_adapter_class(result: dict[str, Any]) -> None:
    case = result["single_group_plain_adapter"]
    assert "error" not in case, case.get("error")
    assert case["adapters_built"] == 1
    assert case["kv_cache_group_id"] == 0
    assert case["finished_result"][0] is False


def test_hybrid_config_refused_for_single_group_adapter(
    result: dict[str, Any],
) -> None:
    case = result["hybrid_real_adapter"]
    assert case["adapters_built"] == 0
    assert (
        "The LMCache adapter lmcache.integration.vllm.vllm_v1_adapter."
        "LMCacheConnectorV1Impl handles a single KV cache group"
    ) in case["error"]
    assert (
        "0: sliding_window (1 layers), 1: full_attention (1 layers)" in (case["error"])
    )
    assert "--disable-hybrid-kv-cache-manager" in case["error"]


def test_hybrid_config_selects_full_attention(result: dict[str, Any]) -> None:
    case = result["hybrid_declaring_adapter"]
    assert "error" not in case, case.get("error")
    assert case["adapters_built"] == 1
    assert case["kv_cache_group_id"] == 1
    assert case["finished_block_ids"] == [[11, 12]]
    assert case["finished_result"][0] is False

"""The patched LMCacheConnectorV1 with the real ``lmcache`` 0.5.6 installed.

``lmcache`` 0.5.6 downgrades numpy, protobuf, opentelemetry and grpcio, so it
lives in its own environment, build/venv-lmcache (the patched vLLM plus
``lmcache==0.5.6``), made by ``./wb venv --lmcache``. This test runs
lmcache_hma_driver.py there and checks, with LMCache's own adapter (which
handles one KV cache group and declares no groups):

* today's users are not broken: VllmConfig turns the hybrid KV cache manager
  off for it with vLLM's warning plus the line naming what keeps it on, and
  nothing raises (an engine serves with it: the end-to-end point below);
* VllmConfig decides by importing the adapter's module, never building it,
  in a fresh process as after ``import lmcache`` (what that import costs the
  API server is printed); ``LMCacheMPConnector``, which the warning names,
  resolves to LMCache's own class and keeps the hybrid KV cache manager on;
* the connector is built on it for one group, reports group 0 restored and
  forwards group 0's block ids to its ``request_finished``; on two groups
  building it raises before the adapter is built;
* the real adapter subclassed only to declare the group it selects, the full
  attention one (as LMCache #3284 did): the hybrid KV cache manager stays on,
  and on full attention + sliding window building the connector raises,
  naming the sliding-window group it leaves out;
* end to end on the demo model made hybrid (a sliding-window layer and a full
  attention layer): an engine serves a repeated prompt with HMA off and the
  same greedy tokens twice (LMCache 0.5.6 cannot move KV on the CPU build: its
  engine logs "No supported cpu connector found" and reports no hits, so no
  hit is compared with recomputation here); an engine on the adapter that
  declares the full attention group alone stops at startup with that error.

Without build/venv-lmcache the test is skipped, or fails when
KVLC_REQUIRE_E2E=1 (CI).
"""

from __future__ import annotations

import json
import os
import shutil
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
TURNED_OFF = "Turning off hybrid kv cache manager"
ADAPTER = "lmcache.integration.vllm.vllm_v1_adapter.LMCacheConnectorV1Impl"
# One decision for one configuration, whatever was imported first: `vllm
# serve` imports the adapter module to decide, as a script that imported
# lmcache first does.
DECLARES_NONE = (
    f"The LMCache adapter {ADAPTER} declares no KV cache groups, so it handles a "
    "single KV cache group; the hybrid KV cache manager stays on only for an "
    "adapter that defines get_kv_cache_group_ids(). LMCache's multi-process "
    "mode (kv_connector LMCacheMPConnector) supports it."
)
LEAVES_OUT_SLIDING = (
    "get_kv_cache_group_ids() returned (1,): it leaves out the sliding_window "
    "group 0 of this model's KV cache"
)


def _driver(mode: str, model: Path) -> tuple[dict[str, Any], str]:
    """The driver's RESULT and its log."""
    # The engine processes import lmcache_hma_adapters.py by module name.
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONHASHSEED="0", PYTHONPATH=path)
    # The engine's worker in a process of its own, as vLLM's CPU platform
    # starts it (conftest.py puts it in the caller's): there it rebinds
    # Triton kernels before anything imports lmcache, while in the driver's
    # process, where VllmConfig's HMA decision imported LMCache's adapter,
    # the rebinding's walk over every loaded module fails on one of
    # lmcache's ("'_lib_fn_wrapper' object has no attribute 'get'", vLLM
    # 0.32.0's triton_utils/dispatcher.py).
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    proc = subprocess.run(
        [str(PYTHON), str(HERE / "lmcache_hma_driver.py"), mode, str(model)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return dict(json.loads(line.removeprefix("RESULT "))), proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not PYTHON.exists():
        reason = f"{VENV.relative_to(REPO)} is missing: create it with {RECIPE}"
        if os.environ.get("KVLC_REQUIRE_E2E") == "1":
            pytest.fail(f"{reason} (KVLC_REQUIRE_E2E=1)")
        pytest.skip(reason)
    model = tmp_path_factory.mktemp("model")
    subprocess.run([str(PYTHON), str(DEMO / "make_model.py"), str(model)], check=True)
    return model


@pytest.fixture(scope="module")
def hybrid_model(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo Llama with its first layer sliding-window: two KV cache groups
    under the hybrid KV cache manager."""
    hybrid = tmp_path_factory.mktemp("hybrid") / "model"
    shutil.copytree(model, hybrid)
    config_path = hybrid / "config.json"
    config = json.loads(config_path.read_text())
    config.update(
        layer_types=["sliding_attention", "full_attention"], sliding_window=128
    )
    config_path.write_text(json.dumps(config))
    return hybrid


@pytest.fixture(scope="module")
def result(model: Path) -> dict[str, Any]:
    return _driver("connector", model)[0]


def test_real_lmcache_and_patched_vllm(result: dict[str, Any]) -> None:
    assert result["lmcache"] == "0.5.6"
    assert "+kvlc" in result["vllm"]
    assert result["adapter"] == (
        "lmcache.integration.vllm.vllm_v1_adapter.LMCacheConnectorV1Impl"
    )
    assert result["supports_hma"] is True


def test_real_adapter_turns_hybrid_manager_off_without_error(
    result: dict[str, Any],
) -> None:
    decision = result["real_adapter_decision"]
    assert decision["supports_hma_config"] is False
    assert decision["disable_hybrid_kv_cache_manager"] is True
    assert any(TURNED_OFF in w for w in decision["warnings"])
    assert DECLARES_NONE in decision["warnings"]
    assert decision["adapters_built"] == 0


def test_declaring_adapter_keeps_hybrid_manager_on(result: dict[str, Any]) -> None:
    decision = result["selecting_adapter_decision"]
    assert decision["supports_hma_config"] is True
    assert decision["disable_hybrid_kv_cache_manager"] is False
    assert not any(TURNED_OFF in w for w in decision["warnings"])


@pytest.fixture(scope="module")
def decided(model: Path) -> dict[str, Any]:
    return _driver("decide", model)[0]


def test_decision_imports_the_adapter_whatever_was_imported_first(
    decided: dict[str, Any],
) -> None:
    """The config-time decision imports the adapter's module (never builds
    it), so `vllm serve` decides as a script that imported lmcache first."""
    decision = decided
    assert decision["supports_hma_config"] is False
    assert decision["disable_hybrid_kv_cache_manager"] is True
    assert decision["lmcache_imported"] is True
    # What deciding costs the API server (the PR text quotes it).
    cost = decision["adapter_import"]
    print(f"adapter import while the config is built: {cost}")
    assert cost["modules"] > 0 and cost["wall_s"] > 0


def test_multi_process_connector_the_warning_names_keeps_hybrid_manager_on(
    decided: dict[str, Any],
) -> None:
    """The warning for today's adapter names LMCacheMPConnector: with the
    released lmcache, vLLM resolves it to LMCache's own class, which keeps
    the hybrid KV cache manager on."""
    decision = decided["mp_connector"]
    assert decision == {
        "class": "lmcache.integration.vllm.lmcache_mp_connector.LMCacheMPConnector",
        "supports_hma_config": True,
        "disable_hybrid_kv_cache_manager": False,
    }


def test_real_adapter_refuses_two_groups(result: dict[str, Any]) -> None:
    case = result["real_adapter_two_groups"]
    assert "--disable-hybrid-kv-cache-manager" in case["error"]
    assert case["adapters_built"] == 0


def test_single_group_on_real_adapter(result: dict[str, Any]) -> None:
    case = result["single_group"]
    assert "error" not in case, case.get("error")
    assert case["adapters_built"] == 1
    assert case["kv_cache_config_public"] is True
    assert case["loaded_group_ids"] == [0]
    assert case["finished_block_ids"] == [[1, 2]]
    assert case["finished_result"][0] is False


def test_hybrid_config_refuses_the_adapter_leaving_out_sliding_window(
    result: dict[str, Any],
) -> None:
    case = result["hybrid_selecting_adapter"]
    assert LEAVES_OUT_SLIDING in case["error"]
    assert "--disable-hybrid-kv-cache-manager" in case["error"]
    assert case["adapters_built"] == 1
    assert case["finished_block_ids"] == []


def test_hybrid_model_serves_with_released_lmcache(hybrid_model: Path) -> None:
    """Released LMCache on full attention + sliding window: HMA off (one KV
    cache group for every layer), and a repeated prompt gives the same greedy
    tokens."""
    served, log = _driver("repeat", hybrid_model)
    assert served["layer_types"] == ["sliding_attention", "full_attention"]
    assert served["disable_hybrid_kv_cache_manager"] is True
    assert TURNED_OFF in log
    assert DECLARES_NONE in log
    first, second = served["requests"]
    assert len(first["token_ids"]) == 16
    assert second["token_ids"] == first["token_ids"]


def test_adapter_leaving_out_sliding_window_stops_the_engine(
    hybrid_model: Path,
) -> None:
    """The adapter declaring the full attention group alone keeps HMA on,
    and the engine does not start: one error naming the sliding-window group
    and the fix."""
    result, log = _driver("refused", hybrid_model)
    assert result["started"] is False
    assert LEAVES_OUT_SLIDING in log
    assert "--disable-hybrid-kv-cache-manager" in log

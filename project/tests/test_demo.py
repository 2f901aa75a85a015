"""The README's main job, for real: the patched vLLM serves the demo model with a
KV connector over HTTP, and a repeated prompt is answered from the external cache.

Runs under the environment ``./wb test`` makes (``.venv``, the patched build).
"""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from conftest import REPO

DEMO = REPO / "project" / "demo"


def test_patched_vllm_is_installed():
    assert version("vllm").startswith("0.32.0+kvlc")


def test_vllm_serve_with_connector_hits_on_repeat(tmp_path: Path):
    model = tmp_path / "model"
    subprocess.run([sys.executable, str(DEMO / "make_model.py"), str(model)], check=True)
    result = subprocess.run(
        [sys.executable, str(DEMO / "serve_demo.py"), "--model-dir", str(model)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "PASS: request 2 loaded" in result.stdout
    assert "vllm:external_prefix_cache_hits_total: request 1 +0.0" in result.stdout

"""The help texts a new user reads first."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import REPO, wb


def test_wb_help_says_what_the_workbench_is():
    result = wb(REPO, "--help")
    assert result.returncode == 0
    assert "``" not in result.stdout
    assert "The workbench: the pinned vLLM release plus patches/" in result.stdout


def test_wb_demo_help_prints_at_once_with_the_model_path_it_uses():
    started = time.monotonic()
    result = wb(REPO, "demo", "--help")
    assert result.returncode == 0, result.stderr
    # No install, no model generation, before the help.
    assert time.monotonic() - started < 20
    assert result.stdout.startswith("usage: wb demo"), result.stdout
    assert "[demo]" not in result.stdout and ".venv" not in result.stdout
    assert str(REPO / "build" / "demo-model") in " ".join(result.stdout.split())


def test_wb_bench_gpu_without_a_gpu_stops_at_once_in_one_line(monkeypatch):
    """The GPU benchmark needs the CUDA build: without an NVIDIA GPU it says
    so in one line before building anything; its help needs no GPU."""
    if Path("/dev/nvidia0").exists():
        pytest.skip("this machine has an NVIDIA GPU: the benchmark would run")
    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no nvidia-smi
    started = time.monotonic()
    result = wb(REPO, "bench", "--gpu")
    assert result.returncode == 1
    assert time.monotonic() - started < 20
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "./wb bench --gpu needs an NVIDIA GPU" in lines[0]
    help_text = wb(REPO, "bench", "--gpu", "--help")
    assert help_text.returncode == 0 and "gpu_ttft.py" in help_text.stdout

"""The help texts a new user reads first."""

from __future__ import annotations

import time

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

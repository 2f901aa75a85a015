"""The README's main job, for real: the patched vLLM serves the demo model with a
KV connector over HTTP, and a repeated prompt is answered from the external cache;
Ctrl-C then ends ``./wb demo --keep-serving`` cleanly.

Runs under the environment ``./wb test`` makes (``.venv``, the patched build).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest
from conftest import REPO

DEMO = REPO / "project" / "demo"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("demo") / "model"
    cmd = [sys.executable, str(DEMO / "make_model.py"), str(path)]
    subprocess.run(cmd, check=True)
    return path


def start(cmd: list[str]) -> subprocess.Popen[str]:
    """Start ``cmd`` in its own process group, as a terminal starts a job."""
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def read_until(proc: subprocess.Popen[str], marker: str, timeout: float) -> str:
    """The output of ``proc`` up to the line holding ``marker``."""
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if marker in line:
            return "".join(seen)
    steps = "".join(line for line in seen if line.startswith("[demo]"))
    pytest.fail(f"no {marker!r} in:\n{steps}...\n" + "".join(seen)[-3000:])


def ctrl_c(proc: subprocess.Popen[str]) -> tuple[int, str]:
    """Send SIGINT to the job's process group (what Ctrl-C does); its exit
    status and the rest of its output."""
    os.killpg(proc.pid, signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    return proc.returncode, rest


def assert_cleaned_up(output: str) -> None:
    """The server's process group is gone and so is the scratch directory."""
    started = re.search(r"server pid (\d+) \(own process group\), log: (\S+)", output)
    assert started, output
    pid, log = int(started[1]), Path(started[2])
    assert live_members(pid) == [], "the server's process group is still running"
    assert not log.parent.exists()


def live_members(pgid: int) -> list[int]:
    """Processes of group ``pgid`` that are not zombies (/proc/PID/stat)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(stat.parent.name))
    return members


def test_patched_vllm_is_installed():
    assert version("vllm").startswith("0.32.0+kvlc")


def test_wb_demo_hits_on_repeat_and_ctrl_c_stops_it(model: Path):
    proc = start([sys.executable, str(REPO / "wb"), "demo", "--model-dir", str(model),
                  "--keep-serving", "--startup-timeout", "800"])  # fmt: skip
    output = read_until(proc, "/metrics | grep", timeout=900)
    assert "PASS: request 2 loaded" in output
    assert "vllm:external_prefix_cache_hits_total: request 1 +0.0" in output
    status, rest = ctrl_c(proc)
    assert status == 130, rest
    # Two lines, no traceback.
    lines = [line for line in rest.splitlines() if line.strip()]
    assert len(lines) == 2, rest
    assert "interrupted (SIGINT): stopping the server" in lines[0], rest
    assert "interrupted (SIGINT): server stopped" in lines[1], rest
    assert_cleaned_up(output)


def test_ctrl_c_while_the_server_starts(model: Path):
    proc = start(
        [sys.executable, str(DEMO / "serve_demo.py"), "--model-dir", str(model)]
    )
    output = read_until(proc, "server pid", timeout=300)
    time.sleep(3)  # the API server is importing vLLM, maybe spawning its engine
    os.killpg(proc.pid, signal.SIGINT)
    sent = time.monotonic()
    # Said at once, though stopping a server that is starting may take its
    # whole SIGTERM grace.
    read_until(proc, "interrupted (SIGINT): stopping the server", timeout=60)
    assert time.monotonic() - sent < 5
    status, rest = ctrl_c(proc)
    assert status == 130, rest
    assert "Traceback" not in rest and "interrupted (SIGINT)" in rest, rest
    assert_cleaned_up(output)

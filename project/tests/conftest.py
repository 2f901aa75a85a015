"""Workbench test fixtures: real git, real GNU patch, the real pinned release.

CI time (``./wb test`` on 2 cores, limit 45 minutes): an engine start costs
30-60 s there and is mostly one busy core. An end-to-end test shares its
servers with the other tests of its module (a module-scoped fixture), and
starts servers that do not depend on each other together, two at a time
(``test_aibrix_e2e.py``'s ``pair``); the log's ``--durations`` list shows
what a new test costs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "project"))

from forked_cli import ForkedCli  # noqa: E402
from workbench import upstream  # noqa: E402

# vLLM's own CPU CI switch, inherited by every engine the tests start: the
# model runs under dynamo with the eager backend and skips the warm-up, instead
# of an inductor compile (~25 s of each server start on 2 cores). The tests
# check connector behaviour, which does not depend on the backend, and runs
# compared with the unpatched release get the same setting. That traced path
# is the servers' of test_store_connector_e2e.py and the engines' of
# test_before_update_states_e2e.py; the other end-to-end engines run eager
# (``--enforce-eager``, ``serve_demo.server_command(eager=True)``), which
# skips dynamo's trace as well: 5-10 s of a core per engine.
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
# One process fewer per engine: the worker of a one-rank engine runs inside
# the engine core's process (vLLM's UniProcExecutor), as on every one-rank
# GPU engine, instead of a process of its own that vLLM's CPU platform
# otherwise starts and that imports vLLM once more (16 s of a core here); an
# `LLM` also runs its engine core in the caller's process, as vLLM's own
# engine tests do. Engines of two ranks keep a process per rank, so the
# ranks' agreement still crosses processes.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

TRIAL_STACK = Path(__file__).parent / "data" / "trial-stack"


@pytest.fixture(scope="session")
def forked_cli() -> Iterator[ForkedCli]:
    """One import of vLLM's CLI for every ``vllm serve`` run that stops before
    an engine starts (``forked_cli.py``)."""
    sys.path.insert(0, str(REPO / "project" / "demo"))
    import serve_demo

    cli = ForkedCli(serve_demo.server_env())
    try:
        yield cli
    finally:
        cli.close()


@pytest.fixture(scope="session")
def pristine() -> Path:
    return upstream.pristine_tree()


@pytest.fixture
def trial_root(tmp_path: Path) -> Path:
    """A writable copy of the one-entry trial stack."""
    root = tmp_path / "root"
    shutil.copytree(TRIAL_STACK, root)
    return root


@pytest.fixture
def empty_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "patches").mkdir(parents=True)
    (root / "patches" / "series").write_text("# empty\n")
    return root


def wb(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the real CLI on the stack at ``root``."""
    return subprocess.run(
        [sys.executable, str(REPO / "wb"), "--root", str(root), *args],
        capture_output=True,
        text=True,
        check=False,
    )


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (except build outputs), for byte-exact comparison."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "build" not in p.relative_to(root).parts
    }

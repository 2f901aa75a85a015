"""End to end: LMCache's ``LMCacheMPConnector`` (lmcache 0.5.6), a peer of the
reference connector, served by the patched build on CPU.

``vllm serve`` from build/venv-lmcache (the patched vLLM plus ``lmcache``)
runs the demo model with local prefix caching off, so cached tokens can only
come from LMCache. The connector auto-starts LMCache's multiprocess server on
free ports. The same greedy completion is sent twice: the repeat must report
cached tokens, give the same tokens and logprobs within a small tolerance.

vLLM does not stop the auto-started LMCache server when it shuts down. The
server is spawned without a session of its own, so the process-group kill of
``Server.stop`` ends it here; the fixture then looks for any survivor by its
command line (it carries this test's port) and kills it by pid.

Without build/venv-lmcache (``./wb venv --lmcache``) the test skips, or fails
when ``KVLC_REQUIRE_E2E=1``.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "project" / "demo"))

import serve_demo  # noqa: E402

# The same greedy request as the Mooncake peer's test.
from test_scheduler_context_mooncake_e2e import MAX_TOKENS, complete  # noqa: E402

VENV = REPO / "build" / "venv-lmcache"
VLLM = VENV / "bin" / "vllm"
RECIPE = "./wb venv --lmcache"
BLOCK_SIZE = 128  # vLLM's CPU block size; LMCache's chunk size is set to match.
# LMCache copies the KV bytes unchanged, so the logprobs should be equal; the
# tolerance only absorbs a different (but equally valid) CPU kernel split
# between a full prefill and a prefill of the uncached tail.
LOGPROB_TOLERANCE = 1e-3
LMCACHE_SERVER_MODULE = "lmcache.v1.multiprocess.http_server"


def lmcache_config(port: int, http_port: int) -> dict[str, Any]:
    """LMCacheMPConnector with an auto-started server on ``port`` (ZMQ) and
    ``http_port`` (its HTTP side, 8080 by default: taken on a shared machine)."""
    server_args = (
        "--l1-size-gb 1 --eviction-policy LRU --chunk-size 128 --max-workers 1 "
        f"--supported-transfer-mode auto --http-port {http_port}"
    )
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.autostart": True,
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": port,
            "lmcache.mp.autostart.server_args": server_args,
        },
    }


def lmcache_server_pids(port: int) -> list[int]:
    """Pids of LMCache servers whose command line names ``--port port``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().decode().split("\0")
            flags = zip(argv, argv[1:], strict=False)
            if LMCACHE_SERVER_MODULE in argv and ("--port", str(port)) in flags:
                pids.append(int(entry.name))
    return pids


def kill_pid(pid: int, grace: float = 10) -> None:
    """SIGTERM ``pid``, SIGKILL it after ``grace`` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            os.kill(pid, 0)
            time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)


@pytest.fixture
def lmcache_port() -> Iterator[int]:
    if not VLLM.exists():
        reason = f"{VENV.relative_to(REPO)} is missing: create it with {RECIPE}"
        if os.environ.get("KVLC_REQUIRE_E2E") == "1":
            pytest.fail(f"{reason} (KVLC_REQUIRE_E2E=1)")
        pytest.skip(reason)
    port = serve_demo.free_port()
    try:
        yield port
    finally:
        # Also on failure: a server left behind holds 1 GiB and two ports.
        for pid in lmcache_server_pids(port):
            print(f"stopping the auto-started LMCache server, pid {pid}")
            kill_pid(pid)


def test_lmcache_mp_repeat_hits_with_same_tokens(
    lmcache_port: int, tmp_path: Path
) -> None:
    model = serve_demo.make_model(tmp_path / "model")
    port = serve_demo.free_port()
    kv_config = lmcache_config(lmcache_port, serve_demo.free_port())
    command = serve_demo.server_command(model, port, kv_config, eager=True)
    # The flags of the demo's server, the vLLM of the LMCache environment.
    command = [str(VLLM), "serve", str(model), *command[command.index("--host") :]]
    server = serve_demo.Server(command, serve_demo.server_env(), tmp_path / "s.log")
    base_url = f"http://127.0.0.1:{port}"
    server_pids: list[int] = []
    try:
        server.wait_healthy(base_url, timeout=300)
        server_pids = lmcache_server_pids(lmcache_port)
        first = complete(base_url)
        # Stores may complete after the reply: repeat until the blocks are in.
        repeats = []
        for _ in range(10):
            repeats.append(complete(base_url))
            if repeats[-1]["cached_tokens"] > 0:
                break
            time.sleep(1)
        log = server.log_text()
    finally:
        server.stop()

    print(
        f"lmcache mp e2e: lmcache server pids={server_pids} "
        f"prompt_tokens={first['prompt_tokens']} "
        f"cached_tokens first={first['cached_tokens']} "
        f"repeats={[r['cached_tokens'] for r in repeats]} "
        f"logprobs first={first['logprobs']} repeat={repeats[-1]['logprobs']}"
    )
    context = f"first={first}\nrepeats={repeats}\n" + "\n".join(log.splitlines()[-60:])
    assert server_pids, "no auto-started LMCache server found\n" + context
    assert first["prompt_tokens"] > 2 * BLOCK_SIZE, context
    assert first["cached_tokens"] == 0, context
    repeat = repeats[-1]
    # Whole blocks of the prompt, all but the block holding its last token.
    expected_hit = (first["prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert repeat["cached_tokens"] == expected_hit, context
    for earlier in repeats[:-1]:
        assert earlier["token_ids"] == first["token_ids"], context
    assert repeat["token_ids"] == first["token_ids"], context
    assert repeat["text"] == first["text"], context
    assert len(repeat["logprobs"]) == len(first["logprobs"]) == MAX_TOKENS, context
    for a, b in zip(repeat["logprobs"], first["logprobs"], strict=True):
        assert math.isclose(a, b, rel_tol=0, abs_tol=LOGPROB_TOLERANCE), context
    assert "Traceback" not in log, context

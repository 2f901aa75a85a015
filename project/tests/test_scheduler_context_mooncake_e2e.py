"""End to end: MooncakeStoreConnector with a real Mooncake store, served by
the patched build on CPU.

A local ``mooncake_master`` (with its HTTP metadata server) backs
``MooncakeStoreConnector``; ``vllm serve`` runs the demo model with local
prefix caching off, so cached tokens can only come from Mooncake. The same
greedy completion is sent twice: the repeat must report cached tokens, give
the same tokens and the same logprobs. The connector's scheduler side takes
its store-job block references through the scheduler context (the
scheduler-context entry moves it off the deprecated ``bind_gpu_block_pool``),
whose counted references refuse a free the connector did not take; the
server must not log the deprecation warning.

Needs ``project/requirements-mooncake.txt`` and Debian's ``libibverbs1``.
Without them the test skips, or fails when ``KVLC_REQUIRE_E2E=1``.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO
from forked_cli import ForkedCli
from mooncake_master import mooncake_master

sys.path.insert(0, str(REPO / "project" / "demo"))

import serve_demo  # noqa: E402

BLOCK_SIZE = 128  # vLLM's CPU block size
MAX_TOKENS = 8


def prerequisites() -> tuple[str | None, str]:
    """The mooncake_master binary, or None and what is missing."""
    master = Path(sys.executable).parent / "mooncake_master"
    found = str(master) if master.exists() else shutil.which("mooncake_master")
    if found is None:
        return None, (
            "mooncake_master not found: "
            "pip install -r project/requirements-mooncake.txt"
        )
    if ctypes.util.find_library("ibverbs") is None:
        return None, "libibverbs.so.1 not found: apt-get install libibverbs1"
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        return None, f"mooncake.store does not import: {e}"
    return found, ""


@pytest.fixture
def mooncake_config(tmp_path: Path) -> Iterator[Path]:
    master, missing = prerequisites()
    if master is None:
        if os.environ.get("KVLC_REQUIRE_E2E") == "1":
            pytest.fail(f"KVLC_REQUIRE_E2E=1 but {missing}")
        pytest.skip(missing)
    with mooncake_master(master, tmp_path) as config:
        yield config


def complete(base_url: str) -> dict[str, Any]:
    body = {
        "model": serve_demo.SERVED_NAME,
        "prompt": serve_demo.PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": 1,
        "return_token_ids": True,
    }
    reply = json.loads(serve_demo.http(f"{base_url}/v1/completions", body))
    choice = reply["choices"][0]
    details = reply["usage"].get("prompt_tokens_details") or {}
    return {
        "text": choice["text"],
        "token_ids": choice["token_ids"],
        "logprobs": choice["logprobs"]["token_logprobs"],
        "prompt_tokens": reply["usage"]["prompt_tokens"],
        "cached_tokens": details.get("cached_tokens") or 0,
    }


def test_mooncake_store_repeat_hits_with_identical_logprobs(
    mooncake_config: Path, tmp_path: Path, forked_cli: ForkedCli
) -> None:
    model = tmp_path / "model"
    subprocess.run(
        [sys.executable, str(REPO / "project" / "demo" / "make_model.py"), str(model)],
        check=True,
    )
    port = serve_demo.free_port()
    kv_config = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
    env = serve_demo.server_env()
    env["MOONCAKE_CONFIG_PATH"] = str(mooncake_config)
    command = serve_demo.server_command(model, port, kv_config, eager=True)
    server = serve_demo.Server(
        command, env, tmp_path / "server.log", forked_cli.starter(command)
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        server.wait_healthy(base_url, timeout=300)
        first = complete(base_url)
        # The store is asynchronous: repeat until the blocks are in Mooncake.
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
        f"mooncake e2e: prompt_tokens={first['prompt_tokens']} "
        f"cached_tokens first={first['cached_tokens']} "
        f"repeats={[r['cached_tokens'] for r in repeats]} "
        f"token_ids equal={repeats[-1]['token_ids'] == first['token_ids']} "
        f"logprobs equal={repeats[-1]['logprobs'] == first['logprobs']}"
    )
    context = f"first={first}\nrepeats={repeats}\n" + "\n".join(log.splitlines()[-60:])
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
    assert repeat["logprobs"] == first["logprobs"], context
    assert "overrides bind_gpu_block_pool()" not in log, context
    assert "Traceback" not in log, context

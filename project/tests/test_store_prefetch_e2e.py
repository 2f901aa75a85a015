"""StoreConnector's prefetch end to end: ``vllm serve`` on the CPU build with
a Redis store and ``prefetch_buffer`` set, admitting one request at a time
(``--max-num-seqs 1``), so concurrent requests wait in the scheduler's queue.

Four prompts are stored one after the other, then their repeats are sent at
once: each waits behind the ones before it while its chunks are prefetched,
hits the store for everything but its last token, loads from the buffer and
answers the same greedy tokens as its miss. When the last one is done the
buffer is empty, and it holds nothing after the server stopped. (vLLM's
shutdown SIGKILLs the engine core, so the empty directory may stay until the
next server on the machine starts and removes it: ``test_store_prefetch``.)
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO
from forked_cli import ForkedCli
from kvlc_store.prefetch import DIR_PREFIX
from redis_server import RedisServer
from test_store_connector_e2e import Engine, kv_config, prompt, repeats_at_once

sys.path.insert(0, str(REPO / "project" / "demo"))
import serve_demo  # noqa: E402
from make_model import make_model  # noqa: E402

SHM = Path("/dev/shm")


def buffers() -> set[Path]:
    return set(SHM.glob(f"{DIR_PREFIX}*")) if SHM.is_dir() else set()


@pytest.fixture(scope="module")
def setup(
    tmp_path_factory: pytest.TempPathFactory, forked_cli: ForkedCli
) -> Iterator[dict[str, Any]]:
    if not SHM.is_dir():
        pytest.skip("no /dev/shm: the buffer goes to the temporary directory")
    root = tmp_path_factory.mktemp("prefetch-e2e")
    model = make_model(root / "model")
    redis = RedisServer(root / "redis")
    redis.start()
    before = buffers()
    extra = {
        "backend": "redis",
        "redis_url": redis.url,
        "prefetch_buffer": "16MiB",
        "check_external_match_lifecycle": True,
    }
    port = serve_demo.free_port()
    command = serve_demo.server_command(model, port, kv_config(extra), eager=True)
    command += ["--max-num-seqs", "1"]
    log = root / "server.log"
    server = serve_demo.Server(
        command, serve_demo.server_env(), log, forked_cli.starter(command)
    )
    engine = Engine("prefetch", server, port)
    try:
        engine.server.wait_healthy(engine.url, timeout=600)
        (buffer,) = buffers() - before
        yield {"engine": engine, "buffer": buffer}
    finally:
        server.stop()
        redis.stop()
    left = list(buffer.iterdir()) if buffer.exists() else []
    assert left == [], "the server left chunks in its prefetch buffer"


def test_waiting_repeats_load_from_the_buffer_and_leave_it_empty(setup):
    engine: Engine = setup["engine"]
    grew = repeats_at_once(engine, [prompt(f"queued {i}") for i in range(4)])
    # The first repeat is scheduled at once; the others waited (8 decode
    # steps each, at one request at a time) and were prefetched meanwhile.
    assert grew["vllm:kvlc_store_prefetched_bytes_total"] > 0
    loaded = grew["vllm:kvlc_store_loaded_bytes_total"]
    from_buffer = grew["vllm:kvlc_store_prefetch_loaded_bytes_total"]
    assert 0.5 * loaded <= from_buffer < loaded
    assert grew["vllm:kvlc_store_leases_open"] == 0
    assert list(setup["buffer"].iterdir()) == []

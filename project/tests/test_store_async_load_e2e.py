"""StoreConnector's asynchronous loads end to end: ``vllm serve`` on the CPU
build with ``load_async`` on a Redis store reached through a ``StallProxy``,
so a test can hold a load at a known point.

A burst of repeats hits the store through vLLM's asynchronous-load path
(``WAITING_FOR_REMOTE_KVS``) with the misses' greedy tokens; a request whose
client goes away while its load is held is aborted in that state; the load
gives up at the Redis timeout, the worker backs off from the store (so it
leaves the lease to expire rather than wait on Redis again), and the server
frees the request's blocks and answers the next request from the store.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis as redis_lib
from conftest import REPO
from forked_cli import ForkedCli
from redis_server import RedisServer, StallProxy
from test_store_connector_e2e import (
    BLOCK,
    Engine,
    assert_same_output,
    kv_config,
    open_leases,
    prompt,
    repeats_at_once,
)

sys.path.insert(0, str(REPO / "project" / "demo"))
import serve_demo  # noqa: E402
from make_model import make_model  # noqa: E402

# Long enough that a client's disconnect is seen and its request aborted
# while a stalled load still waits on Redis, on 2 busy cores (CI runs three
# lanes on two: 10 s left 5 s for the abort, and it once took longer).
REDIS_TIMEOUT_S = 20.0
# Short, so the lease a failed load leaves behind expires within the test.
LEASE_TTL_S = 15.0
# What redis-py sends first for a load's pipelined GETs (the lookup sends
# GETRANGE and STRLEN, a save EVALSHA).
GET = b"$3\r\nGET\r\n"


@pytest.fixture(scope="module")
def setup(
    tmp_path_factory: pytest.TempPathFactory, forked_cli: ForkedCli
) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("async-load-e2e")
    model = make_model(root / "model")
    redis = RedisServer(root / "redis")
    redis.start()
    proxy = StallProxy(redis.port)
    extra = {
        "backend": "redis",
        "redis_url": proxy.url,
        "redis_timeout_s": REDIS_TIMEOUT_S,
        "lease_ttl_s": LEASE_TTL_S,
        "load_async": True,
        "check_external_match_lifecycle": True,
    }
    port = serve_demo.free_port()
    command = serve_demo.server_command(model, port, kv_config(extra), eager=True)
    command.append("--enable-log-requests")  # logs "Aborted request(s)"
    log = root / "server.log"
    server = serve_demo.Server(
        command, serve_demo.server_env(), log, forked_cli.starter(command)
    )
    engine = Engine("async", server, port)
    try:
        engine.server.wait_healthy(engine.url, timeout=600)
        yield {
            "engine": engine,
            "proxy": proxy,
            "redis": redis_lib.Redis.from_url(redis.url),
        }
    finally:
        server.stop()
        proxy.close()
        redis.stop()


def test_burst_of_repeats_loads_asynchronously_and_matches(setup):
    engine: Engine = setup["engine"]
    grew = repeats_at_once(engine, [prompt(f"burst {i}") for i in range(4)])
    assert grew["vllm:kvlc_store_loaded_tokens_total"] == 4 * 2 * BLOCK
    assert grew["vllm:kvlc_store_loaded_bytes_total"] > 0
    assert grew.get("vllm:kvlc_store_load_errors_total", 0) == 0
    assert grew["vllm:kvlc_store_leases_open"] == 0


def test_request_aborted_while_its_load_is_held(setup):
    engine: Engine = setup["engine"]
    client: redis_lib.Redis = setup["redis"]
    text = prompt("held")
    miss = engine.complete(text)
    assert not open_leases(client)
    proxy: StallProxy = setup["proxy"]
    proxy.stall_on(GET)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(abandoned_completion, engine, text, proxy.stalled)
        assert proxy.stalled.wait(120), "the load never asked Redis for a chunk"
        pending.result(timeout=60)  # the client went away: vLLM aborts it
    deadline = time.monotonic() + REDIS_TIMEOUT_S / 2
    while "Aborted request" not in engine.server.log_text():
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.2)
    # Aborted while its load still held the lease (Redis keeps the GET
    # unanswered until the client's timeout).
    assert open_leases(client)
    # The load gives up after the Redis timeout; the worker then backs off
    # from the store and does not wait on it to release the lease, which
    # expires on its own ...
    deadline = time.monotonic() + REDIS_TIMEOUT_S + LEASE_TTL_S + 30
    while open_leases(client) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not open_leases(client)
    # ... and the next steps free its blocks: the server answers from the
    # store again with the miss's tokens, and nothing is left open.
    again = engine.complete(text)
    assert again.cached_tokens == 2 * BLOCK
    assert_same_output(again, miss)
    assert engine.store_metrics()["vllm:kvlc_store_leases_open"] == 0
    log = engine.server.log_text()
    assert "Traceback" not in log
    assert "asynchronous load of" not in log


def abandoned_completion(engine: Engine, text: str, held: threading.Event) -> None:
    """Send a completion and close the connection once its load is ``held``,
    before any answer: the server aborts the request."""
    body = json.dumps(
        {"model": serve_demo.SERVED_NAME, "prompt": text, "max_tokens": 8}
    ).encode()
    host, port = engine.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert held.wait(120)

"""StoreConnector with ``offload: lazy`` end to end: ``vllm serve`` on the CPU
build with local prefix caching on and a KV cache of only twelve blocks, so
prompts (four blocks each, with their output) evict each other's blocks from
the local prefix cache.

Lazy offload stores a cached block only when it reaches the eviction end of
the scheduler's free queue (through the stack's ``bind_scheduler_context``),
pinned with ``touch`` while the workers save it. So a lone request stores
nothing, and a prompt whose blocks were evicted locally comes back from the
store: same greedy tokens as its first (miss) answer. Twelve blocks also
mean that a pin never released would soon leave no block to schedule with.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import REPO
from forked_cli import ForkedCli

sys.path.insert(0, str(REPO / "project" / "demo"))
import serve_demo  # noqa: E402
from make_model import make_model  # noqa: E402
from test_store_connector_e2e import (  # noqa: E402
    BLOCK,
    Engine,
    assert_same_output,
    kv_config,
    prompt,
)

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.scheduler_context",
    reason="offload 'lazy' needs the stack's scheduler-context entry",
)

# The null block and eleven for requests: a lone request leaves seven free,
# more than the window, and six prompts evict each other.
NUM_BLOCKS = 12
WINDOW = 4  # At least what one step allocates (a 4-block request).


@pytest.fixture(scope="module")
def engine(
    tmp_path_factory: pytest.TempPathFactory, forked_cli: ForkedCli
) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("store-lazy")
    model = make_model(root / "model")
    port = serve_demo.free_port()
    extra: dict[str, Any] = {
        "path": str(root / "store"),
        "offload": "lazy",
        "offload_window_blocks": WINDOW,
        "check_external_match_lifecycle": True,
    }
    command = [
        arg
        for arg in serve_demo.server_command(model, port, kv_config(extra), eager=True)
        if arg != "--no-enable-prefix-caching"
    ]
    command += ["--num-gpu-blocks-override", str(NUM_BLOCKS), "--max-model-len", "512"]
    log = root / "server.log"
    server = serve_demo.Server(
        command, serve_demo.server_env(), log, forked_cli.starter(command)
    )
    engine = Engine("lazy", server, port)
    try:
        server.wait_healthy(engine.url, timeout=600)
        yield engine
    finally:
        server.stop()


def test_lazy_offload_stores_what_nears_eviction_and_serves_it_back(engine):
    first = engine.complete(prompt("lazy-A"))
    assert first.cached_tokens == 0
    metrics = engine.store_metrics()
    # A lone request's blocks are far from the eviction end: nothing stored.
    assert metrics.get("vllm:kvlc_store_stored_chunks_total", 0.0) == 0.0

    # Enough other prompts to push lazy-A's blocks out of the local cache.
    for tag in ("lazy-B", "lazy-C", "lazy-D", "lazy-E", "lazy-F"):
        other = engine.complete(prompt(tag))
        assert other.prompt_tokens > 2 * BLOCK
    metrics = engine.store_metrics()
    assert metrics["vllm:kvlc_store_stored_chunks_total"] >= 2

    loaded_before = metrics.get("vllm:kvlc_store_loaded_tokens_total", 0.0)
    again = engine.complete(prompt("lazy-A"))
    assert again.cached_tokens == 2 * BLOCK
    assert_same_output(again, first)
    metrics = engine.store_metrics()
    assert metrics["vllm:kvlc_store_loaded_tokens_total"] > loaded_before
    assert metrics["vllm:kvlc_store_leases_open"] == 0
    assert "Traceback" not in engine.server.log_text()

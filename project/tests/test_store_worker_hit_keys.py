"""StoreConnector's worker-side hits (``before_update_states``) are keyed on
vLLM's block hashes, so they never cross tenants or adapters: a request with
the same token ids as a stored one but another ``cache_salt`` or LoRA adapter
gets no hit, while a repeat of the stored request does. A hit covers only
chunks loaded and checked: a damaged one ends it (a miss from there).

Without an engine: real ``vllm.v1.request.Request`` objects hashed by vLLM's
own block hasher (which folds in ``cache_salt`` and the LoRA adapter), the
connector's scheduler side building each step's metadata and its worker side
saving and looking up over a real directory store and KV tensor.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from kvlc_store.backends import DirectoryBackend
from kvlc_store.chunk import HEADER_BYTES
from kvlc_store.config import parse_config
from kvlc_store.core import StoreCore
from kvlc_store.metadata import StoreMetadata
from kvlc_store.scheduler_side import SchedulerSide
from kvlc_store.worker_side import WorkerSide
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

BLOCK = 4
NUM_BLOCKS = 16
PROMPT = list(range(100, 100 + 3 * BLOCK + 1))  # three full blocks and one token


class Server:
    """One scheduler side and one worker side (TP 1) over one store, with
    worker-side hits on; each request gets blocks of its own."""

    def __init__(self, tmp_path: Path) -> None:
        store = tmp_path / "store"
        core = StoreCore(
            parse_config({"path": str(store), "pinned_buffer": 2**20}),
            DirectoryBackend(store, 10**8),
            "ident0",
            1,
        )
        self.core = core
        self.block_ids: dict[str, list[int]] = {}
        manager = SimpleNamespace(
            get_block_ids=lambda req_id: (self.block_ids[req_id],)
        )
        self.scheduler = SchedulerSide(
            core, BLOCK, worker_hits=True, manager=lambda: manager
        )
        self.worker = WorkerSide(core, BLOCK)
        g = torch.Generator().manual_seed(0)
        caches = {
            f"layer.{i}": torch.randn(2, NUM_BLOCKS * BLOCK, 2, 8, generator=g)
            for i in range(2)
        }
        self.worker.register(caches, NUM_BLOCKS, 0)

    def step(self, request: Request) -> tuple[dict[str, int], StoreMetadata]:
        """Schedule ``request``'s whole prompt in one step; return the hits
        its workers report and the step's metadata."""
        req_id = request.request_id
        first = len(self.block_ids) * 4
        self.block_ids[req_id] = list(range(first, first + 4))
        self.scheduler.arrived(request)
        output: Any = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=req_id, num_computed_tokens=0)],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
            has_sync_kv_loads=True,
            num_scheduled_tokens={req_id: request.num_tokens},
        )
        meta = self.scheduler.build_meta(output)
        return self.worker.before_update_states(meta), meta


def request(
    name: str, cache_salt: str | None = None, lora: LoRARequest | None = None
) -> Request:
    return Request(
        request_id=name,
        prompt_token_ids=list(PROMPT),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        lora_request=lora,
        cache_salt=cache_salt,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


@pytest.fixture
def server(tmp_path: Path) -> Server:
    init_none_hash(sha256)
    s = Server(tmp_path)
    hits, meta = s.step(request("stored", cache_salt="tenant-a"))
    assert hits == {}
    s.worker.save(meta)  # the step computed and saves the prompt's blocks
    return s


def test_repeat_of_the_stored_request_hits(server: Server):
    hits, _ = server.step(request("repeat", cache_salt="tenant-a"))
    assert hits == {"repeat": 3 * BLOCK}


def test_same_tokens_other_cache_salt_never_hit(server: Server):
    for name, salt in (("other-tenant", "tenant-b"), ("no-salt", None)):
        hits, meta = server.step(request(name, cache_salt=salt))
        assert meta.probes, "the worker must have looked the blocks up"
        assert hits == {}


def test_same_tokens_other_lora_never_hit(server: Server):
    for i, adapter in enumerate(("adapter-1", "adapter-2")):
        lora = LoRARequest(adapter, i + 1, f"/adapters/{adapter}")
        hits, meta = server.step(request(adapter, cache_salt="tenant-a", lora=lora))
        assert meta.probes, "the worker must have looked the blocks up"
        assert hits == {}


@pytest.mark.parametrize("path", ["host", "batched"])
def test_damaged_chunk_ends_a_worker_side_hit(server: Server, path: str):
    """A stored chunk whose payload was damaged (the worker reads it whole,
    so only its digest tells) ends the hit before its block: that block and
    the ones after it are computed by the step, the chunk is counted and
    deleted, and nothing is a load error (no request fails for it).
    ``batched``: the path of a KV cache on an accelerator."""
    if path == "batched":
        server.worker.start_batched_transfers()
    backend = server.core.backend
    damaged = server.core.keys(request("stored", "tenant-a").block_hashes[1])[0]
    chunk = bytearray(backend.get(damaged) or b"")
    chunk[HEADER_BYTES + 5] ^= 0x01
    backend.delete(damaged)
    backend.put(damaged, bytes(chunk))

    hits, _ = server.step(request("repeat", cache_salt="tenant-a"))
    assert hits == {"repeat": BLOCK}
    assert server.core.stats.data["corrupt_chunks"] == 1
    assert backend.get(damaged) is None
    assert server.worker.take_load_errors() == set()
    assert "load_errors" not in server.core.stats.data
    server.worker.close()

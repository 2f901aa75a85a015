"""The workers' KV layout in the store: the byte order of a block in the KV
tensors, which the attention backend picks (its kernel block size splits a
block's tokens; some backends put heads before tokens) and which the
scheduler cannot see. Two servers with one model and cache spec but another
layout store the same tokens in another byte order, which the payload's
digest cannot catch, so:

- a worker names its layout (``BlockLayout.digest``) in every chunk it
  writes and refuses a chunk of another layout at load or worker lookup, as
  a damaged one (deleted: its own save replaces it);
- the workers send it to the scheduler side at startup (handshake metadata),
  which keys chunks by it, so such servers never meet in the store;
- inside MultiConnector, which passes on only its first child's handshake
  metadata (NixlConnector's must reach NIXL), the workers send none: keys
  leave it out and the workers' check is what stands, with a warning.

``test_store_tp_e2e.py`` runs the handshake and the refusal in a TP=2
server; ``test_store_connector_e2e.py`` checks real servers' keys.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from kvlc_store.backends import DirectoryBackend, new_lease_id
from kvlc_store.chunk import (
    HEADER_BYTES,
    MAGIC,
    ChunkError,
    check_header,
    decode_chunk,
    encode_chunk,
)
from kvlc_store.config import parse_config
from kvlc_store.connector import (
    StoreConnector,
    StoreLayoutHandshake,
    workers_kv_layout,
)
from kvlc_store.core import StoreCore
from kvlc_store.metadata import LoadSpec, ProbeSpec, SaveSpec, StoreMetadata
from kvlc_store.scheduler_side import SchedulerSide
from kvlc_store.transfer import BlockLayout
from kvlc_store.worker_side import WorkerSide
from test_store_device_transfer import wait_finished
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlHandshakePayload,
)

IDENT = "ident0"
NUM_BLOCKS = 6
BLOCK = 4
HEADS, DIM = 2, 8


def key(i: int) -> str:
    return f"{IDENT}/{i:064x}.0"


# ------------------------------------------------------------- the digest


def tokens_first(num_blocks: int, kernel_block: int = BLOCK) -> torch.Tensor:
    """FlashAttention's ``[2, num_blocks, block, heads, dim]``; a kernel
    block smaller than the block splits each block into several rows."""
    rows = num_blocks * BLOCK // kernel_block
    return torch.zeros(2, rows, kernel_block, HEADS, DIM, dtype=torch.bfloat16)


def heads_first() -> torch.Tensor:
    """vLLM's CPU backend: ``[2, num_blocks, heads, block, dim]``."""
    return torch.zeros(2, NUM_BLOCKS, HEADS, BLOCK, DIM, dtype=torch.bfloat16)


def digest(kv: torch.Tensor, num_blocks: int = NUM_BLOCKS) -> str:
    return BlockLayout({"l0": kv, "l1": kv.clone()}, num_blocks).digest


def test_digest_names_the_byte_order_not_the_cache_size():
    assert digest(tokens_first(NUM_BLOCKS)) == digest(
        tokens_first(2 * NUM_BLOCKS), 2 * NUM_BLOCKS
    )
    assert digest(tokens_first(NUM_BLOCKS)) != digest(
        tokens_first(NUM_BLOCKS, BLOCK // 2)
    )
    assert digest(tokens_first(NUM_BLOCKS)) != digest(heads_first())
    assert digest(tokens_first(NUM_BLOCKS)) != digest(
        tokens_first(NUM_BLOCKS).view(torch.int16)
    )


def test_payload_follows_element_order_so_memory_order_does_not_count():
    """A backend that stores heads first in memory but shows vLLM the
    tokens-first shape (a permuted view, as ``kv_cache_stride_order`` makes)
    writes the same payload as one that stores tokens first: same digest,
    same bytes."""
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(2, NUM_BLOCKS, BLOCK, HEADS, DIM, generator=g)
    permuted = dense.permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)
    assert not permuted.is_contiguous() and torch.equal(permuted, dense)
    a = BlockLayout({"l0": dense}, NUM_BLOCKS)
    b = BlockLayout({"l0": permuted}, NUM_BLOCKS)
    assert a.digest == b.digest
    assert torch.equal(a.staged(3), b.staged(3))


# ------------------------------------------------------------- the header


def test_header_names_the_layout_and_a_check_may_require_it():
    data = encode_chunk(IDENT, key(1), b"x" * 10, layout="a" * 16)
    assert bytes(decode_chunk(data, IDENT, key(1), "a" * 16)) == b"x" * 10
    assert bytes(decode_chunk(data, IDENT, key(1))) == b"x" * 10  # None: any
    with pytest.raises(ChunkError, match="written under KV layout 'aaaa"):
        decode_chunk(data, IDENT, key(1), "b" * 16)


def test_format_3_chunk_without_a_layout_is_refused():
    body = {"version": 3, "identity": IDENT, "key": key(1), "payload_bytes": 0}
    body["xxh3_64"] = 0
    head = MAGIC + json.dumps(body).encode().ljust(HEADER_BYTES - len(MAGIC))
    with pytest.raises(ChunkError, match=r"old chunk format \(format 3\)"):
        check_header(head, IDENT, key(1), HEADER_BYTES, "a" * 16)


def test_format_4_chunk_naming_no_layout_is_refused_by_every_worker():
    """A header whose layout is empty (written by a caller that named none)
    says nothing about its byte order: no worker may load it as its own."""
    data = encode_chunk(IDENT, key(1), b"x" * 10)
    for layout in ("a" * 16, "b" * 16):
        with pytest.raises(ChunkError, match="written under KV layout ''"):
            decode_chunk(data, IDENT, key(1), layout)


# ------------------------------------------------------------- the handshake


def test_workers_layout_keys_the_chunks(tmp_path: Path):
    config = parse_config({"path": str(tmp_path)})
    core = StoreCore(config, DirectoryBackend(tmp_path, 10**8), IDENT, 2)
    reports = {r: StoreLayoutHandshake("f" * 16) for r in range(2)}
    layout = workers_kv_layout(reports, 2)
    assert layout == "f" * 16
    core.set_kv_layout(layout)
    assert core.keys(b"\x01") == [f"{IDENT}-{'f' * 16}/01.{r}" for r in range(2)]


@pytest.mark.parametrize(
    "reports, said",
    [
        # MultiConnector[NixlConnector, StoreConnector]: NIXL's metadata only.
        (
            {0: NixlHandshakePayload(compatibility_hash="h", agent_metadata_bytes=b"")},
            "did not reach the scheduler (0 of 2 ranks",
        ),
        ({0: StoreLayoutHandshake("a" * 16)}, "(1 of 2 ranks"),
        (
            {0: StoreLayoutHandshake("a" * 16), 1: StoreLayoutHandshake("b" * 16)},
            "report 2 KV layouts",
        ),
    ],
)
def test_no_layout_from_every_worker_keys_without_it_and_says_so(
    reports, said, caplog: pytest.LogCaptureFixture
):
    with caplog.at_level(logging.WARNING):
        assert workers_kv_layout(reports, 2) is None
    assert said in caplog.text
    assert "fails its load once" in caplog.text


def test_workers_send_their_layout_only_as_the_servers_one_connector(
    monkeypatch: pytest.MonkeyPatch,
):
    """The worker's transfer group is the connector vLLM built from
    ``--kv-transfer-config``: this one alone, or the MultiConnector around it,
    which would hand StoreConnector's metadata to NixlConnector in place of
    NIXL's when listed first."""
    side = SimpleNamespace(_worker=SimpleNamespace(layout=SimpleNamespace(digest="d")))
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", side)
    sent = StoreConnector.get_handshake_metadata(side)
    assert sent == StoreLayoutHandshake("d")
    multi = SimpleNamespace(_connectors=[side])
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", multi)
    assert StoreConnector.get_handshake_metadata(side) is None


# ------------------------------------------------------------- workers


def worker(tmp_path: Path, kv: torch.Tensor) -> tuple[StoreCore, WorkerSide]:
    config = parse_config(
        {"path": str(tmp_path / "store"), "pinned_buffer": 2**16, "host_tier": 0}
    )
    core = StoreCore(config, DirectoryBackend(tmp_path / "store", 10**8), IDENT, 1)
    side = WorkerSide(core, BLOCK)
    side.register({"l0": kv, "l1": kv.clone()}, NUM_BLOCKS, 0)
    return core, side


@pytest.mark.parametrize("path", ["host", "batched"])
def test_chunk_of_another_layout_fails_its_load_and_is_replaced(
    tmp_path: Path, path: str
):
    """A hit the scheduler took on a chunk another server's workers wrote
    (keys without the layout: no handshake) fails its block, which vLLM
    then recomputes (or fails, by policy), and the chunk is deleted, so
    this server's save of the block stores it again, and it hits; a worker
    lookup (``before_update_states``) finds nothing in such a chunk.
    ``batched``: the path of a KV cache on an accelerator, which reads into
    host memory first, so a refused chunk never reaches the KV cache."""
    g = torch.Generator().manual_seed(1)
    writer_kv = torch.randn(2, NUM_BLOCKS, HEADS, BLOCK, DIM, generator=g)
    _, writer = worker(tmp_path, writer_kv)
    writer.save(StoreMetadata(saves=[SaveSpec(1, [key(1)])]))
    stored = next((tmp_path / "store" / "chunks").rglob(f"{1:064x}.0"))

    reader_kv = torch.randn(2, NUM_BLOCKS, BLOCK, HEADS, DIM, generator=g)
    core, reader = worker(tmp_path, reader_kv)
    if path == "batched":
        reader.start_batched_transfers()
    before = reader_kv.clone()
    lease = new_lease_id()
    assert core.backend.lease([key(1)], lease, 60) == 1
    reader.start_load(
        StoreMetadata(
            loads=[LoadSpec("r", lease, [2], [[key(1)]])], sync_loads_first=True
        )
    )
    assert reader.take_load_errors() == {2}
    assert torch.equal(reader_kv, before) or path == "host"
    assert core.stats.data["corrupt_chunks"] == 1
    assert not stored.exists()
    reader.save(StoreMetadata(saves=[SaveSpec(2, [key(1)], req_id="s")]))
    if path == "batched":  # written by the save thread
        reader.finished_saves({"s"})
        wait_finished(reader, "s")
    reader.start_load(
        StoreMetadata(
            loads=[LoadSpec("r2", None, [4], [[key(1)]])], sync_loads_first=True
        )
    )
    assert reader.take_load_errors() == set()
    assert torch.equal(reader_kv[:, 4], reader_kv[:, 2])

    writer.save(StoreMetadata(saves=[SaveSpec(3, [key(3)])]))
    probe = ProbeSpec("p", [5], [[key(3)]])
    assert reader.before_update_states(StoreMetadata(probes=[probe])) == {}
    assert core.stats.data["corrupt_chunks"] == 2


def test_scheduler_that_knows_the_layout_finds_another_layout_a_miss(tmp_path: Path):
    g = torch.Generator().manual_seed(2)
    core, side = worker(
        tmp_path, torch.randn(2, NUM_BLOCKS, HEADS, BLOCK, DIM, generator=g)
    )
    side.save(StoreMetadata(saves=[SaveSpec(0, [key(0)])]))
    scheduler = SchedulerSide(core, BLOCK, worker_hits=False, manager=lambda: None)
    assert scheduler._checked_prefix([[key(0)]]) == 1  # no layout known: any
    core.set_kv_layout(side.layout.digest)
    assert scheduler._checked_prefix([[key(0)]]) == 1
    core.set_kv_layout("0" * 16)
    assert scheduler._checked_prefix([[key(0)]]) == 0


def test_saved_chunk_names_its_workers_layout(tmp_path: Path):
    kv = torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, DIM)
    _, side = worker(tmp_path, kv)
    side.save(StoreMetadata(saves=[SaveSpec(0, [key(0)])]))
    data = next((tmp_path / "store" / "chunks").rglob(f"{0:064x}.0")).read_bytes()
    decode_chunk(data, IDENT, key(0), side.layout.digest)
    assert side.layout.digest == digest(kv)

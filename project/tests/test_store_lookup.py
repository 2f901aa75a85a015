"""StoreConnector's scheduler-side lookup without an engine: what it offers
vLLM for a prompt is exactly the run of blocks after the computed prefix
that the store holds whole, for every TP rank, and ours. A block past that
run, a damaged chunk or a rank's missing chunk would be a hit vLLM then
fails to load (under vLLM's default ``kv_load_failure_policy``, a failed
request): each ends the offer there instead, as a plain miss.

Real ``vllm.v1.request.Request`` objects hashed by vLLM's block hasher, the
connector's ``SchedulerSide`` over a real directory store holding real
chunks.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from kvlc_store.backends import DirectoryBackend, Head, known_chunks
from kvlc_store.chunk import HEADER_BYTES, encode_chunk
from kvlc_store.config import parse_config
from kvlc_store.core import StoreCore
from kvlc_store.metadata import LoadSpec, SaveSpec, StoreMetadata
from kvlc_store.scheduler_side import SchedulerSide
from test_store_load import make as make_worker
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

BLOCK = 4
IDENT = "ident0"


def make(
    tmp_path: Path, tp_size: int = 1, verify: bool = True
) -> tuple[StoreCore, SchedulerSide]:
    init_none_hash(sha256)
    store = tmp_path / "store"
    config = parse_config({"path": str(store), "verify_on_lookup": verify})
    core = StoreCore(config, DirectoryBackend(store, 10**8), IDENT, tp_size)
    return core, SchedulerSide(core, BLOCK, worker_hits=False, manager=lambda: None)


def request(num_tokens: int, name: str = "r", first: int = 100) -> Request:
    return Request(
        request_id=name,
        prompt_token_ids=list(range(first, first + num_tokens)),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def store(
    core: StoreCore, req: Request, blocks: list[int], ranks: tuple[int, ...]
) -> None:
    """Store ``req``'s ``blocks`` as each of ``ranks`` would save them."""
    for b in blocks:
        keys = core.keys(req.block_hashes[b])
        for r in ranks:
            payload = bytes([b, r]) * 64
            core.backend.put(keys[r], encode_chunk(IDENT, keys[r], payload))


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
@pytest.mark.parametrize(
    "stored, num_tokens, computed, hit",
    [
        pytest.param([0, 1], 4 * BLOCK + 1, 0, 2 * BLOCK, id="two-of-four"),
        pytest.param([0, 1, 3], 4 * BLOCK + 1, 0, 2 * BLOCK, id="a-gap-ends-it"),
        pytest.param([0, 1, 2, 3], 4 * BLOCK + 1, 0, 4 * BLOCK, id="all"),
        # A prompt of whole blocks: its last token is always computed.
        pytest.param([0, 1, 2, 3], 4 * BLOCK, 0, 4 * BLOCK - 1, id="whole-blocks"),
        # After a computed prefix (the local prefix cache): the rest.
        pytest.param([0, 1, 2], 4 * BLOCK + 1, BLOCK, 2 * BLOCK, id="after-prefix"),
        pytest.param([1, 2], 4 * BLOCK + 1, 0, 0, id="first-missing"),
    ],
)
def test_offer_is_the_stored_run_after_the_computed_prefix(
    tmp_path: Path,
    stored: list[int],
    num_tokens: int,
    computed: int,
    hit: int,
    verify: bool,
):
    core, scheduler = make(tmp_path, verify=verify)
    req = request(num_tokens)
    store(core, req, stored, ranks=(0,))
    offer = scheduler.offer(req, computed)
    if hit == 0:
        assert offer is None
        return
    assert offer is not None
    assert offer.num_tokens == hit
    assert offer.start_block * BLOCK == computed
    # Whole blocks are loaded: the last one may hold the prompt's last token.
    assert offer.num_blocks == -(-hit // BLOCK)
    assert core.stats.data["lookup_hit_tokens"] == hit


def _truncated(chunk: bytes) -> bytes:
    return chunk[:-1]


def _foreign(chunk: bytes) -> bytes:
    # The same key written by a server of another model or KV layout.
    return chunk.replace(IDENT.encode(), b"IDENT0", 1)


def _header_bit_flip(chunk: bytes) -> bytes:
    data = bytearray(chunk)
    data[8] ^= 0x01  # the header's first byte after the magic
    return bytes(data)


def _not_a_chunk(chunk: bytes) -> bytes:
    return bytes(len(chunk))


@pytest.mark.parametrize(
    "damage",
    [_truncated, _foreign, _header_bit_flip, _not_a_chunk],
    ids=lambda damage: damage.__name__.strip("_"),
)
def test_damaged_chunk_found_by_the_lookup_is_a_miss(tmp_path: Path, damage):
    """A chunk whose header or length is wrong ends the offer before its
    block; it is counted and deleted (so the request's own save writes it
    again); the blocks before it are offered."""
    core, scheduler = make(tmp_path)
    req = request(4 * BLOCK + 1)
    store(core, req, [0, 1, 2, 3], ranks=(0,))
    backend = core.backend
    key = core.keys(req.block_hashes[1])[0]
    chunk = backend.get(key)
    assert chunk is not None and len(chunk) > HEADER_BYTES
    backend.delete(key)
    backend.put(key, damage(chunk))

    offer = scheduler.offer(req, 0)
    assert offer is not None and offer.num_tokens == BLOCK
    assert core.stats.data["corrupt_chunks"] == 1
    assert backend.peek([key], HEADER_BYTES) == [None]
    assert backend.get(core.keys(req.block_hashes[2])[0]) is not None


def test_every_tp_rank_must_hold_the_block(tmp_path: Path):
    """With TP 2 each rank keeps its own chunk of a block: a block is
    offered only while both ranks' chunks are stored."""
    core, scheduler = make(tmp_path, tp_size=2)
    req = request(4 * BLOCK + 1)
    store(core, req, [0, 1, 2, 3], ranks=(0,))
    assert scheduler.offer(req, 0) is None
    store(core, req, [0, 2, 3], ranks=(1,))
    offer = scheduler.offer(req, 0)
    assert offer is not None and offer.num_tokens == BLOCK


class FileWork:
    """Counts the chunk files a lookup looks at: existence checks and lstats
    (the lease) and header reads (``verify_on_lookup``)."""

    def __init__(self, core: StoreCore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.exists = 0
        self.peeked: list[str] = []
        exists = os.path.exists

        def counting_exists(path: Any) -> bool:
            if "/chunks/" in str(path):
                self.exists += 1
            return exists(path)

        monkeypatch.setattr(os.path, "exists", counting_exists)
        lstat = os.lstat

        def counting_lstat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
            if "/chunks/" in str(path):
                self.exists += 1
            return lstat(path, *args, **kwargs)

        monkeypatch.setattr(os, "lstat", counting_lstat)
        peek = core.backend.peek

        def counting_peek(keys: Sequence[str], n: int) -> list[Head | None]:
            self.peeked += list(keys)
            return peek(keys, n)

        monkeypatch.setattr(core.backend, "peek", counting_peek)


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_a_repeated_hit_does_no_file_work_per_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verify: bool
):
    """The first lookup of a prompt checks that its chunks exist and reads
    their headers; while no chunk leaves the store, the next lookups of it
    (the lease released in between, as a load does) look at no chunk file,
    and still lease every chunk: an eviction then skips them."""
    writer, _ = make(tmp_path, verify=verify)
    req = request(8 * BLOCK + 1)
    store(writer, req, list(range(8)), ranks=(0,))
    # Another server's scheduler, on its own view of the store.
    core, scheduler = make(tmp_path, verify=verify)
    work = FileWork(core, monkeypatch)
    offer = scheduler.offer(req, 0)
    assert offer is not None and offer.num_tokens == 8 * BLOCK
    assert len(work.peeked) == (8 if verify else 0)
    scheduler.abort(offer)
    first_exists = work.exists
    for _ in range(2):
        work.exists, work.peeked = 0, []
        offer = scheduler.offer(req, 0)
        assert offer is not None and offer.num_tokens == 8 * BLOCK
        assert (work.exists, work.peeked) == (0, [])
        scheduler.abort(offer)
    assert first_exists >= 8

    offer = scheduler.offer(req, 0)
    assert offer is not None
    lease = tmp_path / "store" / "leases" / offer.lease_id
    assert lease.read_text().split()[1:] == [k for ks in offer.keys for k in ks]


@pytest.mark.parametrize("how", ["evicted", "deleted"])
def test_a_chunk_gone_from_the_store_is_looked_up_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
):
    """Another server on the store (its own backend) evicts or deletes a
    chunk this scheduler saw stored and checked: the next lookup sees the
    store changed, looks at the files again and ends the hit before it."""
    core, scheduler = make(tmp_path)
    req = request(4 * BLOCK + 1)
    store(core, req, [0, 1, 2, 3], ranks=(0,))
    offer = scheduler.offer(req, 0)
    assert offer is not None and offer.num_tokens == 4 * BLOCK
    scheduler.abort(offer)

    chunk_bytes = core.backend.num_bytes() // 4
    other = DirectoryBackend(tmp_path / "store", 10**8)
    gone = core.keys(req.block_hashes[2])[0]
    if how == "deleted":
        other.delete(gone)
    else:
        # Eviction is least recently used first: make blocks 2 and 3 the
        # oldest, then fill the store past its capacity (two go).
        for block, mtime in ((2, 1), (3, 2)):
            name = core.keys(req.block_hashes[block])[0].split("/")[1]
            path = next((tmp_path / "store" / "chunks").rglob(name))
            os.utime(path, (mtime, mtime))
        other.capacity_bytes = 4 * chunk_bytes
        other.put(f"{IDENT}/{'f' * 64}.0", bytes(chunk_bytes))
    assert other.peek([gone], 1) == [None]

    work = FileWork(core, monkeypatch)
    offer = scheduler.offer(req, 0)
    assert offer is not None and offer.num_tokens == 2 * BLOCK
    assert work.exists >= 3


def test_a_first_lookup_of_checked_chunks_does_no_file_work_per_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Headers one server's lookup checked are in the store's record: another
    server's first lookup of the prompt (or this one's after a restart)
    leases them without looking at one chunk file."""
    _, first = make(tmp_path)
    req = request(8 * BLOCK + 1)
    store(first._core, req, list(range(8)), ranks=(0,))
    offer = first.offer(req, 0)
    assert offer is not None and offer.num_tokens == 8 * BLOCK
    first.abort(offer)

    core, scheduler = make(tmp_path)
    work = FileWork(core, monkeypatch)
    offer = scheduler.offer(req, 0)
    assert offer is not None and offer.num_tokens == 8 * BLOCK
    assert (work.exists, work.peeked) == (0, [])


def test_a_first_lookup_of_chunks_a_worker_saved_reads_no_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A worker's saves go to the store's record (their headers are its
    own): a first lookup of them, by any server, reads none."""
    core, scheduler = make(tmp_path)
    req = request(2 * BLOCK + 1)
    _, worker, _ = make_worker(tmp_path)
    worker.save(
        StoreMetadata(
            saves=[SaveSpec(b, core.keys(req.block_hashes[b])) for b in (0, 1)]
        )
    )
    work = FileWork(core, monkeypatch)
    offer = scheduler.offer(req, 0)
    assert offer is not None and offer.num_tokens == 2 * BLOCK
    assert (work.exists, work.peeked) == (0, [])


def test_a_chunk_removed_by_hand_is_forgotten_at_its_failed_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """A chunk file removed by hand (not through a server) does not start a
    new generation: the lookup still offers it, and the load finds it gone.
    That load forgets it for every process of the store: one line naming
    the key, the next lookup misses it (a request fails at most once under
    ``fail``), and ``size`` stops counting it."""
    core, scheduler = make(tmp_path)
    req = request(4 * BLOCK + 1)
    worker_core, worker, _ = make_worker(tmp_path)
    keys = core.keys_of(req.block_hashes[:4])
    worker.save(StoreMetadata(saves=[SaveSpec(b, keys[b]) for b in range(4)]))
    gone = keys[1][0]
    identity, _, name = gone.partition("/")
    (tmp_path / "store" / "chunks" / identity / name[:2] / name).unlink()

    offer = scheduler.offer(req, 0)
    assert offer is not None and offer.num_tokens == 4 * BLOCK
    load = LoadSpec("r", offer.lease_id, [0, 1, 2, 3], offer.keys)
    worker.start_load(StoreMetadata(loads=[load], sync_loads_first=True))
    assert worker.take_load_errors() == {1}
    assert f"gone from the store at load ({gone})" in caplog.text
    assert worker_core.stats.data["gone_chunks"] == 1

    again = scheduler.offer(request(4 * BLOCK + 1, name="r2"), 0)
    assert again is not None and again.num_tokens == BLOCK
    on_disk = sum(p.stat().st_size for p in (tmp_path / "store/chunks").rglob("*.0"))
    assert int((tmp_path / "store" / "size").read_text()) == on_disk


def test_size_counts_what_is_on_disk_at_start(tmp_path: Path):
    """Chunk files removed while no server ran: ``size`` is counted anew
    when a server opens the store, so capacity decisions are made on the
    bytes there."""
    core, _ = make(tmp_path)
    req = request(4 * BLOCK + 1)
    store(core, req, [0, 1, 2, 3], ranks=(0,))
    for path in list((tmp_path / "store" / "chunks").rglob("*.0"))[:3]:
        path.unlink()
    DirectoryBackend(tmp_path / "store", 10**8)
    on_disk = sum(p.stat().st_size for p in (tmp_path / "store/chunks").rglob("*.0"))
    assert int((tmp_path / "store" / "size").read_text()) == on_disk > 0


def checked_once(tmp_path: Path) -> Request:
    """A request of 4 blocks, stored, that a lookup checked (and recorded)."""
    _, first = make(tmp_path)
    req = request(4 * BLOCK + 1)
    store(first._core, req, [0, 1, 2, 3], ranks=(0,))
    offer = first.offer(req, 0)
    assert offer is not None and offer.num_tokens == 4 * BLOCK
    first.abort(offer)
    return req


def test_a_chunk_gone_from_the_store_leaves_the_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A chunk deleted through a backend starts a new generation: a first
    lookup after it reads the headers again and ends the hit before it."""
    req = checked_once(tmp_path)
    other = DirectoryBackend(tmp_path / "store", 10**8)
    other.delete(other_key := f"{IDENT}/{req.block_hashes[2].hex()}.0")
    assert other.peek([other_key], 1) == [None]

    core, scheduler = make(tmp_path)
    work = FileWork(core, monkeypatch)
    offer = scheduler.offer(req, 0)
    assert offer is not None and offer.num_tokens == 2 * BLOCK
    assert len(work.peeked) == 2


def test_the_record_of_another_boot_is_not_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Chunk files are not synced: after a crash of the machine a chunk the
    record lists may be empty, so a record is taken on the boot that wrote
    it only."""
    boot = tmp_path / "boot_id"
    boot.write_text("boot-a\n")
    monkeypatch.setattr(known_chunks, "_BOOT_ID", boot)
    req = checked_once(tmp_path)

    boot.write_text("boot-b\n")
    core, scheduler = make(tmp_path)
    work = FileWork(core, monkeypatch)
    offer = scheduler.offer(req, 0)
    assert offer is not None and offer.num_tokens == 4 * BLOCK
    assert len(work.peeked) == 4
    # A server of the new boot removed the old boot's record at its start.
    records = [p.name for p in (tmp_path / "store" / "checked").iterdir()]
    assert records and all(name.startswith("boot-b-") for name in records)


def test_a_damaged_chunk_is_never_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A lookup that finds a damaged chunk records none of the prompt's
    (deleting it started a new generation): the next lookup, of any
    server, reads the headers again and offers the blocks before it."""
    core, scheduler = make(tmp_path)
    req = request(4 * BLOCK + 1)
    store(core, req, [0, 1, 2, 3], ranks=(0,))
    key = core.keys(req.block_hashes[1])[0]
    chunk = core.backend.get(key)
    assert chunk is not None
    core.backend.delete(key)
    core.backend.put(key, _truncated(chunk))
    offer = scheduler.offer(req, 0)
    assert offer is not None and offer.num_tokens == BLOCK
    scheduler.abort(offer)

    other, again = make(tmp_path)
    work = FileWork(other, monkeypatch)
    offer = again.offer(req, 0)
    assert offer is not None and offer.num_tokens == BLOCK
    assert work.peeked == other.keys(req.block_hashes[0])


def test_what_a_process_knows_stored_is_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Past ``KNOWN_CHUNKS`` chunks a process starts over: its memory stays
    bounded, and the next lookup looks at the files again."""
    monkeypatch.setattr(known_chunks, "KNOWN_CHUNKS", 4)
    writer, _ = make(tmp_path)
    req = request(8 * BLOCK + 1)
    store(writer, req, list(range(8)), ranks=(0,))
    core, scheduler = make(tmp_path, verify=False)
    work = FileWork(core, monkeypatch)
    for _ in range(2):
        work.exists = 0
        offer = scheduler.offer(req, 0)
        assert offer is not None and offer.num_tokens == 8 * BLOCK
        scheduler.abort(offer)
        assert work.exists >= 8


def formatted_keys(core: StoreCore, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The block hashes whose chunk keys ``core`` formats from now on."""
    formatted: list[bytes] = []
    keys_of = core.keys_of

    def counting_keys_of(block_hashes: Sequence[bytes]) -> list[list[str]]:
        formatted.extend(block_hashes)
        return keys_of(block_hashes)

    monkeypatch.setattr(core, "keys_of", counting_keys_of)
    return formatted


def test_a_repeated_hit_formats_no_chunk_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The keys of blocks this server loaded are kept with them: the next
    lookup of the prompt takes them from memory instead of formatting one
    string per chunk."""
    core, scheduler = make(tmp_path)
    req = request(8 * BLOCK + 1)
    store(core, req, list(range(8)), ranks=(0,))
    offer = scheduler.offer(req, 0)
    assert offer is not None
    scheduler.commit(req, list(range(9)), offer, offer.num_tokens)
    formatted = formatted_keys(core, monkeypatch)
    again = scheduler.offer(request(8 * BLOCK + 1, name="r2"), 0)
    assert again is not None and again.keys == offer.keys
    assert formatted == []


def test_the_blocks_a_scheduler_remembers_are_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A long-running server loads prompt after prompt: the block keys it
    keeps (``known_blocks``) stay within their bound, the most recent kept.
    After 20 hits of 32 blocks with room for 64, the first prompt's keys are
    formatted again and the last one's are not."""
    core, _ = make(tmp_path)
    scheduler = SchedulerSide(
        core, BLOCK, worker_hits=False, manager=lambda: None, known_blocks=64
    )
    prompts = [
        request(32 * BLOCK + 1, f"r{i}", first=1000 * (i + 1)) for i in range(20)
    ]
    for req in prompts:
        store(core, req, list(range(32)), ranks=(0,))
        offer = scheduler.offer(req, 0)
        assert offer is not None and offer.num_blocks == 32
        scheduler.commit(req, list(range(33)), offer, offer.num_tokens)
    formatted = formatted_keys(core, monkeypatch)
    assert scheduler.offer(prompts[-1], 0) is not None
    assert formatted == []
    assert scheduler.offer(prompts[0], 0) is not None
    assert len(formatted) == 32


def test_keys_kept_in_memory_follow_the_kv_layout(tmp_path: Path):
    """Once the workers name their KV layout, chunk keys carry it: the keys
    a scheduler kept from before are not used, so chunks stored under
    another layout's keys are a miss, not a hit."""
    core, scheduler = make(tmp_path, verify=False)
    req = request(4 * BLOCK + 1)
    store(core, req, [0, 1, 2, 3], ranks=(0,))
    offer = scheduler.offer(req, 0)
    assert offer is not None and offer.num_tokens == 4 * BLOCK
    scheduler.commit(req, list(range(5)), offer, offer.num_tokens)

    core.set_kv_layout("f" * 16)
    assert scheduler.offer(request(4 * BLOCK + 1, name="r2"), 0) is None

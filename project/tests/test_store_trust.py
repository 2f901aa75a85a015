"""Whom StoreConnector's directory store trusts, and the settings that guard
it, without an engine: a store another user made is refused (a root server
pointed at it would serve whatever they put there); a chunk file that is a
link, a FIFO or writable by the group is a miss with one line, never a hang
or a read outside the store; the path is checked as given (links included)
and the store's own directories too; a password file others may read is
refused; sizes and timeouts mean what the README says; a failed write leaves
lookups alone; chunks that failed to load and cannot be deleted are never
offered again; evictions are logged.

The same cases against ``vllm serve`` are in ``test_store_security_e2e.py``.
Runs as root or not: another user is played by ``os.geteuid`` patched to
another uid where the check reads it, never by ``chown`` alone (root's
``chown`` would hide what a group-writable or a squatted file does).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvlc_store.backends import DirectoryBackend, directory, new_lease_id
from kvlc_store.chunk import encode_chunk
from kvlc_store.config import (
    SecretInConfig,
    StoreConfig,
    parse_config,
    parse_size,
    redis_password,
)
from kvlc_store.core import EVICTIONS_LOG_S, StoreCore
from kvlc_store.scheduler_side import SchedulerSide
from test_store_lookup import BLOCK, IDENT, FileWork, checked_once, make, request, store

KEY = f"{IDENT}/{1:064x}.0"
DATA = encode_chunk(IDENT, KEY, b"kv" * 500)


@pytest.fixture
def caplog(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """``caplog`` that also sees vLLM's loggers, once each (they do not
    propagate once vLLM configured its logging)."""
    logger = logging.getLogger("vllm")
    caplog.set_level(logging.INFO, logger="vllm")
    if logger.propagate:
        yield caplog
        return
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


def another_user(monkeypatch: pytest.MonkeyPatch) -> int:
    """Make this process look like another user to the store's checks (its
    files and directories now belong to someone else); that user's uid."""
    other = os.geteuid() + 1
    monkeypatch.setattr(os, "geteuid", lambda: other)
    return other


def chunk_path(root: Path, key: str = KEY) -> Path:
    identity, _, name = key.partition("/")
    return root / "chunks" / identity / name[:2] / name


# -- a store another user made -------------------------------------------------


def test_store_another_user_made_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The squatter made the directory and put chunks in it (valid checksums
    and all): a server that can write it refuses it, naming the owner."""
    root = tmp_path / "store"
    DirectoryBackend(root, 10**6).put(KEY, DATA)
    owner = root.stat().st_uid
    another_user(monkeypatch)
    with pytest.raises(ValueError, match=rf"belongs to another user \(uid {owner}\)"):
        parse_config({"path": str(root)})
    # A store of its own is fine; so is a missing one (it creates it).
    monkeypatch.undo()
    parse_config({"path": str(root)})
    parse_config({"path": str(tmp_path / "new")})


def test_writable_store_does_not_trust_its_owners_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
):
    """If the check was skipped, the backend still serves none of the
    owner's chunks from a store this user writes; from a store it only
    reads (prebuilt by its owner), it does."""
    root = tmp_path / "store"
    DirectoryBackend(root, 10**6).put(KEY, DATA)
    another_user(monkeypatch)
    backend = DirectoryBackend(root, 10**6)
    assert not backend.read_only
    assert backend.peek([KEY], 8) == [None]
    assert backend.get(KEY) is None
    assert "is not served: it belongs to uid" in caplog.text

    monkeypatch.setattr(directory, "_read_only", lambda root: True)
    reader = DirectoryBackend(root, 10**6)
    assert reader.get(KEY) == DATA


def test_group_access_needs_a_group_of_this_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    root = tmp_path / "store"
    DirectoryBackend(root, 10**6, group_access=True)
    parse_config({"path": str(root), "group_access": True})
    gid = root.stat().st_gid
    monkeypatch.setattr(os, "getegid", lambda: gid + 1)
    monkeypatch.setattr(os, "getgroups", lambda: [gid + 1])
    with pytest.raises(ValueError, match=rf"its group \(gid {gid}\) is not one"):
        parse_config({"path": str(root), "group_access": True})


def test_group_writable_chunk_is_refused_without_group_access(tmp_path: Path, caplog):
    """This user's own chunk, but its group may rewrite it (0660): not
    served unless the store is shared with the group on purpose."""
    root = tmp_path / "store"
    DirectoryBackend(root, 10**6).put(KEY, DATA)
    chunk_path(root).chmod(0o660)
    backend = DirectoryBackend(root, 10**6)
    assert backend.peek([KEY], 8) == [None]
    into = bytearray(len(DATA) - 8)
    assert list(backend.read_into([KEY], 8, [[memoryview(into)]])) == [None]
    assert "(mode 660)" in caplog.text
    shared = DirectoryBackend(root, 10**6, group_access=True)
    assert shared.get(KEY) == DATA


# -- the path, as given, and the store's own directories -----------------------


def test_world_writable_directory_anywhere_above_is_refused(tmp_path: Path):
    top = tmp_path / "open"
    (top / "a" / "b").mkdir(parents=True)
    top.chmod(0o777)
    with pytest.raises(ValueError, match=rf"{top}, above the store, is writable"):
        parse_config({"path": str(top / "a" / "b" / "store")})


def test_store_through_a_link_in_a_world_writable_directory_is_refused(
    tmp_path: Path,
):
    """The link's directory lets anyone point the link at their own store,
    though the store it resolves to is private."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    DirectoryBackend(private / "store", 10**6)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    (shared / "store").symlink_to(private / "store")
    with pytest.raises(ValueError, match=rf"{shared}, above the store, is writable"):
        parse_config({"path": str(shared / "store")})
    shared.chmod(0o755)
    config = parse_config({"path": str(shared / "store")})
    assert config.path == private / "store"


NOBODY = 65534
as_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="another user's file is made with chown (root)"
)


@as_root
def test_store_through_another_users_link_in_a_sticky_directory_is_refused(
    tmp_path: Path,
):
    """A sticky directory every user may write (/tmp) keeps others from
    replacing this user's links, not from planting their own: a root server
    told to use such a link would follow it wherever its owner points it
    (``fs.protected_symlinks`` off, the kernel's own default)."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    link = sticky / "store"
    link.symlink_to(private / "store")
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(ValueError, match=rf"{link} is a link of another user"):
        parse_config({"path": str(link)})
    assert not (private / "store").exists()
    os.lchown(link, os.geteuid(), os.getegid())
    assert parse_config({"path": str(link)}).path == private / "store"


@as_root
def test_directory_above_the_store_of_another_user_is_refused(tmp_path: Path):
    """Whoever owns a directory above the store can rename the store away
    and put theirs in its place, generation file and all."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(
        ValueError, match=rf"{theirs}, above the store, belongs to another user"
    ):
        parse_config({"path": str(theirs / "store")})
    os.chown(theirs, os.geteuid(), os.getegid())
    parse_config({"path": str(theirs / "store")})


def test_directory_holding_other_files_is_not_made_a_store(tmp_path: Path):
    """A path that names a directory of other files (a typo, a home
    directory) is refused before anything is written into it; an empty one
    and an existing store are taken."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds files that are not a store's \(notes"):
        parse_config({"path": str(home)})
    assert sorted(p.name for p in home.iterdir()) == ["notes.txt"]
    (home / "notes.txt").unlink()
    parse_config({"path": str(home)})
    DirectoryBackend(home, 10**6)
    parse_config({"path": str(home)})


@pytest.mark.parametrize("part", ["chunks", "leases", "checked"])
def test_store_directories_others_can_write_are_refused(tmp_path: Path, part: str):
    root = tmp_path / "store"
    DirectoryBackend(root, 10**6)
    (root / part).chmod(0o777)
    with pytest.raises(ValueError, match=rf"{root / part} is writable by"):
        parse_config({"path": str(root)})


# -- chunk files that are not chunks -------------------------------------------


def test_fifo_under_a_chunks_name_is_a_miss_without_blocking(tmp_path: Path, caplog):
    """A FIFO (here behind a link, as a user who could write the store would
    plant it) blocks a reader that opens it until someone writes it: every
    request would hang. It is refused at once, with one line."""
    root = tmp_path / "store"
    backend = DirectoryBackend(root, 10**6)
    backend.put(KEY, DATA)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    direct = f"{IDENT}/{2:064x}.0"
    chunk_path(root).unlink()
    chunk_path(root).symlink_to(fifo)
    os.mkfifo(chunk_path(root, direct))
    # Another process's view: this one remembers KEY as stored since its put.
    backend = DirectoryBackend(root, 10**6)
    results: list[object] = []

    def read() -> None:
        for key in (KEY, direct):
            into = bytearray(len(DATA) - 8)
            results.append(backend.peek([key], 8))
            results.append(list(backend.read_into([key], 8, [[memoryview(into)]])))
            results.append(backend.get(key))
            results.append(backend.lease([key], new_lease_id(), 60))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # let it finish: open the FIFOs for writing
        for path in (fifo, chunk_path(root, direct)):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("a read of a FIFO under a chunk's name blocked")
    assert results == [[None], [None], None, 0] * 2
    assert caplog.text.count("it is a symbolic link, not a regular file") == 1
    assert caplog.text.count("it is a FIFO, not a regular file") == 1


def test_link_to_a_chunk_outside_the_store_is_not_served(tmp_path: Path, caplog):
    """A valid chunk outside the store, linked under its key: not served, not
    touched (its mtime, the store's LRU clock, stays); the next save of the
    key replaces the link with a chunk of the store's own."""
    root = tmp_path / "store"
    backend = DirectoryBackend(root, 10**6)
    outside = tmp_path / "outside.0"
    outside.write_bytes(DATA)
    os.utime(outside, (1_000_000, 1_000_000))
    chunk_path(root).parent.mkdir(parents=True)
    chunk_path(root).symlink_to(outside)
    assert backend.lease([KEY], new_lease_id(), 60) == 0
    assert backend.peek([KEY], 8) == [None]
    assert backend.get(KEY) is None
    assert outside.stat().st_mtime == 1_000_000
    assert caplog.text.count("is not served: it is a symbolic link") == 1
    assert backend.put(KEY, DATA) == 0
    assert not chunk_path(root).is_symlink()
    assert backend.get(KEY) == DATA
    assert outside.read_bytes() == DATA


# -- secrets and settings -------------------------------------------------------


def redis_config(**settings: object) -> StoreConfig:
    return parse_config(
        {"backend": "redis", "redis_url": "redis://127.0.0.1:1/0", **settings},
        check_store=False,
    )


def test_a_record_others_may_write_is_not_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    """The record vouches for chunks as the chunks' own headers would: one
    that another user could have written is ignored, with a line, and the
    lookup reads the headers."""
    req = checked_once(tmp_path)
    (record,) = (tmp_path / "store" / "checked").iterdir()
    record.chmod(0o666)

    core, scheduler = make(tmp_path)
    work = FileWork(core, monkeypatch)
    offer = scheduler.offer(req, 0)
    assert offer is not None and offer.num_tokens == 4 * BLOCK
    assert len(work.peeked) == 4
    assert f"record of checked chunks {record} is not served" in caplog.text


def test_password_file_others_may_read_is_refused(tmp_path: Path):
    path = tmp_path / "redis-password"
    path.write_text("s3cret-Pw\n")
    path.chmod(0o600)
    config = redis_config(redis_password_file=str(path))
    assert redis_password(config) == "s3cret-Pw"
    for mode in (0o644, 0o640, 0o602):
        path.chmod(mode)
        with pytest.raises(ValueError, match=rf"\(mode {mode:o}\); chmod 600 it"):
            redis_password(config)
    with pytest.raises(ValueError, match=r"other users may read or write it") as e:
        parse_config(
            {
                "backend": "redis",
                "redis_url": "redis://127.0.0.1:1/0",
                "redis_password_file": str(path),
            }
        )
    assert "s3cret" not in str(e.value)


@pytest.mark.parametrize(
    "url", ["http://user:s3cret-Pw@h:1/0", "REDIS://:s3cret-Pw@h:1/0"]
)
def test_url_with_a_password_and_a_wrong_scheme_hides_the_password(url: str):
    with pytest.raises(SecretInConfig) as e:
        parse_config({"backend": "redis", "redis_url": url})
    assert "s3cret" not in str(e.value)
    assert "set a URL like 'redis://127.0.0.1:6379/0'" in str(e.value)


def test_sizes_in_decimal_and_binary_units():
    assert parse_size("8GB") == 8 * 10**9
    assert parse_size("8GiB") == 8 * 2**30
    assert parse_size("512MB") == 512 * 10**6
    assert parse_size("64KiB") == 64 * 2**10
    assert parse_size("1.5TB") == 15 * 10**11


def test_redis_timeout_is_at_most_an_hour():
    """The documented limit (README, settings: at most 3600 seconds), not a
    lease's day."""
    assert redis_config(redis_timeout_s=3600).redis_timeout_s == 3600
    with pytest.raises(ValueError, match=r"redis_timeout_s.*at most 3600"):
        redis_config(redis_timeout_s=3601)


# -- outages, damaged chunks, evictions ----------------------------------------


def core_on(tmp_path: Path, **settings: object) -> StoreCore:
    root = tmp_path / "store"
    config = parse_config({"path": str(root), **settings})
    return StoreCore(config, DirectoryBackend(root, config.capacity_bytes), IDENT, 1)


def test_failed_write_leaves_lookups_alone(tmp_path: Path):
    """A full store fails writes only: this worker's and the scheduler's
    lookups go on hitting. A store that cannot be read is not written
    either."""
    from kvlc_store.backends import BackendUnavailable

    core = core_on(tmp_path)
    core.unavailable(BackendUnavailable("No space left on device"), "write")
    assert core.usable("read")
    assert not core.usable("write")
    other = core_on(tmp_path / "b")
    other.unavailable(BackendUnavailable("Connection refused"))
    assert not other.usable("read")
    assert not other.usable("write")


class Manager:
    """The scheduler's KV cache manager as ``SchedulerSide`` asks it."""

    def __init__(self, block_ids: list[int]) -> None:
        self.block_ids = block_ids

    def get_block_ids(self, req_id: str) -> tuple[list[int]]:
        return (self.block_ids,)


@pytest.mark.parametrize("writable", [True, False])
def test_load_errors_remember_damaged_keys_only_when_not_deletable(
    tmp_path: Path, writable: bool
):
    """A block whose load failed: its chunk was deleted by the worker on a
    writable store (the request's save writes it again: offered again
    later); on one it cannot write, the chunk stays, and offering it again
    would fail every load, so it is never offered again."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    core = core_on(tmp_path)
    side = SchedulerSide(core, BLOCK, False, lambda: Manager([10, 11, 12]))
    req = request(3 * BLOCK + 1)
    store(core, req, [0, 1, 2], (0,))
    side.arrived(req)
    offer = side.offer(req, 0)
    assert offer is not None and offer.num_blocks == 3
    side.commit(req, [10, 11, 12], offer, offer.num_tokens)
    if not writable:
        core.backend.read_only = True
    side.on_load_errors({11})
    again = side.offer(request(3 * BLOCK + 1, "again"), 0)
    assert again is not None
    assert again.num_blocks == (3 if writable else 1)


def test_a_block_that_failed_to_load_is_saved_when_the_prefix_cache_serves_it(
    tmp_path: Path,
):
    """A block loaded from the store is not saved again when vLLM's prefix
    cache serves it to a later request, unless its load failed (its chunk
    damaged or gone): then the later request saves it."""
    from types import SimpleNamespace

    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    core = core_on(tmp_path)
    manager = Manager([10, 11, 12, 13])
    side = SchedulerSide(core, BLOCK, False, lambda: manager)
    req = request(3 * BLOCK + 1)
    store(core, req, [0, 1, 2], (0,))
    side.arrived(req)
    offer = side.offer(req, 0)
    assert offer is not None and offer.num_blocks == 3
    side.commit(req, [10, 11, 12, 13], offer, offer.num_tokens)
    side.on_load_errors({11})
    side.finished(req)

    later = request(3 * BLOCK + 1, "later")
    side.arrived(later)
    manager.block_ids = [20, 21, 22, 23]
    output = SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id="later", num_computed_tokens=3 * BLOCK)
        ],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        has_sync_kv_loads=False,
        num_scheduled_tokens={"later": 1},
        preempted_req_ids=set(),
    )
    meta = side.build_meta(output)  # type: ignore[arg-type]
    assert [save.block_id for save in meta.saves] == [21]


def test_evictions_are_logged_when_they_start_and_then_at_intervals(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
):
    core = core_on(tmp_path, capacity="64KiB")
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    core.evicted(0)
    assert "evicted" not in caplog.text
    core.evicted(3)
    core.evicted(2)  # within the interval: counted, told later
    now[0] += EVICTIONS_LOG_S
    core.evicted(4)
    lines = [r.getMessage() for r in caplog.records if "evicted" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "reached its capacity (0.00 GiB): evicted 3 least recently" in lines[0]
    since = f"in the last {EVICTIONS_LOG_S:.0f} s"
    assert f"evicted 6 least recently used chunks {since}" in lines[1]
    assert core.stats.data["evictions"] == 9


def test_a_save_that_evicts_logs_it(tmp_path: Path, caplog):
    """Through a worker's save: the store's cap reached is a line, not only
    a counter in the metrics."""
    import torch
    from kvlc_store.metadata import SaveSpec, StoreMetadata
    from kvlc_store.worker_side import WorkerSide

    core = core_on(tmp_path, capacity="64KiB")
    worker = WorkerSide(core, BLOCK)
    worker.register({"l0": torch.zeros(2, 8, BLOCK, 1024, dtype=torch.uint8)}, 8, 0)
    keys = [f"{IDENT}/{b:064x}.0" for b in range(8)]
    worker.save(StoreMetadata(saves=[SaveSpec(b, [keys[b]]) for b in range(8)]))
    assert core.stats.data["evictions"] > 0
    assert "the store reached its capacity" in caplog.text

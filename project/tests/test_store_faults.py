"""The directory store when its file system fails: every error a miss or a
skipped save (``BackendUnavailable``), counted, logged once, and the store
back by itself once the file system is. A chunk write that fails for lack
of space stops a worker's saves, not its reads.

Faults are simulated (monkeypatched ``os`` calls) where a real one needs
root or a full disk; a deleted directory is real.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from kvlc_store.backends import (
    BackendUnavailable,
    DirectoryBackend,
    directory,
    new_lease_id,
)

KEY = f"ident0/{1:064x}.0"
DATA = b"x" * 1000


class Failing:
    """``real``, except that it raises ``OSError(err)`` while ``armed``."""

    def __init__(self, err: int, real: Any) -> None:
        self.err = err
        self.real = real
        self.armed = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.armed:
            raise OSError(self.err, os.strerror(self.err))
        return self.real(*args, **kwargs)


def test_deleted_directory_is_a_miss_then_recreated(tmp_path: Path):
    root = tmp_path / "store"
    store = DirectoryBackend(root, 10**6)
    store.put(KEY, DATA)
    shutil.rmtree(root)
    # The lookup that killed the server (FileNotFoundError on .lock).
    assert store.lease([KEY], new_lease_id(), 60) == 0
    assert store.get(KEY) is None
    assert store.put(KEY, DATA) == 0
    assert store.get(KEY) == DATA
    assert store.num_bytes() == len(DATA)


def test_directory_that_cannot_be_recreated_is_unavailable(tmp_path: Path):
    root = tmp_path / "parent" / "store"
    store = DirectoryBackend(root, 10**6)
    shutil.rmtree(root.parent)
    root.parent.write_text("now a file")  # NotADirectoryError below it
    for op in (
        lambda: store.lease([KEY], new_lease_id(), 60),
        lambda: store.put(KEY, DATA),
        lambda: store.release([KEY], "lease"),
        lambda: store.delete(KEY),
    ):
        with pytest.raises(BackendUnavailable, match="store directory"):
            op()
    root.parent.unlink()
    assert store.put(KEY, DATA) == 0  # back by itself
    assert store.get(KEY) == DATA


def test_full_disk_skips_the_save_and_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    store = DirectoryBackend(tmp_path, 10**6)
    write = Failing(errno.ENOSPC, os.writev)
    monkeypatch.setattr(directory.os, "writev", write)
    with pytest.raises(BackendUnavailable, match="No space left on device"):
        store.put(KEY, DATA)
    assert list((tmp_path / "tmp").iterdir()) == []
    assert store.get(KEY) is None
    write.armed = False  # space again
    store.put(KEY, DATA)
    assert store.get(KEY) == DATA


@pytest.mark.parametrize("err", [errno.EIO, errno.EACCES])
def test_read_errors_are_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int
):
    store = DirectoryBackend(tmp_path, 10**6)
    store.put(KEY, DATA)
    # Whole chunks, lookups (headers) and loads (straight into KV) read with
    # pread/preadv.
    pread = Failing(err, os.pread)
    monkeypatch.setattr(directory.os, "pread", pread)
    with pytest.raises(BackendUnavailable, match=os.strerror(err)):
        store.get(KEY)
    with pytest.raises(BackendUnavailable, match=os.strerror(err)):
        store.peek([KEY], 10)
    with pytest.raises(BackendUnavailable, match=os.strerror(err)):
        list(store.read_into([KEY], 10, [[memoryview(bytearray(990))]]))
    pread.armed = False
    assert store.get(KEY) == DATA
    target = bytearray(990)
    assert list(store.read_into([KEY], 10, [[memoryview(target)]])) == [
        (DATA[:10], len(DATA))
    ]
    assert bytes(target) == DATA[10:]


@pytest.mark.parametrize("err", [errno.EIO, errno.EACCES], ids=errno.errorcode.get)
def test_open_errors_are_unavailable_not_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int
):
    """A chunk file that exists but cannot be opened (an I/O error, lost
    permission) is a store fault like a failed read, not a missing chunk:
    the caller counts it and backs off instead of computing and saving the
    block again into a store that cannot serve it."""
    store = DirectoryBackend(tmp_path, 10**6)
    store.put(KEY, DATA)
    real_open = os.open

    def refuse_chunks(path: Any, flags: int, *args: Any) -> int:
        if str(path).endswith(KEY.partition("/")[2]):
            raise OSError(err, os.strerror(err))
        return real_open(path, flags, *args)

    monkeypatch.setattr(directory.os, "open", refuse_chunks)
    with pytest.raises(BackendUnavailable, match=os.strerror(err)):
        store.peek([KEY], 10)
    with pytest.raises(BackendUnavailable, match=os.strerror(err)):
        list(store.read_into([KEY], 10, [[memoryview(bytearray(990))]]))
    monkeypatch.undo()
    target = bytearray(990)
    assert list(store.read_into([KEY], 10, [[memoryview(target)]])) == [
        (DATA[:10], len(DATA))
    ]


def test_lock_errors_are_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    store = DirectoryBackend(tmp_path, 10**6)
    store.put(KEY, DATA)
    flock = Failing(errno.EIO, directory.fcntl.flock)
    monkeypatch.setattr(directory.fcntl, "flock", flock)
    with pytest.raises(BackendUnavailable, match="Input/output error"):
        store.lease([KEY], new_lease_id(), 60)
    flock.armed = False
    assert store.lease([KEY], new_lease_id(), 60) == 1


def test_store_errors_are_counted_and_logged_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from kvlc_store import core
    from kvlc_store.config import parse_config

    warnings: list[str] = []
    infos: list[str] = []
    monkeypatch.setattr(
        core.logger, "warning", lambda msg, *a: warnings.append(msg % a)
    )
    monkeypatch.setattr(core.logger, "info", lambda msg, *a: infos.append(msg % a))
    config = parse_config({"path": str(tmp_path)})
    conn = core.StoreCore(config, DirectoryBackend(tmp_path, 10**6), "ident0", 1)
    full = BackendUnavailable("No space left on device")
    for _ in range(3):
        conn.unavailable(full, "write")
    conn.available("read")  # reads work: the write failure stands
    conn.unavailable(BackendUnavailable("Input/output error"), "read")
    assert len(warnings) == 2
    assert "skipping saves" in warnings[0] and "running on misses" in warnings[1]
    assert conn.stats.data["store_errors"] == 4
    conn.available("write")
    conn.unavailable(full, "write")  # failing again after a recovery: warn again
    assert len(infos) == 1 and len(warnings) == 3


def test_failing_store_is_skipped_with_growing_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """After a failure the store is skipped (no call waits out a hung
    store's timeout) for RETRY_FIRST_S, doubling with each failed retry up
    to RETRY_MAX_S (saves too, after a failed read; not reads after a failed
    save); one line when it fails, one when an operation that needs the
    store works again."""
    from kvlc_store import core
    from kvlc_store.config import parse_config

    now = [1000.0]
    monkeypatch.setattr(core.time, "monotonic", lambda: now[0])
    lines: list[str] = []
    monkeypatch.setattr(core.logger, "warning", lambda msg, *a: lines.append(msg % a))
    monkeypatch.setattr(core.logger, "info", lambda msg, *a: lines.append(msg % a))
    config = parse_config({"path": str(tmp_path / "backoff")})
    conn = core.StoreCore(config, DirectoryBackend(tmp_path, 10**6), "ident0", 1)
    hung = BackendUnavailable("redis: Timeout reading from socket")
    waits = []
    for _ in range(7):
        conn.unavailable(hung)
        assert not conn.usable("write")  # an unreadable store is not written
        start = now[0]
        while not conn.usable():
            now[0] += 0.5
        waits.append(now[0] - start)
        assert conn.usable("write")
    assert waits == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0, 60.0]
    assert len(lines) == 1
    assert "store read failed, running on misses until it works again" in lines[0]
    conn.unavailable(BackendUnavailable("No space left on device"), "write")
    assert conn.usable() and not conn.usable("write")  # a full disk reads
    assert len(lines) == 2 and "skipping saves" in lines[1]
    now[0] += 5.0
    conn.available("write")
    conn.available()
    assert lines[2:] == [
        "StoreConnector: store write works again",
        "StoreConnector: store read works again",
    ]
    conn.unavailable(hung)  # a new outage starts from the first wait
    now[0] += 5.0
    assert conn.usable() and len(lines) == 5


@pytest.mark.parametrize("path", ["host", "batched"])
def test_full_disk_on_a_worker_save_leaves_its_reads_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
):
    """A chunk write that fails for lack of space (ENOSPC), through the
    worker's own save path (the step's writes for a host KV cache; the save
    thread's for the batched path), is a write failure: counted, told once
    as skipped saves, the step's other saves skipped. Reads are not backed
    off: the worker's lookup still hits, and a load still loads and
    releases its lease and the lookup's."""
    from kvlc_store import core as core_module
    from kvlc_store.metadata import LoadSpec, ProbeSpec, SaveSpec, StoreMetadata
    from test_store_device_transfer import wait_finished
    from test_store_load import BLOCK, make
    from test_store_load import key as chunk_key

    warnings: list[str] = []
    monkeypatch.setattr(
        core_module.logger, "warning", lambda msg, *a: warnings.append(msg % a)
    )
    core, worker, _ = make(tmp_path)
    if path == "batched":
        worker.start_batched_transfers()

    def save(blocks: list[int], req_id: str) -> None:
        worker.save(
            StoreMetadata(
                saves=[SaveSpec(b, [chunk_key(b)], req_id=req_id) for b in blocks]
            )
        )
        if path == "batched":  # written by the save thread: wait for it
            worker.finished_saves({req_id})
            wait_finished(worker, req_id)

    save([0, 1], "before")
    monkeypatch.setattr(directory.os, "writev", Failing(errno.ENOSPC, os.writev))
    save([2, 3], "full")
    assert core.stats.data["store_errors"] == 1  # the second write skipped
    assert core.stats.data["stored_chunks"] == 2
    assert len(warnings) == 1
    assert "store write failed, skipping saves" in warnings[0]
    assert "No space left on device" in warnings[0]
    assert not core.usable("write")
    assert core.usable()  # reads (lookups, loads, lease releases) go on

    probe = ProbeSpec("found", [4], [[chunk_key(0)]])
    assert worker.before_update_states(StoreMetadata(probes=[probe])) == {
        "found": BLOCK
    }
    lease = new_lease_id()
    assert core.backend.lease([chunk_key(1)], lease, 60) == 1
    load = LoadSpec("hit", lease, [5], [[chunk_key(1)]])
    worker.start_load(StoreMetadata(loads=[load], sync_loads_first=True))
    assert worker.take_load_errors() == set()
    assert list((tmp_path / "store" / "leases").iterdir()) == []  # both released
    assert core.stats.data["store_errors"] == 1 and len(warnings) == 1
    worker.close()


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT], ids=errno.errorcode.get)
def test_full_disk_serves_hits_without_leases_and_never_backs_off_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int
):
    """On a full disk (or quota) no file can be created, a lease's neither:
    the lookup still hits, served without a lease (no save can evict on a
    full disk), and reads are not backed off; a partial release that
    cannot rewrite its lease file leaves it to expire."""
    from test_store_lookup import BLOCK, make, request, store

    core, scheduler = make(tmp_path)
    req = request(4 * BLOCK + 1)
    store(core, req, [0, 1, 2, 3], ranks=(0,))
    real_open = os.open

    def full(path: Any, flags: int, *args: Any) -> int:
        if flags & os.O_CREAT:
            raise OSError(err, os.strerror(err))
        return real_open(path, flags, *args)

    monkeypatch.setattr(directory.os, "open", full)
    offer = scheduler.offer(req, 0)
    assert offer is not None and offer.num_tokens == 4 * BLOCK
    assert core.usable() and core.stats.data.get("store_errors", 0) == 0
    monkeypatch.setattr(directory.os, "open", real_open)
    lease = new_lease_id()
    keys = [k for ks in offer.keys for k in ks]
    assert core.backend.lease(keys, lease, 60) == 4
    monkeypatch.setattr(directory.os, "open", full)
    core.release(lease, keys[2:], count=False)
    assert core.usable() and core.stats.data.get("store_errors", 0) == 0


@pytest.mark.parametrize(
    "err", [errno.EROFS, errno.EACCES, errno.EPERM], ids=errno.errorcode.get
)
def test_read_only_store_is_read_and_never_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int
):
    """A store this process cannot write (a read-only mount: EROFS; a
    directory this user may read but not write: EACCES, or EPERM under a
    security module; root passes mode bits, so the refusal is simulated
    here: test_store_shared_e2e.py mounts one for real) is opened read-only:
    reads work, nothing is written, leased, marked used or deleted; the
    settings check accepts it only if it holds a store."""
    from kvlc_store import config, store_checks

    DirectoryBackend(tmp_path / "store", 10**6).put(KEY, DATA)
    (tmp_path / "empty").mkdir()
    real_open = os.open

    def refuse_writes(path: Any, flags: int, *args: Any) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise OSError(err, os.strerror(err))
        return real_open(path, flags, *args)

    monkeypatch.setattr(directory.os, "open", refuse_writes)
    monkeypatch.setattr(
        store_checks.tempfile, "mkstemp", lambda **k: refuse_writes("", 1)
    )
    assert config.parse_config({"path": str(tmp_path / "store")}).path
    with pytest.raises(ValueError, match="cannot create or write it"):
        config.parse_config({"path": str(tmp_path / "empty")})

    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "store").rglob("*")}
    store = DirectoryBackend(tmp_path / "store", 10**6)
    assert store.read_only
    other = f"ident0/{2:064x}.0"
    assert store.lease([KEY, other], new_lease_id(), 60) == 1
    assert store.get(KEY) == DATA
    target = bytearray(len(DATA) - 10)
    assert list(store.read_into([KEY], 10, [[memoryview(target)]])) == [
        (DATA[:10], len(DATA))
    ]
    assert store.put(other, DATA) is None
    store.delete(KEY)
    store.release([KEY], "lease")
    after = {p: p.stat().st_mtime_ns for p in (tmp_path / "store").rglob("*")}
    assert after == before

"""Prefetch: the stored chunks of requests waiting in the scheduler's queue,
copied into a local buffer before the requests are scheduled.

A request that waits (behind a full batch, or for KV-cache space) would load
its hit from the store in the step that schedules it. The scheduler side
hands every request still waiting after a step to ``Prefetcher``, whose
thread copies the request's stored chunks, in arrival order, into a buffer
directory in shared memory (``/dev/shm`` where there is one) while the
engine runs other steps; the step that schedules the request then reads the
chunks there (``BufferReader``: a copy out of memory) instead of from the
store.

The buffer holds chunks in the store's own format, one file per chunk,
written to a temporary name and renamed, so a worker (another process) reads
and checks one exactly as the directory backend reads a chunk. What a worker
does not find in the buffer, or finds damaged, it reads from the store,
which stays the only thing a hit relies on: the scheduler's lookup leases
chunks in the store as always, and the buffer only saves the transfer. A
worker on another machine (multi-node tensor parallelism) sees no buffer and
reads everything from the store.

The scheduler side owns every file (the workers only read): a file lives
while a request holds it, that is while the request waits, and for two steps
after the step that loads it (the loads of step N are done when step N + 2 is
scheduled, with or without async scheduling); a request that finishes or is
aborted while waiting drops its files at once. The bytes in the buffer never
exceed its budget (``prefetch_buffer``): the thread waits for space, and
fetches nothing for a request whose next block alone is over the budget.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import tempfile
import threading
import uuid
import weakref
from collections import deque
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvlc_store.backends import (
    Backend,
    BackendUnavailable,
    Head,
    logger,
    read_chunk_file,
)
from kvlc_store.chunk import HEADER_BYTES
from kvlc_store.stats import StoreConnectorStats

DIR_PREFIX = "kvlc-prefetch-"
# Steps a loaded request keeps its files: the loads of step N are done when
# step N + 2 is scheduled (one step in flight with async scheduling).
HOLD_STEPS = 2


def chunk_file_name(key: str) -> str:
    """The buffer's file name of chunk ``key`` (``<identity>/<hash>.<rank>``)."""
    return key.replace("/", ".")


class BufferReader:
    """A worker's read side of the prefetch buffer at ``directory``, with the
    store backend's ``read_into`` contract. A chunk that is not there (never
    fetched, already dropped, a buffer on another machine) reads as None."""

    def __init__(self, directory: str) -> None:
        self._dir = Path(directory)

    def read_into(
        self,
        keys: Sequence[str],
        head_bytes: int,
        targets: Sequence[Sequence[memoryview]],
    ) -> Generator[Head | None, None, None]:
        for key, into in zip(keys, targets, strict=True):
            try:
                yield read_chunk_file(
                    self._dir / chunk_file_name(key), head_bytes, into
                )
            except OSError:
                yield None


@dataclass
class _Job:
    """A waiting request's chunks to fetch: per block, one key per rank."""

    keys: list[list[str]]
    next_block: int = 0
    # No more to fetch: its run of stored blocks ended, or it was scheduled.
    done: bool = False
    held: set[str] = field(default_factory=set)


class Prefetcher:
    """The scheduler side's prefetch buffer and the thread that fills it.

    Args:
        backend: a store backend of its own (its own connection), used by
            the thread only.
        budget_bytes: the most chunk bytes the buffer holds at once.
        stats: the scheduler side's counters (``prefetched_bytes``, added
            by ``step``).
        root: where to create the buffer directory; shared memory
            (``/dev/shm``) if writable, else the temporary directory.

    Every method but the thread's own is called from the scheduler's thread.
    """

    def __init__(
        self,
        backend: Backend,
        budget_bytes: int,
        stats: StoreConnectorStats,
        root: Path | None = None,
    ) -> None:
        self._backend = backend
        self._budget = budget_bytes
        self._stats = stats
        self.dir = _new_buffer_dir(root)
        self._removal = weakref.finalize(self, shutil.rmtree, self.dir, True)
        self._cond = threading.Condition()
        self._jobs: dict[str, _Job] = {}  # by request id, in arrival order
        self._holders: dict[str, set[str]] = {}  # chunk key -> request ids
        self._sizes: dict[str, int] = {}  # chunk key -> bytes, ready or reserved
        self._ready: set[str] = set()  # chunk keys whose file is in place
        self._used = 0
        self._fetched_bytes = 0  # for stats, counted by the thread
        self._step = 0
        self._loaded: deque[tuple[int, str]] = deque()  # (step, request id)
        self._stopping = False
        self._thread = threading.Thread(
            target=self._run, name="kvlc-prefetch", daemon=True
        )
        self._thread.start()

    # -- the scheduler's thread --------------------------------------------

    @property
    def used_bytes(self) -> int:
        with self._cond:
            return self._used

    def want(self, req_id: str, keys: list[list[str]]) -> None:
        """Fetch the chunks ``keys`` (per block, one key per rank) of waiting
        request ``req_id``, in order, up to the first block not stored. A
        request already known is left as it is."""
        with self._cond:
            if req_id not in self._jobs and keys:
                self._jobs[req_id] = _Job(keys)
                self._cond.notify_all()

    def take(self, req_id: str, keys: Sequence[Sequence[str]]) -> int:
        """The scheduler plans to load the blocks of ``keys`` (per block, one
        key per rank) for ``req_id`` in this step: stop fetching for it, and
        return how many leading blocks the buffer holds whole. The request
        holds them until ``HOLD_STEPS`` steps after this one."""
        with self._cond:
            job = self._jobs.get(req_id)
            if job is None:
                job = self._jobs[req_id] = _Job([], done=True)
            job.done = True
            ready = 0
            for block in keys:
                if not all(k in self._ready for k in block):
                    break
                for k in block:
                    self._hold(job, req_id, k)
                ready += 1
            # Loaded in the step being scheduled, whose build is step + 1.
            self._loaded.append((self._step + 1, req_id))
            self._cond.notify_all()
            return ready

    def release(self, req_id: str) -> None:
        """``req_id`` left the queue without a load (finished, aborted) or its
        load is done: drop its files no other request holds."""
        with self._cond:
            self._release(req_id)

    def step(self) -> None:
        """Once per scheduled step: drop the files of loads that are done."""
        with self._cond:
            self._step += 1
            while self._loaded and self._loaded[0][0] <= self._step - HOLD_STEPS:
                self._release(self._loaded.popleft()[1])
            fetched, self._fetched_bytes = self._fetched_bytes, 0
        self._stats.inc("prefetched_bytes", fetched)

    def close(self) -> None:
        """Stop the thread and remove the buffer with everything in it."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=10)
        self._backend.close()
        self._removal()

    # -- shared, under the lock ---------------------------------------------

    def _hold(self, job: _Job, req_id: str, key: str) -> None:
        job.held.add(key)
        self._holders.setdefault(key, set()).add(req_id)

    def _release(self, req_id: str) -> None:
        job = self._jobs.pop(req_id, None)
        if job is None:
            return
        job.done = True  # The thread may be fetching for it right now.
        for key in job.held:
            holders = self._holders.get(key)
            if holders is None:
                continue
            holders.discard(req_id)
            if not holders:
                del self._holders[key]
                self._drop(key)
        self._cond.notify_all()

    def _drop(self, key: str) -> None:
        """Remove ``key``'s file, or the reservation of a fetch in flight
        (whose file the thread then discards)."""
        if key in self._ready:
            self._ready.discard(key)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.dir / chunk_file_name(key))
        self._used -= self._sizes.pop(key, 0)

    def _next_block(self) -> tuple[str, _Job, list[str]] | None:
        """The first block to fetch: the next block of the earliest waiting
        request that has one, taking the block's chunks already in the buffer
        for it. None if there is none."""
        for req_id, job in self._jobs.items():
            while not job.done and job.next_block < len(job.keys):
                block = job.keys[job.next_block]
                missing = [k for k in block if k not in self._sizes]
                for k in block:
                    if k not in missing:
                        self._hold(job, req_id, k)
                if missing:
                    return req_id, job, missing
                job.next_block += 1
            job.done = True
        return None

    # -- the thread -----------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                nxt = None if self._stopping else self._next_block()
                while nxt is None and not self._stopping:
                    self._cond.wait()
                    nxt = None if self._stopping else self._next_block()
                if nxt is None:
                    return
                req_id, job, missing = nxt
            try:
                heads = self._backend.peek(missing, HEADER_BYTES)
            except BackendUnavailable:
                heads = [None]
            with self._cond:
                if self._stopping:
                    return
                if any(h is None for h in heads) or job.done:
                    # The stored run ends here (or the request was scheduled
                    # meanwhile): nothing more to fetch for it.
                    job.done = True
                    continue
                sizes = {k: h[1] for k, h in zip(missing, heads, strict=True) if h}
                need = sum(sizes.values())
                if need > self._budget:
                    job.done = True
                    continue
                while (
                    not self._stopping
                    and not job.done
                    and self._used + need > self._budget
                ):
                    self._cond.wait()
                if self._stopping:
                    return
                if job.done:
                    continue  # Scheduled while waiting for space.
                self._sizes.update(sizes)
                self._used += need
                for k in sizes:
                    self._hold(job, req_id, k)
            fetched = self._fetch(sizes)
            with self._cond:
                for key in sizes:
                    path = self.dir / chunk_file_name(key)
                    if key not in self._sizes or key not in fetched:
                        # Dropped while in flight, or the read failed.
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(path)
                        if key not in fetched:
                            self._used -= self._sizes.pop(key, 0)
                            job.done = True
                        continue
                    self._ready.add(key)
                    self._fetched_bytes += sizes[key]
                if not job.done:
                    job.next_block += 1
                self._cond.notify_all()

    def _fetch(self, sizes: dict[str, int]) -> set[str]:
        """Read the chunks into their buffer files; the keys that made it."""
        keys = list(sizes)
        files: list[tuple[str, Path, mmap.mmap]] = []
        try:
            for key in keys:
                tmp = self.dir / f".{uuid.uuid4().hex}.part"
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.ftruncate(fd, sizes[key])
                    files.append((key, tmp, mmap.mmap(fd, sizes[key])))
                finally:
                    os.close(fd)
            views = [memoryview(m) for _, _, m in files]
            try:
                heads = list(
                    self._backend.read_into(
                        keys, HEADER_BYTES, [[v[HEADER_BYTES:]] for v in views]
                    )
                )
                for v, head in zip(views, heads, strict=True):
                    if head is not None and head[1] == v.nbytes:
                        v[:HEADER_BYTES] = head[0]
            finally:
                for v in views:
                    v.release()
            fetched: set[str] = set()
            for (key, tmp, m), head in zip(files, heads, strict=True):
                m.close()
                if head is not None and head[1] == sizes[key]:
                    os.replace(tmp, self.dir / chunk_file_name(key))
                    fetched.add(key)
            return fetched
        except (BackendUnavailable, OSError) as e:
            logger.warning("StoreConnector: prefetch failed, skipped: %s", e)
            return set()
        finally:
            for _, tmp, m in files:
                m.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)


def _new_buffer_dir(root: Path | None) -> Path:
    """A fresh buffer directory under ``root``, after removing those of
    processes that died without removing theirs."""
    if root is None:
        shm = Path("/dev/shm")
        root = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
        root = root or Path(tempfile.gettempdir())
    for stale in root.glob(f"{DIR_PREFIX}*"):
        pid = stale.name[len(DIR_PREFIX) :].partition("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-", dir=root))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

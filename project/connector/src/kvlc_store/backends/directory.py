"""``DirectoryBackend``: chunks as files under a directory."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import stat
import time
import uuid
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from kvlc_store.backends.base import (
    LOW_WATERMARK,
    BackendUnavailable,
    Data,
    Head,
    as_parts,
    logger,
)
from kvlc_store.backends.chunk_files import (
    IOV_MAX,
    FileTrust,
    open_chunk_file,
    read_chunk_file,
)
from kvlc_store.backends.known_chunks import KnownChunks

_T = TypeVar("_T")

# What writing to a read-only store fails with: a read-only mount, or a
# directory this user may read but not write.
READ_ONLY_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
# What a lease write fails with when the store cannot take writes now: a
# read-only store, or a full disk or quota. Its chunks can still be read.
_UNWRITABLE_ERRNOS = READ_ONLY_ERRNOS | {errno.ENOSPC, errno.EDQUOT}


def _unwritable(e: BackendUnavailable) -> OSError | None:
    """The error of a store that cannot take writes now behind ``e``."""
    cause = e.__cause__
    if isinstance(cause, OSError) and cause.errno in _UNWRITABLE_ERRNOS:
        return cause
    return None


# What a store directory holds (with the temporary files its processes
# write beside ``size`` and ``generation``, and probes): a directory holding
# anything else is not made a store (a server pointed at the wrong place
# would fill it).
_STORE_ENTRIES = frozenset(
    {"chunks", "leases", "tmp", "checked", "size", "generation", ".lock"}
)


def is_store_entry(name: str) -> bool:
    """Whether ``name``, in a store's directory, is one of the store's."""
    return name in _STORE_ENTRIES or name.startswith(
        ("size.", "generation.", ".kvlc-probe-")
    )


def is_store(path: Path) -> bool:
    """Whether ``path`` holds a store's layout (a server wrote to it)."""
    return (path / "chunks").is_dir()


def _read_only(root: Path) -> bool:
    """Whether ``root`` (an existing store) cannot be written: probed with a
    temporary file, since mode bits do not tell (root writes through them; a
    read-only mount refuses everyone)."""
    if not is_store(root):
        return False
    probe = root / f".kvlc-probe-{uuid.uuid4().hex}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        return e.errno in READ_ONLY_ERRNOS
    os.close(fd)
    probe.unlink()
    return False


class DirectoryBackend:
    """Chunks as files under a directory, shared by every process that opens
    the same path on one machine (or a shared file system with working
    ``flock``).

    Layout: ``chunks/<identity>/<hh>/<hash>.<rank>`` (``hh`` the hash's first
    two hex digits), ``leases/<lease id>`` (one line per leased key; the
    file's mtime plus the TTL in its first line is its expiry), ``tmp/``
    (writes in progress), ``size`` (total chunk bytes, kept under the lock),
    ``generation`` and ``checked/`` (``known_chunks.py``) and ``.lock`` (held
    while leasing, counting, recording or evicting).

    A write goes to ``tmp/`` and is renamed into place, so a process that
    dies mid-write never leaves a partial chunk under a chunk's name;
    leftovers in ``tmp/`` are removed when a backend opens the directory.
    There is no fsync: after a power loss a renamed chunk may be empty or
    torn, and its checksum makes it a miss; a cache need not survive one.
    LRU order is file mtime (a ``get`` touches the file).

    A lease checks that its chunks exist only for chunks this process has
    not seen stored yet and no process recorded checked: the chunks it wrote
    or found stored are kept in memory until a chunk leaves the store
    (``KnownChunks``). A chunk file removed by hand (not through a backend)
    is then found missing at load, as a load error.

    Every file-system error of an operation (``OSError``: missing directory,
    permission, full disk, I/O error) is ``BackendUnavailable``. If the
    directory or its layout was deleted, the operation recreates the layout
    and tries once more: the store comes back by itself, empty.

    A store that this process cannot write when it opens it (a read-only
    mount, or a directory it may only read: a prebuilt store many servers
    share) is served read-only (``read_only``): chunks are read, nothing is
    written, leased, marked used or deleted (``put`` writes nothing). Its
    chunks are taken to stay put: a writer elsewhere that evicts one while it
    is offered fails that load (see ``kv_load_failure_policy``).
    """

    def __init__(
        self, root: Path, capacity_bytes: int, group_access: bool = False
    ) -> None:
        self.root = root
        self.capacity_bytes = capacity_bytes
        # Private unless shared with the directory's group, whatever the
        # umask: a store others can write serves KV of their choosing.
        self.group_access = group_access
        self._dir_mode = 0o2770 if group_access else 0o700
        self._file_mode = 0o660 if group_access else 0o600
        # A store that turned read-only while serving: leases cannot be
        # written, hits are served without them (see ``lease``).
        self._lease_error: OSError | None = None
        self._chunks = root / "chunks"
        self._chunks_dir = str(self._chunks)
        self._leases = root / "leases"
        self._tmp = root / "tmp"
        self._lock_path = root / ".lock"
        self._size_path = root / "size"
        self.read_only = _read_only(root)
        if not self.read_only:
            self._mkdirs(root)
        st = root.stat()
        self.owner_uid = st.st_uid
        self._trust = FileTrust(st, self.read_only, group_access)
        self._trusted = self._trust.trusted
        self._memory = KnownChunks(root, self._create, self._trust)
        if not self.read_only:
            self._make_layout()
            self._clean_tmp()
            self._memory.remove_records(keep_this_boot=True)

    def _make_layout(self) -> None:
        fresh = not self._chunks.is_dir()
        for d in (self._chunks, self._leases, self._tmp, self._memory.record_dir):
            self._mkdirs(d)
        if not self._lock_path.exists():
            os.close(self._create(self._lock_path, os.O_WRONLY | os.O_CREAT))
        # Counted anew at every start: chunk files removed by hand leave
        # ``size`` counting them (a stat per chunk file, once).
        with self._locked():
            self._write_size(self._scan_size())
        if fresh or self._memory.generation() is None:
            # Chunks gone with a deleted layout are not known to anyone.
            with self._locked():
                self._memory.new_generation()

    def _mkdirs(self, path: Path) -> None:
        """Create ``path`` and its missing parents with the store's mode."""
        missing: list[Path] = []
        while not path.is_dir():
            missing.append(path)
            path = path.parent
        for d in reversed(missing):
            with contextlib.suppress(FileExistsError):
                d.mkdir()
                os.chmod(d, self._dir_mode)  # mkdir's mode is cut by the umask

    def _create(self, path: Path, flags: int) -> int:
        """Open a new file of the store, with the store's mode."""
        fd = os.open(path, flags, self._file_mode)
        if self.group_access:
            os.fchmod(fd, self._file_mode)  # os.open's mode is cut by the umask
        return fd

    def _write_file(self, path: Path, text: str) -> None:
        fd = self._create(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with os.fdopen(fd, "w") as f:
            f.write(text)

    def _io(self, op: Callable[[], _T]) -> _T:
        """Run one store operation, with file-system errors as
        ``BackendUnavailable``."""
        try:
            return op()
        except FileNotFoundError:
            pass  # Part of the layout is gone: recreate it below.
        except OSError as e:
            raise BackendUnavailable(f"store directory {self.root}: {e}") from e
        if self.read_only:
            raise BackendUnavailable(f"store directory {self.root} is missing")
        try:
            self._make_layout()
            logger.warning(
                "StoreConnector: store directory %s was missing (deleted?); "
                "recreated it empty",
                self.root,
            )
            return op()
        except OSError as e:
            raise BackendUnavailable(f"store directory {self.root}: {e}") from e

    # -- paths ------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return Path(self._file(key))

    def _file(self, key: str) -> str:
        """``key``'s chunk file. A string: a lookup of a long prompt builds
        one per block, and four ``Path`` joins cost more than its stat."""
        identity, _, name = key.partition("/")
        if not identity or not name or "/" in name or name.startswith("."):
            raise ValueError(f"malformed chunk key {key!r}")
        return f"{self._chunks_dir}/{identity}/{name[:2]}/{name}"

    def _iter_chunk_files(self) -> Iterator[Path]:
        for dirpath, _, filenames in os.walk(self._chunks):
            for name in filenames:
                yield Path(dirpath) / name

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self._lock_path, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _clean_tmp(self) -> None:
        # Only files older than a minute: another live process may be writing.
        cutoff = time.time() - 60
        for p in self._tmp.iterdir():
            with contextlib.suppress(FileNotFoundError):
                if p.stat().st_mtime < cutoff:
                    p.unlink()

    # -- chunks -----------------------------------------------------------

    def put(self, key: str, data: Data) -> int | None:
        if self.read_only:
            return None
        return self._io(lambda: self._put(key, as_parts(data)))

    def _put(self, key: str, parts: list[memoryview]) -> int | None:
        path = self._path(key)
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):
                return None
            # Not a chunk (a link, a FIFO): replaced by the one written now.
        except FileNotFoundError:
            pass
        self._mkdirs(path.parent)
        tmp = self._tmp / f"{uuid.uuid4().hex}.part"
        fd = self._create(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        size = sum(p.nbytes for p in parts)
        try:
            # Straight from the caller's buffers (the KV cache), no join.
            left = [p for p in parts if p.nbytes]
            while left:
                n = os.writev(fd, left[:IOV_MAX])
                while left and n >= left[0].nbytes:
                    n -= left[0].nbytes
                    left.pop(0)
                if n:
                    left[0] = left[0][n:]
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, path)
        with self._locked():
            # A save needs no record: the lookups read it.
            if self._memory.current(learn=False):
                self._memory.stored.add(key)
            total = self._read_size() + size
            if total <= self.capacity_bytes:
                self._write_size(total)
                return 0
            return self._evict()

    def get(self, key: str) -> bytes | None:
        return self._io(lambda: self._get(key))

    def _get(self, key: str) -> bytes | None:
        path = self._file(key)
        opened = open_chunk_file(path, self._trusted)
        if opened is None:
            return None
        fd, st = opened
        try:
            data = os.pread(fd, st.st_size, 0)
        finally:
            os.close(fd)
        self._used(path)
        return data

    def _used(self, path: str | Path) -> None:
        """Mark a chunk just read as used (LRU order is mtime)."""
        if not self.read_only:
            try:
                # The link itself if the chunk was replaced by one since.
                os.utime(path, follow_symlinks=False)
            except FileNotFoundError:
                pass
            except OSError as e:
                # A store turned read-only still serves what it holds.
                if e.errno not in READ_ONLY_ERRNOS:
                    raise

    def peek(self, keys: Sequence[str], n: int) -> list[Head | None]:
        return self._io(lambda: [self._peek(key, n) for key in keys])

    def _peek(self, key: str, n: int) -> Head | None:
        path = self._file(key)
        opened = open_chunk_file(path, self._trusted)
        if opened is None:
            return None
        fd, st = opened
        try:
            return os.pread(fd, n, 0), st.st_size
        finally:
            os.close(fd)

    def read_into(
        self,
        keys: Sequence[str],
        head_bytes: int,
        targets: Sequence[Sequence[memoryview]],
    ) -> Generator[Head | None, None, None]:
        for key, into in zip(keys, targets, strict=True):
            yield self._io(functools.partial(self._read_into, key, head_bytes, into))

    def _read_into(
        self, key: str, head_bytes: int, into: Sequence[memoryview]
    ) -> Head | None:
        path = self._file(key)
        head = read_chunk_file(path, head_bytes, into, self._trusted)
        if head is not None:
            self._used(path)
        return head

    def delete(self, key: str) -> None:
        if not self.read_only:
            self._io(lambda: self._delete(key))

    def _delete(self, key: str) -> None:
        path = self._path(key)
        with self._locked():
            try:
                size = path.lstat().st_size
                path.unlink()
            except FileNotFoundError:
                return
            self._memory.new_generation()
            self._write_size(max(0, self._read_size() - size))

    def forget(self, keys: Sequence[str]) -> None:
        if not self.read_only and keys:
            self._io(lambda: self._forget(keys))

    def _forget(self, keys: Sequence[str]) -> None:
        with self._locked():
            for key in keys:
                path = self._file(key)
                try:
                    if self._trusted(path, os.lstat(path)):
                        continue  # written again since
                except FileNotFoundError:
                    pass
                # Gone (or not a chunk this store wrote): no process may
                # offer it again, and ``size`` counted it.
                self._memory.new_generation()
                self._write_size(self._scan_size())
                return

    def num_bytes(self) -> int:
        return self._io(lambda: self._num_bytes())

    def _num_bytes(self) -> int:
        return self._scan_size()

    # The running total of chunk bytes, shared by every process (a file
    # updated under the lock; eviction rescans and rewrites it).

    def _read_size(self) -> int:
        try:
            return int(self._size_path.read_text() or 0)
        except (FileNotFoundError, ValueError):
            return self._scan_size()

    def _write_size(self, total: int) -> None:
        tmp = self._size_path.with_suffix(f".{os.getpid()}")
        self._write_file(tmp, str(total))
        os.replace(tmp, self._size_path)

    def _scan_size(self) -> int:
        total = 0
        for p in self._iter_chunk_files():
            with contextlib.suppress(FileNotFoundError):
                total += p.lstat().st_size
        return total

    # -- leases -----------------------------------------------------------

    def lease(self, keys: Sequence[str], lease_id: str, ttl_s: float) -> int:
        if self.read_only:
            return self._io(lambda: self._stored_run(keys))
        try:
            n = self._io(lambda: self._lease(keys, lease_id, ttl_s))
        except BackendUnavailable as e:
            error = _unwritable(e)
            if error is None:
                raise
            # The store turned read-only (remounted, its mode changed) or
            # its disk is full: no one can evict its chunks through it (a
            # full disk takes no saves), so they are served without a lease
            # rather than lost as misses.
            if self._lease_error is None:
                logger.warning(
                    "StoreConnector: lease write to store directory %s failed "
                    "(%s): the store cannot be written now; serving its chunks "
                    "without leases, saves fail until it can",
                    self.root,
                    error,
                )
            self._lease_error = error
            return self._io(lambda: self._stored_run(keys))
        if self._lease_error is not None:
            self._lease_error = None
            logger.info(
                "StoreConnector: lease writes to store directory %s work again",
                self.root,
            )
        return n

    @property
    def writable(self) -> bool:
        """Whether the store took writes when last tried (False: read-only
        at start, or a lease write failed since)."""
        return not self.read_only and self._lease_error is None

    def _stored_run(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are stored: those known
        (``KnownChunks.stored``) without a look at the file system. Under
        the lock, unless read-only (whose chunks are taken to stay put)."""
        known = self._memory.stored if self._memory.current() else set()
        if known.issuperset(keys):
            return len(keys)
        n = 0
        for key in keys:
            if key in known:
                n += 1
                continue
            # A chunk this store wrote only: a link or a FIFO under a chunk's
            # name, or a file of another user, is not (refused, with a line).
            path = self._file(key)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                break
            if not self._trusted(path, st):
                break
            known.add(key)
            n += 1
        return n

    # -- checked headers ---------------------------------------------------

    def checked(self) -> Mapping[str, str]:
        """Chunk keys whose headers a server checked or wrote, with the KV
        layout each names (``known_chunks.py``), as of the last ``lease``:
        all stored, whole and good while no chunk left the store since."""
        return self._memory.checked

    def vouch(self, headers: Mapping[str, str]) -> None:
        """Record the chunks of ``headers`` (key -> KV layout), stored and
        checked (read by a lookup, or written by this server), for every
        process of the store. Best effort: a record not written costs a
        later first lookup its header reads."""
        if self.read_only or not headers:
            return
        try:
            with self._locked():
                self._memory.vouch(headers)
        except OSError as e:
            logger.debug("StoreConnector: record of checked chunks not written: %s", e)

    def _lease(self, keys: Sequence[str], lease_id: str, ttl_s: float) -> int:
        with self._locked():
            n = self._stored_run(keys)
            if n:
                body = f"{ttl_s}\n" + "\n".join(keys[:n]) + "\n"
                self._write_file(self._leases / lease_id, body)
            return n

    def release(self, keys: Sequence[str], lease_id: str) -> None:
        if self.read_only:
            return
        try:
            self._io(lambda: self._release(keys, lease_id))
        except BackendUnavailable as e:
            # A part of a lease released on a full disk: the rest of it
            # protects its chunks until the lease expires, and no save can
            # evict meanwhile.
            if _unwritable(e) is None:
                raise

    def _release(self, keys: Sequence[str], lease_id: str) -> None:
        path = self._leases / lease_id
        with self._locked():
            try:
                text = path.read_text()
            except FileNotFoundError:
                return
            ttl, _, body = text.partition("\n")
            # The whole lease (a load's release, TP 1): one comparison of
            # the text instead of a set of 2,048 keys.
            if body == "\n".join(keys) + "\n":
                path.unlink(missing_ok=True)
                return
            held = body.splitlines()
            drop = set(keys)
            left = [] if drop.issuperset(held) else [k for k in held if k not in drop]
            if left:
                self._write_file(path, ttl + "\n" + "\n".join(left) + "\n")
            else:
                path.unlink(missing_ok=True)

    def _protected_keys(self, now: float) -> set[str]:
        """Keys under an unexpired lease; expired lease files are removed."""
        protected: set[str] = set()
        for path in self._leases.iterdir():
            try:
                mtime = path.stat().st_mtime
                lines = path.read_text().splitlines()
            except FileNotFoundError:
                continue
            try:
                ttl = float(lines[0])
            except (IndexError, ValueError):
                ttl = 0.0
            if mtime + ttl < now:
                path.unlink(missing_ok=True)
                continue
            protected.update(k for k in lines[1:] if k)
        return protected

    def _evict(self) -> int:
        """Evict down to the low watermark; the caller holds the lock."""
        entries: list[tuple[float, int, Path]] = []
        for p in self._iter_chunk_files():
            try:
                st = p.lstat()
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in entries)
        evicted = 0
        if total > self.capacity_bytes:
            target = int(self.capacity_bytes * LOW_WATERMARK)
            protected = self._protected_keys(time.time())
            for _, size, p in sorted(entries):
                if total <= target:
                    break
                rel = p.relative_to(self._chunks)
                key = f"{rel.parts[0]}/{rel.parts[-1]}"
                if key in protected:
                    continue
                p.unlink(missing_ok=True)
                total -= size
                evicted += 1
        if evicted:
            self._memory.new_generation()
        self._write_size(total)
        return evicted

    def close(self) -> None:
        return

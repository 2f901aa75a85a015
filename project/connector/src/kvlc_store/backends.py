"""Where chunks live: one small interface, two implementations.

Keys are ``<identity>/<block hash hex>.<rank>`` strings made by the
connector; values are encoded chunks (see ``chunk.py``), opaque here.

Every backend is shared by several processes (the scheduler and the workers
of one server, and any number of servers pointed at the same store), so all
state that matters lives in the store itself:

* a size cap with LRU eviction: ``get`` counts as a use, ``put`` evicts the
  least recently used chunks that no open lease protects until the store is
  below ``LOW_WATERMARK`` of its cap;
* leases: ``lease`` takes, in one atomic step, a lease on the longest leading
  run of the given keys that exist, so eviction cannot remove them until
  ``release``; a lease expires on its own after its TTL (a server that died
  holding it cannot pin chunks forever).

A store that cannot be reached, or fails (a full disk, an I/O error, a
directory deleted or made read-only), raises ``BackendUnavailable`` and never
anything else; callers treat it as a miss (lookups, loads) or a skipped save.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import time
import uuid
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar

# A value to store: one bytes-like object, or parts to store concatenated.
Data = bytes | memoryview | Sequence[bytes | memoryview]
# What a read found of one key: its first bytes and its stored length.
Head = tuple[bytes, int]

LOW_WATERMARK = 0.9
# Buffers per writev/preadv call (Linux's IOV_MAX is 1024).
_IOV_MAX = 512

# Under vLLM's logger when the connector runs in a server (see connector.py).
logger = logging.getLogger(f"vllm.{__name__}")

_T = TypeVar("_T")


class BackendUnavailable(Exception):
    """The store cannot be reached right now."""


class Backend(Protocol):
    """The storage interface the connector uses."""

    def put(self, key: str, data: Data) -> int:
        """Store ``data`` (or its parts, concatenated) under ``key``
        (atomically: a reader sees all or nothing) unless the key is already
        stored; return the number of chunks evicted to stay under the cap."""
        ...

    def get(self, key: str) -> bytes | None:
        """The stored bytes of ``key`` (a use, for LRU), or None."""
        ...

    def peek(self, keys: Sequence[str], n: int) -> list[Head | None]:
        """For each key, its first ``n`` bytes and its stored length, or
        None if not stored. Not a use: a lookup checks headers with it."""
        ...

    def read_into(
        self,
        keys: Sequence[str],
        head_bytes: int,
        targets: Sequence[Sequence[memoryview]],
    ) -> Generator[Head | None, None, None]:
        """Read each key (a use): yield its first ``head_bytes`` bytes and
        its stored length, with the rest of its value written into its
        ``targets`` in order when the value is exactly ``head_bytes`` plus
        their size (else the targets are left alone), or None if not stored.

        Yields in key order as each key is done; a backend may fetch later
        keys meanwhile, so the caller's work on one key overlaps the fetch of
        the next ones."""
        ...

    def delete(self, key: str) -> None:
        """Remove ``key`` if stored (a corrupt chunk, found by a reader)."""
        ...

    def lease(self, keys: Sequence[str], lease_id: str, ttl_s: float) -> int:
        """Lease the longest leading run of ``keys`` that are stored; return
        its length. Leased keys are not evicted until released or expired."""
        ...

    def release(self, keys: Sequence[str], lease_id: str) -> None:
        """Drop the lease ``lease_id`` on ``keys`` (unknown ones are ignored)."""
        ...

    def num_bytes(self) -> int:
        """The store's current size in bytes (chunks only)."""
        ...

    def close(self) -> None: ...


def new_lease_id() -> str:
    return uuid.uuid4().hex


def _parts(data: Data) -> list[memoryview]:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return [memoryview(data).cast("B")]
    return [memoryview(p).cast("B") for p in data]


def read_chunk_file(
    path: Path, head_bytes: int, into: Sequence[memoryview]
) -> Head | None:
    """Read the chunk file at ``path``: its first ``head_bytes`` bytes, and
    the rest straight into ``into`` when the lengths match (``read_into``'s
    contract). None if there is no such file; other ``OSError`` as raised.

    Chunk files are written to a temporary name and renamed into place,
    never rewritten, so a short read is a file system failing.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, head_bytes, 0)
        if size == head_bytes + sum(t.nbytes for t in into):
            offset = head_bytes
            for i in range(0, len(into), _IOV_MAX):
                batch = into[i : i + _IOV_MAX]
                n = os.preadv(fd, batch, offset)
                if n != sum(t.nbytes for t in batch):
                    raise OSError(f"short read of {path} ({n} bytes)")
                offset += n
    finally:
        os.close(fd)
    return head, size


class DirectoryBackend:
    """Chunks as files under a directory, shared by every process that opens
    the same path on one machine (or a shared file system with working
    ``flock``).

    Layout: ``chunks/<identity>/<hh>/<hash>.<rank>`` (``hh`` the hash's first
    two hex digits), ``leases/<lease id>`` (one line per leased key; the
    file's mtime plus the TTL in its first line is its expiry), ``tmp/``
    (writes in progress), ``size`` (total chunk bytes, kept under the lock)
    and ``.lock`` (held while leasing, counting or evicting).

    A write goes to ``tmp/`` and is renamed into place, so a process that
    dies mid-write never leaves a partial chunk under a chunk's name;
    leftovers in ``tmp/`` are removed when a backend opens the directory.
    There is no fsync: after a power loss a renamed chunk may be empty or
    torn, and its checksum makes it a miss; a cache need not survive one.
    LRU order is file mtime (a ``get`` touches the file).

    Every file-system error of an operation (``OSError``: missing directory,
    permission, full disk, I/O error) is ``BackendUnavailable``. If the
    directory or its layout was deleted, the operation recreates the layout
    and tries once more: the store comes back by itself, empty.
    """

    def __init__(self, root: Path, capacity_bytes: int) -> None:
        self.root = root
        self.capacity_bytes = capacity_bytes
        self._chunks = root / "chunks"
        self._leases = root / "leases"
        self._tmp = root / "tmp"
        self._lock_path = root / ".lock"
        self._size_path = root / "size"
        self._make_layout()
        self._clean_tmp()

    def _make_layout(self) -> None:
        for d in (self._chunks, self._leases, self._tmp):
            d.mkdir(parents=True, exist_ok=True)
        self._lock_path.touch(exist_ok=True)
        if not self._size_path.exists():
            with self._locked():
                self._write_size(self._scan_size())

    def _io(self, op: Callable[[], _T]) -> _T:
        """Run one store operation, with file-system errors as
        ``BackendUnavailable``."""
        try:
            return op()
        except FileNotFoundError:
            pass  # Part of the layout is gone: recreate it below.
        except OSError as e:
            raise BackendUnavailable(f"store directory {self.root}: {e}") from e
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
        identity, _, name = key.partition("/")
        if not identity or not name or "/" in name or name.startswith("."):
            raise ValueError(f"malformed chunk key {key!r}")
        return self._chunks / identity / name[:2] / name

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

    def put(self, key: str, data: Data) -> int:
        return self._io(lambda: self._put(key, _parts(data)))

    def _put(self, key: str, parts: list[memoryview]) -> int:
        path = self._path(key)
        if path.exists():
            return 0
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._tmp / f"{uuid.uuid4().hex}.part"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        size = sum(p.nbytes for p in parts)
        try:
            # Straight from the caller's buffers (the KV cache), no join.
            left = [p for p in parts if p.nbytes]
            while left:
                n = os.writev(fd, left[:_IOV_MAX])
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
            total = self._read_size() + size
            if total <= self.capacity_bytes:
                self._write_size(total)
                return 0
            return self._evict()

    def get(self, key: str) -> bytes | None:
        return self._io(lambda: self._get(key))

    def _get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)
        return data

    def peek(self, keys: Sequence[str], n: int) -> list[Head | None]:
        return self._io(lambda: [self._peek(key, n) for key in keys])

    def _peek(self, key: str, n: int) -> Head | None:
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            return os.pread(fd, n, 0), os.fstat(fd).st_size
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
        path = self._path(key)
        head = read_chunk_file(path, head_bytes, into)
        if head is not None:
            with contextlib.suppress(FileNotFoundError):
                os.utime(path)
        return head

    def delete(self, key: str) -> None:
        return self._io(lambda: self._delete(key))

    def _delete(self, key: str) -> None:
        path = self._path(key)
        with self._locked():
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                return
            self._write_size(max(0, self._read_size() - size))

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
        tmp.write_text(str(total))
        os.replace(tmp, self._size_path)

    def _scan_size(self) -> int:
        total = 0
        for p in self._iter_chunk_files():
            with contextlib.suppress(FileNotFoundError):
                total += p.stat().st_size
        return total

    # -- leases -----------------------------------------------------------

    def lease(self, keys: Sequence[str], lease_id: str, ttl_s: float) -> int:
        return self._io(lambda: self._lease(keys, lease_id, ttl_s))

    def _lease(self, keys: Sequence[str], lease_id: str, ttl_s: float) -> int:
        with self._locked():
            n = 0
            for key in keys:
                if not self._path(key).exists():
                    break
                n += 1
            if n:
                body = f"{ttl_s}\n" + "\n".join(keys[:n]) + "\n"
                (self._leases / lease_id).write_text(body)
            return n

    def release(self, keys: Sequence[str], lease_id: str) -> None:
        return self._io(lambda: self._release(keys, lease_id))

    def _release(self, keys: Sequence[str], lease_id: str) -> None:
        path = self._leases / lease_id
        with self._locked():
            try:
                lines = path.read_text().splitlines()
            except FileNotFoundError:
                return
            ttl, held = lines[0], [k for k in lines[1:] if k]
            drop = set(keys)
            left = [k for k in held if k not in drop]
            if left:
                path.write_text(ttl + "\n" + "\n".join(left) + "\n")
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
                st = p.stat()
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
        self._write_size(total)
        return evicted

    def close(self) -> None:
        return


# Lua scripts: each runs atomically on the server, with the server's clock.
_LUA_PUT = """
local ns = KEYS[1]
local key = ARGV[1]
local ck = ns .. ':c:' .. key
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
if redis.call('EXISTS', ck) == 1 then
  return 0
end
redis.call('SET', ck, ARGV[2])
redis.call('ZADD', ns .. ':lru', now, key)
local total = redis.call('INCRBY', ns .. ':bytes', string.len(ARGV[2]))
local cap = tonumber(ARGV[3])
local evicted = 0
if total > cap then
  local target = math.floor(cap * tonumber(ARGV[4]))
  local cursor = 0
  while total > target do
    local batch = redis.call('ZRANGE', ns .. ':lru', cursor, cursor + 63)
    if #batch == 0 then break end
    for _, k in ipairs(batch) do
      if total <= target then break end
      local lk = ns .. ':l:' .. k
      if redis.call('ZCOUNT', lk, now, '+inf') > 0 then
        cursor = cursor + 1
      else
        local kk = ns .. ':c:' .. k
        total = total - redis.call('STRLEN', kk)
        redis.call('DEL', kk, lk)
        redis.call('ZREM', ns .. ':lru', k)
        evicted = evicted + 1
      end
    end
  end
  redis.call('SET', ns .. ':bytes', total)
end
return evicted
"""

_LUA_GET = """
local ns = KEYS[1]
local key = ARGV[1]
local v = redis.call('GET', ns .. ':c:' .. key)
if v then
  local t = redis.call('TIME')
  redis.call('ZADD', ns .. ':lru', t[1] * 1000 + math.floor(t[2] / 1000), key)
end
return v
"""

# Marks chunks just read as used (LRU), on the server's clock; sent with the
# GETs of a read, in the same round trip.
_LUA_TOUCH = """
local ns = KEYS[1]
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
for i = 1, #ARGV do
  redis.call('ZADD', ns .. ':lru', 'XX', now, ARGV[i])
end
return 0
"""

_LUA_DELETE = """
local ns = KEYS[1]
local ck = ns .. ':c:' .. ARGV[1]
local n = redis.call('STRLEN', ck)
if redis.call('DEL', ck) == 1 then
  redis.call('DECRBY', ns .. ':bytes', n)
end
redis.call('ZREM', ns .. ':lru', ARGV[1])
return 0
"""

_LUA_LEASE = """
local ns = KEYS[1]
local lease_id = ARGV[1]
local ttl_ms = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local n = 0
for i = 3, #ARGV do
  local key = ARGV[i]
  if redis.call('EXISTS', ns .. ':c:' .. key) == 0 then break end
  local lk = ns .. ':l:' .. key
  redis.call('ZREMRANGEBYSCORE', lk, '-inf', now - 1)
  redis.call('ZADD', lk, now + ttl_ms, lease_id)
  if redis.call('PTTL', lk) < ttl_ms then redis.call('PEXPIRE', lk, ttl_ms) end
  n = n + 1
end
return n
"""

_LUA_RELEASE = """
local ns = KEYS[1]
for i = 2, #ARGV do
  redis.call('ZREM', ns .. ':l:' .. ARGV[i], ARGV[1])
end
return 0
"""


class RedisBackend:
    """Chunks in a Redis server, shared by every process that uses the same
    URL and namespace.

    Keys: ``<ns>:c:<key>`` (the chunk), ``<ns>:lru`` (sorted set, last use in
    server milliseconds), ``<ns>:bytes`` (total chunk bytes), ``<ns>:l:<key>``
    (sorted set of lease ids scored by their expiry). Every operation that
    reads and writes more than one of them is one Lua script, so it is atomic
    against other clients. Do not combine with a Redis ``maxmemory`` eviction
    policy: that would evict leased chunks.

    Reads take no script for the values: ``peek`` is one pipeline of
    ``GETRANGE``/``STRLEN`` for all keys, ``read_into`` pipelines ``GET``s
    of ``READ_BATCH`` chunks (and one script that marks them used) per round
    trip, and fetches the next batch on a thread while the caller works on
    the current one. The client parses replies with ``hiredis`` when it is
    installed (the ``redis`` extra installs it).
    """

    READ_BATCH = 4

    def __init__(
        self,
        url: str,
        namespace: str,
        capacity_bytes: int,
        timeout_s: float = 2.0,
    ) -> None:
        import redis

        self._redis_mod = redis
        self.namespace = namespace
        self.capacity_bytes = capacity_bytes
        self._client: Any = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._put = self._client.register_script(_LUA_PUT)
        self._get = self._client.register_script(_LUA_GET)
        self._delete = self._client.register_script(_LUA_DELETE)
        self._lease = self._client.register_script(_LUA_LEASE)
        self._release = self._client.register_script(_LUA_RELEASE)
        self._prefetch: ThreadPoolExecutor | None = None

    def ping(self) -> None:
        self._call(self._client.ping)

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (
            self._redis_mod.exceptions.ConnectionError,
            self._redis_mod.exceptions.TimeoutError,
        ) as e:
            raise BackendUnavailable(f"redis: {e}") from e

    def put(self, key: str, data: Data) -> int:
        parts = _parts(data)
        value = parts[0] if len(parts) == 1 else b"".join(parts)
        return int(
            self._call(
                self._put,
                keys=[self.namespace],
                args=[key, value, self.capacity_bytes, LOW_WATERMARK],
            )
        )

    def peek(self, keys: Sequence[str], n: int) -> list[Head | None]:
        if not keys:
            return []
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            ck = f"{self.namespace}:c:{key}"
            pipe.getrange(ck, 0, n - 1)
            pipe.strlen(ck)
        replies = self._call(pipe.execute)
        heads: list[Head | None] = []
        for i in range(len(keys)):
            head, size = replies[2 * i], int(replies[2 * i + 1])
            heads.append((bytes(head), size) if size else None)
        return heads

    def _fetch(self, keys: Sequence[str]) -> list[bytes | None]:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.get(f"{self.namespace}:c:{key}")
        pipe.eval(_LUA_TOUCH, 1, self.namespace, *keys)
        replies = self._call(pipe.execute)
        return list(replies[: len(keys)])

    def read_into(
        self,
        keys: Sequence[str],
        head_bytes: int,
        targets: Sequence[Sequence[memoryview]],
    ) -> Generator[Head | None, None, None]:
        if len(keys) != len(targets):
            raise ValueError("read_into: one list of targets per key")
        batches = [
            (i, keys[i : i + self.READ_BATCH])
            for i in range(0, len(keys), self.READ_BATCH)
        ]
        if not batches:
            return
        if self._prefetch is None:
            self._prefetch = ThreadPoolExecutor(1, thread_name_prefix="kvlc-redis")
        future = self._prefetch.submit(self._fetch, batches[0][1])
        for b, (start, _) in enumerate(batches):
            values = future.result()
            if b + 1 < len(batches):
                future = self._prefetch.submit(self._fetch, batches[b + 1][1])
            for j, value in enumerate(values):
                if value is None:
                    yield None
                    continue
                view = memoryview(value)
                into = targets[start + j]
                if len(view) == head_bytes + sum(t.nbytes for t in into):
                    offset = head_bytes
                    for t in into:
                        t[:] = view[offset : offset + t.nbytes]
                        offset += t.nbytes
                yield bytes(view[:head_bytes]), len(view)

    def get(self, key: str) -> bytes | None:
        value = self._call(self._get, keys=[self.namespace], args=[key])
        return None if value is None else bytes(value)

    def delete(self, key: str) -> None:
        self._call(self._delete, keys=[self.namespace], args=[key])

    def lease(self, keys: Sequence[str], lease_id: str, ttl_s: float) -> int:
        if not keys:
            return 0
        ttl_ms = max(1, int(ttl_s * 1000))
        return int(
            self._call(
                self._lease, keys=[self.namespace], args=[lease_id, ttl_ms, *keys]
            )
        )

    def release(self, keys: Sequence[str], lease_id: str) -> None:
        if keys:
            self._call(self._release, keys=[self.namespace], args=[lease_id, *keys])

    def num_bytes(self) -> int:
        value = self._call(self._client.get, f"{self.namespace}:bytes")
        return int(value or 0)

    def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.shutdown(wait=True)
        with contextlib.suppress(Exception):
            self._client.close()

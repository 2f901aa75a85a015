"""``RedisBackend``: chunks in a Redis server (needs the ``redis`` extra)."""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvlc_store.backends.base import (
    LOW_WATERMARK,
    BackendUnavailable,
    Data,
    Head,
    as_parts,
)

# Lua scripts: each runs atomically on the server, with the server's clock.
_LUA_PUT = """
local ns = KEYS[1]
local key = ARGV[1]
local ck = ns .. ':c:' .. key
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
if redis.call('EXISTS', ck) == 1 then
  return -1
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


def _describe(e: BaseException) -> str:
    """``e`` as one line: what Redis answered (its error class says which
    kind of refusal when the text does not)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


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
    read_only = False

    def __init__(
        self,
        url: str,
        namespace: str,
        capacity_bytes: int,
        timeout_s: float = 2.0,
        password: str | None = None,
    ) -> None:
        import redis

        self._redis_mod = redis
        self.namespace = namespace
        self.capacity_bytes = capacity_bytes
        # The password comes apart from the URL (config.py: never where vLLM
        # prints its arguments).
        self._client: Any = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            password=password,
        )
        self._put = self._client.register_script(_LUA_PUT)
        self._get = self._client.register_script(_LUA_GET)
        self._delete = self._client.register_script(_LUA_DELETE)
        self._lease = self._client.register_script(_LUA_LEASE)
        self._release = self._client.register_script(_LUA_RELEASE)
        self._prefetch: ThreadPoolExecutor | None = None

    def ping(self) -> None:
        self._call(self._client.ping)

    def refused(self, e: BackendUnavailable) -> bool:
        """Whether ``e`` (from this backend) is Redis answering with a
        refusal (a wrong password, protected mode, a full memory), not
        Redis out of reach (connection refused, a timeout)."""
        exceptions = self._redis_mod.exceptions
        return not isinstance(
            e.__cause__, exceptions.ConnectionError | exceptions.TimeoutError
        ) or isinstance(e.__cause__, exceptions.AuthenticationError)

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # Every error reply is a store fault, not only a lost connection:
        # OOM under maxmemory, NOAUTH, a script refused; and OSError, which
        # the client lets through from some socket calls.
        try:
            return fn(*args, **kwargs)
        except (self._redis_mod.exceptions.RedisError, OSError) as e:
            raise BackendUnavailable(f"redis: {_describe(e)}") from e

    def put(self, key: str, data: Data) -> int | None:
        parts = as_parts(data)
        value = parts[0] if len(parts) == 1 else b"".join(parts)
        evicted = int(
            self._call(
                self._put,
                keys=[self.namespace],
                args=[key, value, self.capacity_bytes, LOW_WATERMARK],
            )
        )
        return None if evicted < 0 else evicted

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
        # Marking chunks used is best effort: a Redis that refuses writes
        # (full memory) still serves what it holds.
        replies = self._call(pipe.execute, raise_on_error=False)
        values = list(replies[: len(keys)])
        for value in values:
            if isinstance(value, Exception):
                raise BackendUnavailable(f"redis: {_describe(value)}") from value
        return values

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

    def forget(self, keys: Sequence[str]) -> None:
        return  # every lease asks Redis

    def checked(self) -> Mapping[str, str]:
        return {}

    def vouch(self, headers: Mapping[str, str]) -> None:
        return

    def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.shutdown(wait=True)
        with contextlib.suppress(Exception):
            self._client.close()

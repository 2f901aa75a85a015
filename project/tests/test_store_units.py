"""StoreConnector's store without an engine: chunk integrity, both backends
(LRU cap, leases, atomic writes), config validation and stats.

Needs the ``kvlc-store-connector`` package (``project/connector``) and
Debian's ``redis-server`` for the Redis cases.
"""

from __future__ import annotations

import json
import os
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvlc_store.backends import (
    Backend,
    BackendUnavailable,
    DirectoryBackend,
    RedisBackend,
    new_lease_id,
)
from kvlc_store.chunk import (
    HEADER_BYTES,
    ChunkError,
    check_header,
    decode_chunk,
    encode_chunk,
)
from kvlc_store import backends
from kvlc_store.config import STARTUP_PING_TIMEOUT_S, parse_config, parse_size
from redis_server import RedisServer, free_port, running_redis

IDENT = "ident0"


def key(i: int) -> str:
    return f"{IDENT}/{i:064x}.0"


# ---------------------------------------------------------------- chunks


def test_chunk_round_trip():
    payload = os.urandom(1000)
    data = encode_chunk(IDENT, key(1), payload)
    assert bytes(decode_chunk(data, IDENT, key(1))) == payload


@pytest.mark.parametrize(
    "mangle, reason",
    [
        (lambda d: d[:-1], "truncated payload"),
        (lambda d: d[:20], "truncated header"),
        (lambda d: d[:-10] + bytes(10), "checksum mismatch"),
        (lambda d: b"XXXXXXXX" + d[8:], "bad magic"),
        (lambda d: b"", "bad magic"),
    ],
)
def test_chunk_damage_is_detected(mangle, reason):
    data = encode_chunk(IDENT, key(1), os.urandom(1000))
    with pytest.raises(ChunkError, match=reason):
        decode_chunk(mangle(data), IDENT, key(1))


def test_chunk_of_another_identity_or_key_is_refused():
    data = encode_chunk("other-model", key(1), b"x" * 10)
    with pytest.raises(ChunkError, match="foreign chunk"):
        decode_chunk(data, IDENT, key(1))
    data = encode_chunk(IDENT, key(2), b"x" * 10)
    with pytest.raises(ChunkError, match="expected"):
        decode_chunk(data, IDENT, key(1))


def format_2_chunk(identity: str, chunk_key: str, payload: bytes) -> bytes:
    """A chunk as the connector wrote it before format 3 (length-prefixed
    JSON header, CRC-32)."""
    header = json.dumps(
        {
            "version": 2,
            "identity": identity,
            "key": chunk_key,
            "payload_bytes": len(payload),
            "crc32": zlib.crc32(payload),
        },
        sort_keys=True,
    ).encode()
    return b"KVLCCHK1" + struct.pack(">I", len(header)) + header + payload


def test_old_format_chunk_is_refused_at_its_header():
    data = format_2_chunk(IDENT, key(1), os.urandom(1000))
    with pytest.raises(ChunkError, match="old chunk format"):
        check_header(data[:HEADER_BYTES], IDENT, key(1), len(data))


def test_header_check_reads_no_payload():
    data = encode_chunk(IDENT, key(1), os.urandom(1000))
    # A flipped payload byte passes the header check (the load's digest
    # catches it), a shorter chunk does not.
    check_header(data[:HEADER_BYTES], IDENT, key(1), len(data))
    with pytest.raises(ChunkError, match="truncated payload"):
        check_header(data[:HEADER_BYTES], IDENT, key(1), len(data) - 1)


# ---------------------------------------------------------------- backends


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


CAP = 10_000


@pytest.fixture(params=["directory", "redis"])
def make_backend(request, tmp_path: Path):
    """A factory of backends on one fresh store (several = several processes)."""
    made: list[Backend] = []
    namespace = f"t{time.monotonic_ns()}"

    def make(capacity: int = CAP) -> Backend:
        backend: Backend
        if request.param == "directory":
            backend = DirectoryBackend(tmp_path / "store", capacity)
        else:
            server = request.getfixturevalue("redis_server")
            backend = RedisBackend(server.url, namespace, capacity)
        made.append(backend)
        return backend

    yield make
    for b in made:
        b.close()


def test_put_get_delete(make_backend):
    b = make_backend()
    assert b.get(key(1)) is None
    assert b.put(key(1), b"abc") == 0
    assert b.get(key(1)) == b"abc"
    # A second put of a stored key changes nothing.
    assert b.put(key(1), b"zzz") is None  # nothing written
    assert b.get(key(1)) == b"abc"
    b.delete(key(1))
    assert b.get(key(1)) is None
    assert b.num_bytes() == 0


def test_peek_and_read_into(make_backend):
    b = make_backend(10**6)
    values = {i: os.urandom(100) + bytes([i]) * 50 for i in range(1, 7)}
    for i, v in values.items():
        b.put(key(i), [v[:100], memoryview(v)[100:]])  # stored concatenated
    b.put(key(9), b"short")
    keys = [key(i) for i in (1, 2, 8, 3, 4, 5, 6, 9)]  # 8: not stored
    heads = b.peek(keys, 100)
    assert heads[2] is None
    assert heads[0] == (values[1][:100], 150)
    assert heads[-1] == (b"short", 5)
    targets = [[bytearray(20), bytearray(30)] for _ in keys]
    views = [[memoryview(t) for t in ts] for ts in targets]
    got = list(b.read_into(keys, 100, views))
    assert got == heads
    for k, ts in zip((1, 2, None, 3, 4, 5, 6), targets, strict=False):
        if k is None:
            assert ts == [bytearray(20), bytearray(30)]
        else:
            assert bytes(ts[0] + ts[1]) == bytes([k]) * 50
    # A value of another length leaves its targets alone.
    assert targets[-1] == [bytearray(20), bytearray(30)]


def test_lru_eviction_keeps_store_under_cap(make_backend):
    b = make_backend()
    for i in range(5):
        b.put(key(i), bytes(2000))
        time.sleep(0.01)
    b.get(key(0))  # a use: key 0 is now the most recent
    time.sleep(0.01)
    evicted = b.put(key(5), bytes(2000))  # 12000 > cap: evict to <= 9000
    assert evicted == 2
    assert b.num_bytes() <= CAP
    assert b.get(key(0)) is not None
    assert b.get(key(1)) is None and b.get(key(2)) is None
    assert all(b.get(key(i)) is not None for i in (3, 4, 5))


def test_lease_protects_from_eviction_until_released(make_backend):
    b, other = make_backend(), make_backend()
    for i in range(4):
        b.put(key(i), bytes(2000))
        time.sleep(0.01)
    lease = new_lease_id()
    # The leading run of stored keys: 0, 1 (key 9 is not stored).
    assert b.lease([key(0), key(1), key(9), key(2)], lease, ttl_s=60) == 2
    # Another process fills the store: the leased oldest chunks survive.
    for i in range(4, 8):
        other.put(key(i), bytes(2000))
        time.sleep(0.01)
    assert b.get(key(0)) is not None and b.get(key(1)) is not None
    assert other.num_bytes() <= CAP
    b.release([key(0), key(1)], lease)
    time.sleep(0.01)
    for i in range(8, 12):
        other.put(key(i), bytes(2000))
        time.sleep(0.01)
    assert b.get(key(0)) is None and b.get(key(1)) is None


def test_a_lease_released_rank_by_rank_keeps_the_other_ranks(tmp_path: Path):
    """A lease of two TP ranks' chunks, released by each rank's worker:
    the first release leaves the other rank's chunks leased, the second
    removes the lease record."""
    b = DirectoryBackend(tmp_path, 10**6)
    keys = [key(i)[:-1] + str(r) for i in range(3) for r in (0, 1)]
    for k in keys:
        b.put(k, bytes(10))
    lease = new_lease_id()
    assert b.lease(keys, lease, ttl_s=60) == 6
    b.release(keys[0::2], lease)
    assert b._protected_keys(time.time()) == set(keys[1::2])
    b.release(keys[1::2], lease)
    assert not (tmp_path / "leases" / lease).exists()


def test_expired_lease_no_longer_protects(make_backend):
    b = make_backend()
    b.put(key(0), bytes(4000))
    time.sleep(0.01)
    assert b.lease([key(0)], new_lease_id(), ttl_s=0.2) == 1
    time.sleep(0.5)  # the holder "died": never released
    for i in range(1, 4):
        b.put(key(i), bytes(4000))
        time.sleep(0.01)
    assert b.get(key(0)) is None


def test_lease_lasts_its_ttl_in_seconds(make_backend):
    """A lease of ``lease_ttl_s`` seconds still protects its chunk well
    after it was taken (a lookup's lease must outlive the load it plans)."""
    b, other = make_backend(), make_backend()
    b.put(key(0), bytes(4000))
    time.sleep(0.01)
    assert b.lease([key(0)], new_lease_id(), ttl_s=60) == 1
    time.sleep(0.2)
    for i in range(1, 4):
        other.put(key(i), bytes(4000))
        time.sleep(0.01)
    assert b.get(key(0)) is not None
    assert other.num_bytes() <= CAP


def test_redis_lease_expiry_is_lease_ttl_s(redis_server: RedisServer):
    """On Redis a lease is a key (``<ns>:l:<chunk key>``) that expires
    ``lease_ttl_s`` after it is taken, read in milliseconds (PTTL)."""
    import redis

    b = RedisBackend(redis_server.url, f"p{time.monotonic_ns()}", CAP)
    b.put(key(0), b"chunk")
    assert b.lease([key(0)], new_lease_id(), ttl_s=60) == 1
    pttl = redis.Redis.from_url(redis_server.url).pttl(f"{b.namespace}:l:{key(0)}")
    assert 55_000 < pttl <= 60_000
    b.close()


def test_all_leased_store_may_exceed_cap_but_never_drops_leased(make_backend):
    b = make_backend()
    b.put(key(0), bytes(6000))
    assert b.lease([key(0)], new_lease_id(), ttl_s=60) == 1
    b.put(key(1), bytes(6000))  # over the cap; only key 1 is evictable
    assert b.get(key(0)) is not None


def test_directory_write_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    b = DirectoryBackend(tmp_path / "store", CAP)
    real_write = os.write

    def crash_midway(fd: int, buffers) -> int:
        data = b"".join(buffers)
        real_write(fd, data[: len(data) // 2])
        raise OSError("disk gone")

    monkeypatch.setattr(os, "writev", crash_midway)
    with pytest.raises(BackendUnavailable, match="disk gone"):
        b.put(key(1), bytes(1000))
    monkeypatch.undo()
    assert b.get(key(1)) is None
    assert list((tmp_path / "store" / "tmp").iterdir()) == []
    # A leftover from a killed writer (older than a minute) is cleaned on open.
    stale = tmp_path / "store" / "tmp" / "dead.part"
    stale.write_bytes(b"partial")
    os.utime(stale, (time.time() - 120, time.time() - 120))
    DirectoryBackend(tmp_path / "store", CAP)
    assert not stale.exists()


def test_redis_down_raises_backend_unavailable():
    b = RedisBackend(f"redis://127.0.0.1:{free_port()}/0", "x", CAP, timeout_s=0.5)
    with pytest.raises(BackendUnavailable):
        b.get(key(1))
    with pytest.raises(BackendUnavailable):
        b.lease([key(1)], new_lease_id(), 10)


# ---------------------------------------------------------------- config


def test_config_defaults(tmp_path: Path):
    c = parse_config({"path": str(tmp_path / "s")})
    assert c.backend == "directory" and c.path == tmp_path / "s"
    assert not (tmp_path / "s").exists()  # the backend creates it
    assert c.verify_on_lookup and c.capacity_bytes == 8 * 2**30
    assert c.offload == "eager" and c.offload_window_blocks is None
    lazy = parse_config(
        {"path": str(tmp_path / "s"), "offload": "lazy", "offload_window_blocks": 64}
    )
    assert lazy.offload == "lazy" and lazy.offload_window_blocks == 64


def test_config_unknown_key_names_it_and_suggests(tmp_path: Path):
    with pytest.raises(ValueError, match=r"\['capacty'\].*did you mean 'capacity'"):
        parse_config({"path": str(tmp_path), "capacty": "1GiB"})


@pytest.mark.parametrize(
    "extra, message",
    [
        ({}, r"\['path'\] = None: set the directory"),
        ({"backend": "s3", "path": "x"}, r"\['backend'\] = 's3': set it to"),
        ({"path": "P", "capacity": "lots"}, r"\['capacity'\] = 'lots'"),
        ({"path": "P", "capacity": -1}, r"\['capacity'\] = -1"),
        ({"path": "P", "lease_ttl_s": 0}, r"\['lease_ttl_s'\] = 0"),
        ({"path": "P", "lease_ttl_s": -1}, r"\['lease_ttl_s'\] = -1: set a positive"),
        ({"path": "P", "lease_ttl_s": "-60"}, r"\['lease_ttl_s'\] = '-60'"),
        ({"path": "P", "lease_ttl_s": float("inf")}, r"\['lease_ttl_s'\] = inf"),
        ({"path": "P", "redis_timeout_s": -0.5}, r"\['redis_timeout_s'\] = -0.5"),
        ({"path": "P", "redis_timeout_s": "1e999"}, r"\['redis_timeout_s'\]"),
        ({"path": "P", "verify_on_lookup": "yes"}, r"\['verify_on_lookup'\]"),
        ({"backend": "redis"}, r"\['redis_url'\] = None: set a URL"),
        ({"backend": "redis", "redis_url": "r", "path": "P"}, r"\['path'\].*remove"),
        ({"path": "P", "offload": "later"}, r"\['offload'\] = 'later': set 'eager'"),
        ({"path": "P", "offload_window_blocks": 0}, r"\['offload_window_blocks'\]"),
        ({"path": "P", "offload_window_blocks": True}, r"\['offload_window_blocks'\]"),
    ],
)
def test_config_bad_values(tmp_path: Path, extra, message):
    extra = {k: (str(tmp_path) if v == "P" else v) for k, v in extra.items()}
    with pytest.raises(ValueError, match=message):
        parse_config(extra)


def test_config_path_that_is_a_file(tmp_path: Path):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ValueError, match=r"\['path'\].*not a directory"):
        parse_config({"path": str(f)})


def test_config_unwritable_path(tmp_path: Path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):  # root ignores the mode bits
            target = Path("/proc/kvlc-store-test")
        else:
            target = ro / "store"
        with pytest.raises(ValueError, match=r"\['path'\].*cannot create or write"):
            parse_config({"path": str(target)})
    finally:
        ro.chmod(0o700)


def test_config_unreachable_redis():
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(ValueError, match=r"\['redis_url'\].*does not answer"):
        parse_config({"backend": "redis", "redis_url": url, "redis_timeout_s": 0.5})


def test_config_startup_ping_outwaits_a_short_request_timeout(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
):
    """A server is not refused because its Redis took longer than a
    request's redis_timeout_s to answer the startup PING once."""
    import redis

    waits: list[float] = []

    class Slow(backends.RedisBackend):
        """Answers the PING after about a second."""

        def __init__(self, *args: Any, timeout_s: float, **kwargs: Any) -> None:
            super().__init__(*args, timeout_s=timeout_s, **kwargs)
            self.wait = timeout_s

        def ping(self) -> None:
            waits.append(self.wait)
            if self.wait < 1.0:
                timeout = redis.exceptions.TimeoutError("Timeout reading from socket")
                raise backends.BackendUnavailable(f"redis: {timeout}") from timeout
            super().ping()

    monkeypatch.setattr(backends, "RedisBackend", Slow)
    parse_config(
        {"backend": "redis", "redis_url": redis_server.url, "redis_timeout_s": 0.5}
    )
    assert waits == [STARTUP_PING_TIMEOUT_S]


def test_config_reachable_redis(redis_server: RedisServer):
    c = parse_config({"backend": "redis", "redis_url": redis_server.url})
    assert c.redis_url == redis_server.url and c.path is None


def test_config_lists_every_problem_in_one_error(tmp_path: Path):
    with pytest.raises(ValueError) as e:
        parse_config({"path": str(tmp_path), "a": 1, "lease_ttl_s": "x"})
    assert "['a']" in str(e.value) and "['lease_ttl_s']" in str(e.value)


def test_parse_size():
    assert parse_size("1GiB") == 2**30
    assert parse_size("512 MB") == 512 * 10**6
    assert parse_size(42) == 42
    assert parse_size("1.5KiB") == 1536
    assert parse_size("lots") is None and parse_size(True) is None


# ---------------------------------------------------------------- stats


def test_stats_sum_take_and_reduce():
    from kvlc_store.stats import StoreConnectorStats

    a, b = StoreConnectorStats(), StoreConnectorStats()
    assert a.is_empty() and a.take() is None
    a.inc("lookups", 2)
    b.inc("lookups")
    b.inc("evictions", 3)
    total = a.aggregate(b)
    assert total.reduce() == {"evictions": 3, "lookups": 3}
    taken = a.take()
    assert taken is not None and taken.data == {"lookups": 3, "evictions": 3}
    assert a.is_empty()
    with pytest.raises(KeyError):
        a.inc("nonsense")

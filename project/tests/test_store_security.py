"""StoreConnector's store as shared infrastructure, without an engine: every
store error a fault, settings checked finite and in range, Redis refusals
named, the Redis password kept out of messages, a private store, another
user's chunk refused, a store turned read-only, damaged chunks it cannot
delete remembered. The same cases against ``vllm serve`` are in
``test_store_security_e2e.py``.

Needs Debian's ``redis-server`` for the Redis cases.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_lib
from kvlc_store.backends import (
    BackendUnavailable,
    DirectoryBackend,
    RedisBackend,
    directory,
    new_lease_id,
)
from kvlc_store.chunk import ChunkError
from kvlc_store.config import (
    SecretInConfig,
    parse_config,
    redact_url,
)
from kvlc_store.core import StoreCore, make_backend
from redis_server import RedisServer

KEY = f"ident0/{1:064x}.0"
DATA = b"x" * 1000
PASSWORD = "unit-Pw-5e1f"


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    redis_lib.Redis(port=server.port).config_set("requirepass", PASSWORD)
    yield server
    server.stop()


@pytest.fixture
def caplog(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """``caplog`` that also sees vLLM's loggers (they do not propagate)."""
    import logging

    logger = logging.getLogger("vllm")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


def admin(server: RedisServer) -> redis_lib.Redis:
    return redis_lib.Redis(port=server.port, password=PASSWORD)


# -- 1. every store error is a fault ------------------------------------------


def test_full_redis_is_a_fault_on_writes_and_reads_still_serve(
    redis_server: RedisServer,
):
    backend = RedisBackend(redis_server.url, "full", 10**9, password=PASSWORD)
    backend.put(KEY, DATA)
    admin(redis_server).config_set("maxmemory", 1)
    try:
        with pytest.raises(BackendUnavailable, match="OutOfMemoryError"):
            backend.put(KEY.replace("1", "2"), DATA)
        with pytest.raises(BackendUnavailable, match="OutOfMemoryError"):
            backend.get(KEY)  # marks the chunk used in the same script
        # A read marks its chunks used apart, best effort: still a hit.
        into = bytearray(len(DATA) - 10)
        heads = list(backend.read_into([KEY], 10, [[memoryview(into)]]))
        assert heads == [(DATA[:10], len(DATA))]
    finally:
        admin(redis_server).config_set("maxmemory", 0)
        backend.close()


def test_any_redis_error_reply_is_a_fault(redis_server: RedisServer):
    backend = RedisBackend(redis_server.url, "err", 10**9, password=PASSWORD)
    admin(redis_server).set("err:bytes", "not a number")
    try:
        with pytest.raises(BackendUnavailable, match="ResponseError"):
            backend.put(KEY, DATA)  # INCRBY on a string
    finally:
        backend.close()


# -- 2. numbers finite and in range; Redis refusals named ---------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("lease_ttl_s", "inf"),
        ("lease_ttl_s", float("inf")),
        ("lease_ttl_s", "nan"),
        ("lease_ttl_s", 10**9),
        ("redis_timeout_s", "inf"),
        ("redis_timeout_s", "-inf"),
        ("redis_timeout_s", 1e9),
        ("capacity", "1B"),
        ("capacity", 1000),
    ],
)
def test_numbers_out_of_range_are_refused(tmp_path: Path, key: str, value: object):
    with pytest.raises(ValueError, match=rf"\['{key}'\] = "):
        parse_config({"path": str(tmp_path / "s"), key: value})
    assert not (tmp_path / "s").exists()


@pytest.fixture
def denied_port() -> Iterator[int]:
    """A port answering as Redis in protected mode answers a remote client."""
    listener = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(4096)
                conn.sendall(b"-DENIED Redis is running in protected mode\r\n")

    threading.Thread(target=answer, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()


def test_protected_mode_redis_is_refused_as_such(denied_port: int):
    url = f"redis://127.0.0.1:{denied_port}/0"
    with pytest.raises(ValueError) as e:
        parse_config({"backend": "redis", "redis_url": url})
    assert "Redis refuses this connector" in str(e.value)
    assert "protected mode" in str(e.value) and "requirepass" in str(e.value)
    assert "does not answer" not in str(e.value)


def test_wrong_or_missing_password_is_refused_as_such(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("KVLC_PW", "wrong-one")
    for extra in ({"redis_password_env": "KVLC_PW"}, {}):
        with pytest.raises(ValueError) as e:
            parse_config({"backend": "redis", "redis_url": redis_server.url, **extra})
        assert "Redis refuses this connector" in str(e.value)
        assert "check the password" in str(e.value)
        assert "does not answer" not in str(e.value)
        assert "wrong-one" not in str(e.value)


# -- 4. the password: from an environment variable or a file, never printed --


def test_password_from_env_or_file(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("KVLC_PW", PASSWORD)
    pw_file = tmp_path / "pw"
    pw_file.write_text(PASSWORD + "\n")
    pw_file.chmod(0o600)
    for extra in (
        {"redis_password_env": "KVLC_PW"},
        {"redis_password_file": str(pw_file)},
    ):
        config = parse_config(
            {"backend": "redis", "redis_url": redis_server.url, **extra}
        )
        assert PASSWORD not in repr(config)
        # The connector's backend (not only the check's) sends the password.
        backend = make_backend(config)
        try:
            backend.put(KEY, DATA)
            assert backend.get(KEY) == DATA
        finally:
            backend.close()


@pytest.mark.parametrize(
    "extra",
    [
        {"redis_password_env": "KVLC_UNSET_VARIABLE"},
        {"redis_password_file": "/nonexistent/kvlc-pw"},
        {"redis_password_env": "A", "redis_password_file": "/f"},
    ],
)
def test_password_setting_that_cannot_be_used_is_refused(
    redis_server: RedisServer, extra: dict[str, str]
):
    with pytest.raises(ValueError, match="redis_password_"):
        parse_config({"backend": "redis", "redis_url": redis_server.url, **extra})


@pytest.mark.parametrize("backend", ["redis", "directory"])
def test_password_in_the_url_is_refused_and_never_printed(backend: str, tmp_path: Path):
    url = f"redis://user:{PASSWORD}@127.0.0.1:1/0"
    extra = {"backend": backend, "redis_url": url}
    if backend == "directory":
        extra["path"] = str(tmp_path / "s")
    # Not a ValueError: pydantic would print the whole input beside it.
    with pytest.raises(SecretInConfig) as e:
        parse_config(extra)
    assert not isinstance(e.value, ValueError)
    assert PASSWORD not in str(e.value)
    assert "redis://user:***@127.0.0.1:1/0" in str(e.value)


def test_redact_url():
    assert redact_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert redact_url("redis://u:pw@h/0") == "redis://u:***@h/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"


# -- 3. a private store; another user's chunk is refused ----------------------


def modes(root: Path) -> dict[Path, int]:
    return {p: stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


@pytest.fixture
def umask_000() -> Iterator[None]:
    old = os.umask(0)
    yield
    os.umask(old)


def test_store_is_private_whatever_the_umask(tmp_path: Path, umask_000: None):
    store = DirectoryBackend(tmp_path / "a" / "store", 10**6)
    store.put(KEY, DATA)
    store.lease([KEY], new_lease_id(), 60)
    made = modes(tmp_path / "a")
    assert {m for p, m in made.items() if p.is_dir()} == {0o700}
    assert {m for p, m in made.items() if not p.is_dir()} == {0o600}


def test_group_access_shares_with_the_group_only(tmp_path: Path):
    old = os.umask(0o077)
    try:
        store = DirectoryBackend(tmp_path / "store", 10**6, group_access=True)
        store.put(KEY, DATA)
    finally:
        os.umask(old)
    made = modes(tmp_path / "store")
    assert {m for p, m in made.items() if p.is_dir()} == {0o2770}
    assert {m for p, m in made.items() if not p.is_dir()} == {0o660}


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o707])
def test_store_others_can_write_is_refused(tmp_path: Path, mode: int):
    root = tmp_path / "store"
    DirectoryBackend(root, 10**6)
    root.chmod(mode)
    with pytest.raises(ValueError, match=r"writable by .*chmod 700"):
        parse_config({"path": str(root)})
    if mode & 0o002 == 0:  # shared with the group on purpose: fine
        parse_config({"path": str(root), "group_access": True})


def test_parent_everyone_can_write_is_refused_unless_sticky(tmp_path: Path):
    parent = tmp_path / "open"
    parent.mkdir()
    parent.chmod(0o777)
    with pytest.raises(ValueError, match=r"above the store, is writable by every"):
        parse_config({"path": str(parent / "store")})
    parent.chmod(0o1777)  # like /tmp: others cannot replace our entries
    parse_config({"path": str(parent / "store")})


def test_chunk_another_user_wrote_is_refused(tmp_path: Path, caplog):
    store = DirectoryBackend(tmp_path / "store", 10**6)
    store.put(KEY, DATA)
    path = next((tmp_path / "store" / "chunks").rglob("*.0"))
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
    else:
        path.chmod(0o622)  # others could have rewritten it
    path.chmod(path.stat().st_mode | 0o044)
    into = bytearray(len(DATA) - 10)
    assert store.peek([KEY], 10) == [None]
    assert list(store.read_into([KEY], 10, [[memoryview(into)]])) == [None]
    assert store.get(KEY) is None
    assert "is not served" in caplog.text


# -- 5. a store that turns read-only keeps its hits ---------------------------


def test_store_turned_read_only_serves_without_leases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
):
    store = DirectoryBackend(tmp_path / "store", 10**6)
    store.put(KEY, DATA)

    def read_only(*args: object, **kwargs: object) -> int:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    real_open = directory.os.open
    monkeypatch.setattr(
        directory.os,
        "open",
        lambda path, flags, *a: read_only()
        if flags & os.O_CREAT
        else real_open(path, flags, *a),
    )
    monkeypatch.setattr(directory.os, "utime", read_only)
    assert store.lease([KEY], new_lease_id(), 60) == 1
    assert "lease write to store directory" in caplog.text
    assert "Read-only file system" in caplog.text
    assert not store.writable
    into = bytearray(len(DATA) - 10)
    assert list(store.read_into([KEY], 10, [[memoryview(into)]])) == [
        (DATA[:10], len(DATA))
    ]
    monkeypatch.undo()
    assert store.lease([KEY], new_lease_id(), 60) == 1
    assert store.writable


# -- 6. a damaged chunk that cannot be deleted is remembered ------------------


def test_damaged_chunk_on_read_only_store_is_kept_and_remembered(
    tmp_path: Path, caplog
):
    DirectoryBackend(tmp_path / "store", 10**6).put(KEY, DATA)
    backend = DirectoryBackend(tmp_path / "store", 10**6)
    backend.read_only = True  # as a store this user may only read
    core = StoreCore(parse_config({"path": str(tmp_path / "x")}), backend, "i", 1)
    core.bad_chunk(KEY, ChunkError("checksum mismatch"), at_load=True)
    assert core.usable_run([KEY]) == 0
    assert "kept, since the store cannot be written now" in caplog.text
    assert "deleted" not in caplog.text
    assert backend.get(KEY) == DATA

    writable = DirectoryBackend(tmp_path / "store", 10**6)
    core = StoreCore(parse_config({"path": str(tmp_path / "x")}), writable, "i", 1)
    core.bad_chunk(KEY, ChunkError("checksum mismatch"))
    assert core.usable_run([KEY]) == 1  # deleted: its next save writes it again
    assert writable.get(KEY) is None

"""StoreConnector faults and security end to end (``vllm serve``, real HTTP):
a full Redis, another local user, a store that turns read-only, links and
FIFOs under chunk names, another model config on the same store, secrets in
logs, and settings refused before any model loads (a store another user
made, a store reached through a link in a directory anyone may write, a
password file anyone may read).

Three servers on the demo model, started together and shared by the tests
of this module (``kv_load_failure_policy: recompute`` on all):

* ``dir``: a directory store created under umask 000, inside a user and
  mount namespace (``unshare``) where the directory holding the store is a
  bind mount of itself, so a test can remount it read-only under the running
  server (``nsenter``) while this process still writes it;
* ``redis``: a Redis with a password (``requirepass``) that the server reads
  from an environment variable; a test fills Redis to ``maxmemory``;
* ``config``: the same model directory and store as ``dir``, with its config
  read from another file (``--hf-config-path``: another RoPE base).

The refusals run ``vllm serve`` on a model directory that does not exist:
the check must stop it first, in one line, with exit status 2.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from conftest import REPO
from forked_cli import ForkedCli
from kvlc_store.chunk import encode_chunk
from redis_server import RedisServer, free_port

sys.path.insert(0, str(REPO / "project" / "demo"))
import serve_demo  # noqa: E402
from make_model import make_model  # noqa: E402
from test_store_connector_e2e import (  # noqa: E402
    BLOCK,
    Engine,
    assert_same_output,
    kv_config,
    prompt,
)
from test_store_user_errors_e2e import LAST_LINES, serve  # noqa: E402

PASSWORD = "kvlc-e2e-Pw-7f3c9a1e"
PASSWORD_ENV = "KVLC_TEST_REDIS_PASSWORD"
WRONG_PASSWORD = "kvlc-e2e-wrong-0b5d"
NOBODY = 65534


def in_namespace(command: list[str], mount: Path) -> list[str]:
    """``command`` under umask 000, in its own user and mount namespaces
    where ``mount`` is a bind mount of itself (remountable read-only)."""
    script = 'umask 000 && mount --bind "$0" "$0" && exec "$@"'
    return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script,
            str(mount), *command]  # fmt: skip


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory, forked_cli: ForkedCli
) -> Iterator[dict[str, Any]]:
    """``dir`` (in a namespace, a subprocess), ``redis`` (a subprocess: a
    test reads its command line) and ``config`` (forked, ``forked_cli.py``)."""
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        pytest.fail("unshare and nsenter (util-linux) are needed")
    root = tmp_path_factory.mktemp("store-security")
    model = make_model(root / "model")
    mount = root / "mnt"
    mount.mkdir(mode=0o700)
    store = mount / "store"
    redis = RedisServer(root / "redis")
    redis.start()
    client = redis_lib.Redis(port=redis.port)
    client.config_set("requirepass", PASSWORD)
    client = redis_lib.Redis(port=redis.port, password=PASSWORD)
    engines: dict[str, Engine] = {}
    try:
        port = serve_demo.free_port()
        command = serve_demo.server_command(
            model, port, kv_config({"path": str(store)}), eager=True
        )
        command = in_namespace(command, mount)
        server = serve_demo.Server(command, serve_demo.server_env(), root / "dir.log")
        engines["dir"] = Engine("dir", server, port)
        port = serve_demo.free_port()
        extra = {
            "backend": "redis",
            "redis_url": redis.url,
            "redis_password_env": PASSWORD_ENV,
        }
        command = serve_demo.server_command(model, port, kv_config(extra), eager=True)
        env = {**serve_demo.server_env(), PASSWORD_ENV: PASSWORD}
        server = serve_demo.Server(command, env, root / "redis.log")
        engines["redis"] = Engine("redis", server, port)
        port = serve_demo.free_port()
        command = serve_demo.server_command(
            model, port, kv_config({"path": str(store)}), eager=True
        )
        command += ["--hf-config-path", str(other_config(model, root / "config"))]
        server = serve_demo.Server(
            command,
            serve_demo.server_env(),
            root / "config.log",
            forked_cli.starter(command),
        )
        engines["config"] = Engine("config", server, port)
        for engine in engines.values():
            engine.server.wait_healthy(engine.url, timeout=600)
        yield {"root": root, "store": store, "mount": mount, "client": client,
               **engines}  # fmt: skip
    finally:
        for engine in engines.values():
            engine.server.stop()
        redis.stop()


def other_config(model: Path, out: Path) -> Path:
    """A directory holding ``model``'s config with another RoPE base: the
    same weights compute other KV with it."""
    config = json.loads((model / "config.json").read_text())
    config["rope_theta"] = 500.0
    if isinstance(config.get("rope_parameters"), dict):
        config["rope_parameters"]["rope_theta"] = 500.0
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    return out


def stored_files(store: Path) -> dict[Path, int]:
    """Every chunk file of the store, with its inode (a new one is new)."""
    return {p: p.stat().st_ino for p in (store / "chunks").rglob("*.0")}


def store_new(engine: Engine, store: Path, tag: str) -> tuple[Any, list[Path]]:
    """Send ``prompt(tag)`` once (a miss, stored); its answer and chunk files."""
    before = stored_files(store)
    miss = engine.complete(prompt(tag))
    assert miss.cached_tokens == 0
    new = [p for p in stored_files(store) if p not in before]
    assert len(new) == 2, new
    return miss, new


def test_store_created_under_umask_000_is_private(servers):
    engine: Engine = servers["dir"]
    store: Path = servers["store"]
    miss, _ = store_new(engine, store, "private")
    hit = engine.complete(prompt("private"))
    assert hit.cached_tokens == 2 * BLOCK
    assert_same_output(hit, miss)
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in [store, *store.rglob("*")]}
    loose = {
        str(p): oct(m)
        for p, m in modes.items()
        if m != (0o700 if p.is_dir() else 0o600)
    }
    assert not loose, loose


def test_chunk_of_another_user_is_refused_with_a_warning(servers):
    """A chunk file another user wrote (here: a stored one, handed to
    ``nobody`` after the server recorded it checked) is never served: the
    load that meets it refuses it with a warning (recomputed under this
    module's policy), every process forgets it, and later lookups refuse it
    at once (a miss)."""
    engine: Engine = servers["dir"]
    miss, chunks = store_new(engine, servers["store"], "foreign")
    for path in chunks:  # readable: its writer wants it served
        os.chown(path, NOBODY, NOBODY)
        path.chmod(0o644)
    again = engine.complete(prompt("foreign"))
    assert_same_output(again, miss)
    later = engine.complete(prompt("foreign"))
    assert later.cached_tokens == 0
    assert_same_output(later, miss)
    log = engine.server.log_text()
    assert f"{chunks[0]} is not served: it belongs to uid {NOBODY}" in log or (
        f"{chunks[1]} is not served: it belongs to uid {NOBODY}" in log
    ), log[-3000:]


def test_servers_of_one_model_with_other_configs_never_share_chunks(servers):
    """``dir`` and ``config`` serve one model directory from one store, one
    with another RoPE base: neither is offered the other's chunks, each hits
    its own."""
    store: Path = servers["store"]
    # One-word tags: a longer one would make the answer fill a third block.
    for tag, first, second in (("theta", "dir", "config"), ("base", "config", "dir")):
        stored, _ = store_new(servers[first], store, tag)
        other = servers[second].complete(prompt(tag))
        assert other.cached_tokens == 0, (first, second)
        assert servers[second].complete(prompt(tag)).cached_tokens == 2 * BLOCK
        hit = servers[first].complete(prompt(tag))
        assert hit.cached_tokens == 2 * BLOCK
        assert_same_output(hit, stored)
    identities = {p.relative_to(store / "chunks").parts[0] for p in stored_files(store)}
    assert len(identities) == 2, identities


def test_link_or_fifo_under_a_chunks_name_is_a_miss_with_one_line(servers):
    """A chunk file replaced by a link to a FIFO (a reader opening it would
    wait for a writer: every request for the prompt would hang) or by a link
    to a valid chunk outside the store (served before, its mtime changed)
    after the server recorded it checked: never followed, never waited on
    (the load refuses it, recomputed under this module's policy), one line
    (per process), the outside file untouched; the request's save puts the
    store's own chunk in place of the link, so the next one hits."""
    engine: Engine = servers["dir"]
    store, root = servers["store"], servers["root"]
    fifo = root / "fifo"
    os.mkfifo(fifo)
    outside = root / "outside"
    outside.mkdir()
    answers = {}
    links: dict[str, list[Path]] = {}
    for tag in ("fifo", "outside"):
        answers[tag], links[tag] = store_new(engine, store, tag)
        for chunk in links[tag]:
            target = fifo
            if tag == "outside":
                target = outside / chunk.name
                shutil.copy(chunk, target)
                os.utime(target, (1_000_000, 1_000_000))
            chunk.unlink()
            chunk.symlink_to(target)
    start = len(engine.server.log_text())
    for tag in answers:
        again = engine.complete(prompt(tag))
        assert_same_output(again, answers[tag])
        assert not any(link.is_symlink() for link in links[tag]), tag
        hit = engine.complete(prompt(tag))
        assert hit.cached_tokens == 2 * BLOCK, tag
        assert_same_output(hit, answers[tag])
    log = engine.server.log_text()[start:]
    for tag in links:
        # One line from each process that meets a link (the worker's
        # load; a lookup's, had the store's record not listed it).
        lines = [f"chunk file {link} is not served: it is a symbolic link" for
                 link in links[tag]]  # fmt: skip
        told = sum(log.count(line) for line in lines)
        assert 1 <= told <= 2, (tag, log[-3000:])
    assert {p.stat().st_mtime for p in outside.iterdir()} == {1_000_000}
    assert stat.S_ISFIFO(fifo.stat().st_mode)


def remount(engine: Engine, mount: Path, mode: str) -> None:
    subprocess.run(
        ["nsenter", "-t", str(engine.server.proc.pid), "-U", "-m",
         "mount", "-o", f"remount,bind,{mode}", str(mount)],
        check=True, timeout=30,
    )  # fmt: skip


def test_store_remounted_read_only_keeps_its_hits_and_its_bad_chunks(servers):
    """Remounted read-only while serving: a lease cannot be written, and the
    chunks are served without one (nothing can evict them now); the log says
    the lease write failed. A chunk found damaged then cannot be deleted: it
    is logged as kept and never read again (each read would fail its load
    and recompute the request)."""
    engine: Engine = servers["dir"]
    store: Path = servers["store"]
    kept, _ = store_new(engine, store, "read-only")
    damaged, damaged_chunks = store_new(engine, store, "damaged")
    remount(engine, servers["mount"], "ro")
    try:
        start = len(engine.server.log_text())
        hit = engine.complete(prompt("read-only"))
        assert hit.cached_tokens == 2 * BLOCK
        assert_same_output(hit, kept)
        log = engine.server.log_text()[start:]
        assert "lease write to store directory" in log, log
        assert "Read-only file system" in log, log
        assert "store read failed" not in log, log

        for path in damaged_chunks:  # this process still writes the store
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))
        first = engine.complete(prompt("damaged"))
        assert_same_output(first, damaged)
        corrupt = engine.store_metrics()["vllm:kvlc_store_corrupt_chunks_total"]
        assert corrupt >= 1
        log = engine.server.log_text()[start:]
        assert "kept, since the store cannot be written now" in log, log
        assert "), deleted;" not in log, log
        for _ in range(2):
            again = engine.complete(prompt("damaged"))
            assert again.cached_tokens == 0
            assert_same_output(again, damaged)
        after = engine.store_metrics()["vllm:kvlc_store_corrupt_chunks_total"]
        assert after == corrupt  # not read again
        assert all(p.exists() for p in damaged_chunks)
    finally:
        remount(engine, servers["mount"], "rw")


def test_full_redis_skips_saves_and_keeps_serving_hits(servers):
    """Redis at ``maxmemory`` (default policy ``noeviction``) refuses writes
    with an OOM error: saves are skipped, with one line; a hit is still
    served (marking its chunks used is best effort); answers stay right."""
    engine: Engine = servers["redis"]
    client: redis_lib.Redis = servers["client"]
    stored = engine.complete(prompt("before-full"))
    assert engine.complete(prompt("before-full")).cached_tokens == 2 * BLOCK
    start = len(engine.server.log_text())
    client.config_set("maxmemory", 1)
    try:
        for i in range(4):
            answer = engine.complete(prompt(f"full-{i}"))
            assert answer.cached_tokens == 0
        again = engine.complete(prompt("before-full"))
        assert again.cached_tokens == 2 * BLOCK
        assert_same_output(again, stored)
        log = engine.server.log_text()[start:]
    finally:
        client.config_set("maxmemory", 0)
    assert log.count("store write failed, skipping saves") == 1, log
    assert "store read" not in log, log
    assert "OutOfMemoryError" in log, log
    assert engine.server.proc.poll() is None
    health = serve_demo.http(f"{engine.url}/health")
    assert health is not None


def test_no_log_line_holds_the_redis_password(servers):
    engine: Engine = servers["redis"]
    answer = engine.complete(prompt("secret"))
    assert answer.cached_tokens == 0
    engine.complete(prompt("secret"))  # a hit, unless saves still back off
    assert PASSWORD not in engine.server.log_text()
    cmdline = Path(f"/proc/{engine.server.proc.pid}/cmdline").read_bytes()
    assert PASSWORD.encode() not in cmdline


# -- refused before the model loads ------------------------------------------


@contextlib.contextmanager
def protected_mode_redis() -> Iterator[int]:
    """A port answering as Redis in protected mode answers a client from
    another host: the DENIED error, then the connection closes."""
    listener = socket.create_server(("127.0.0.1", 0))
    port: int = listener.getsockname()[1]

    def answer() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                conn.recv(4096)
                conn.sendall(
                    b"-DENIED Redis is running in protected mode because "
                    b"protected mode is enabled and no password is set for "
                    b"the default user.\r\n"
                )

    threading.Thread(target=answer, daemon=True).start()
    try:
        yield port
    finally:
        listener.close()


def refusal_config(case: str, tmp_path: Path, stack: contextlib.ExitStack) -> dict:
    store = store_config(case, tmp_path)
    if store is not None:
        return store
    if case == "numbers":
        return {
            "path": str(tmp_path / "store"),
            "lease_ttl_s": "inf",
            "redis_timeout_s": "inf",
            "capacity": "1B",
        }
    if case == "protected mode":
        port = stack.enter_context(protected_mode_redis())
        return {"backend": "redis", "redis_url": f"redis://127.0.0.1:{port}/0"}
    redis = stack.enter_context(running_password_redis(tmp_path))
    if case == "wrong password":
        return {
            "backend": "redis",
            "redis_url": redis.url,
            "redis_password_env": PASSWORD_ENV,
        }
    if case == "password file anyone may read":
        password_file = tmp_path / "redis-password"
        password_file.write_text(PASSWORD + "\n")
        password_file.chmod(0o644)
        return {
            "backend": "redis",
            "redis_url": redis.url,
            "redis_password_file": str(password_file),
        }
    assert case == "password in the URL"
    return {"backend": "redis", "redis_url": f"redis://:{PASSWORD}@127.0.0.1:1/0"}


def squatted_store(tmp_path: Path) -> Path:
    """A store directory another user made (0700, under a sticky directory
    like /tmp) and filled with chunks that pass every check but the owner's:
    forged KV under a prompt's key."""
    squat = tmp_path / "sticky" / "squat"
    squat.parent.mkdir(mode=0o1777)
    chunk = squat / "chunks" / "identity" / "00" / ("00" * 32 + ".0")
    chunk.parent.mkdir(parents=True)
    chunk.write_bytes(encode_chunk("identity", "identity/" + chunk.name, b"kv"))
    for path in (squat, *squat.rglob("*")):
        path.chmod(0o700 if path.is_dir() else 0o600)
        os.chown(path, NOBODY, NOBODY)
    return squat


def store_config(case: str, tmp_path: Path) -> dict | None:
    if case == "store another user made":
        return {"path": str(squatted_store(tmp_path))}
    if case == "store through a link in a directory anyone may write":
        private = tmp_path / "private"
        private.mkdir(mode=0o700)
        shared = tmp_path / "shared"
        shared.mkdir()
        shared.chmod(0o777)
        (shared / "store").symlink_to(private / "store")
        return {"path": str(shared / "store")}
    if case == "store through another user's link in a sticky directory":
        private = tmp_path / "private"
        private.mkdir(mode=0o700)
        sticky = tmp_path / "sticky"
        sticky.mkdir()
        sticky.chmod(0o1777)
        (sticky / "store").symlink_to(private / "store")
        os.lchown(sticky / "store", NOBODY, NOBODY)
        return {"path": str(sticky / "store")}
    if case == "store under a directory of another user":
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o755)
        os.chown(theirs, NOBODY, NOBODY)
        return {"path": str(theirs / "store")}
    return None


@contextlib.contextmanager
def running_password_redis(tmp_path: Path) -> Iterator[RedisServer]:
    redis = RedisServer(tmp_path / "redis", free_port())
    redis.start()
    redis_lib.Redis(port=redis.port).config_set("requirepass", PASSWORD)
    try:
        yield redis
    finally:
        redis.stop()


REFUSALS = {
    "numbers": [
        "['lease_ttl_s'] = 'inf': set a positive number of seconds, at most",
        "['redis_timeout_s'] = 'inf': set a positive number of seconds, at most",
        "['capacity'] = '1B': set a positive size in bytes or like '8GiB', at "
        "least 64KiB",
    ],
    "protected mode": ["Redis refuses this connector (", "protected mode"],
    "wrong password": [
        "Redis refuses this connector (",
        "check the password (redis_password_env",
    ],
    "password in the URL": ["'redis://:***@127.0.0.1:1/0': holds a password"],
    "password file anyone may read": [
        "['redis_password_file'] = ",
        "other users may read or write it (mode 644); chmod 600 it",
    ],
    "store another user made": [
        f"belongs to another user (uid {NOBODY}), who could have put any KV in it",
    ],
    "store through a link in a directory anyone may write": [
        "shared, above the store, is writable by every user (mode 777)",
    ],
    "store through another user's link in a sticky directory": [
        f"sticky/store is a link of another user (uid {NOBODY}) in a directory "
        "every user may write",
    ],
    "store under a directory of another user": [
        f"theirs, above the store, belongs to another user (uid {NOBODY})",
    ],
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refused_in_one_line_before_the_model(
    forked_cli: ForkedCli, tmp_path: Path, case: str
):
    with contextlib.ExitStack() as stack:
        kv = {
            "kv_connector": "StoreConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": refusal_config(case, tmp_path, stack),
        }
        os.environ[PASSWORD_ENV] = WRONG_PASSWORD
        try:
            status, output, seconds = serve(forked_cli, tmp_path, kv)
        finally:
            del os.environ[PASSWORD_ENV]
    last = "\n".join(output.strip().splitlines()[-LAST_LINES:])
    assert status == 2, output[-3000:]
    for expected in REFUSALS[case]:
        assert expected in last, output[-3000:]
        # One line: each problem on its own, not cut across lines.
    assert "Traceback" not in output
    assert "does not answer" not in output
    assert "Starting to load model" not in output
    assert PASSWORD not in output and WRONG_PASSWORD not in output
    assert not (tmp_path / "store").exists()
    print(f"{case}: exit {status} after {seconds:.1f} s; last lines:\n{last}")

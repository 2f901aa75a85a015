"""StoreConnector end to end on a store shared the way deployments share one:
``vllm serve`` on the CPU build, real HTTP, real mounts.

Two servers on one directory store, each in its own mount namespace where
the store is bind-mounted onto itself, and each given the demo model by a
different path:

* ``writer``: the model by its directory, the store writable; the test
  later remounts the store read-only inside the writer's namespace only (a
  store that fails while serving), then writable again;
* ``reader``: the model through a symlink (the same directory at another
  path), the store mounted read-only from the start: a prebuilt cache that
  many servers mount.

A private mount namespace needs root (``unshare -m``) or unprivileged user
namespaces (``unshare -rm``); where neither works the module skips, or fails
under ``KVLC_REQUIRE_E2E=1``. Both servers run vLLM's default
``kv_load_failure_policy`` (``fail``); local prefix caching is off, so
``cached_tokens`` counts only what the connector supplied.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO
from test_store_connector_e2e import (
    BLOCK,
    Answer,
    Engine,
    assert_same_output,
    prompt,
)

sys.path.insert(0, str(REPO / "project" / "demo"))
import serve_demo  # noqa: E402
from make_model import make_model  # noqa: E402

READ_ONLY = "is read-only: serving hits from it, saving nothing"


def namespace_command() -> list[str]:
    """``unshare`` with a private mount namespace, as this user can."""
    return ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-r", "-m"]


def nsenter_command(pid: int) -> list[str]:
    head = ["nsenter", "-t", str(pid), "-m"]
    return head if os.geteuid() == 0 else [*head, "-U", "--preserve-credentials"]


def bind_mounts_work(scratch: Path) -> str | None:
    """Why a read-only bind mount in a private namespace is unavailable
    here, or None if it works (and refuses writes, root's included)."""
    scratch.mkdir(parents=True, exist_ok=True)
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && ! touch "$0/x"'
    try:
        done = subprocess.run(
            [*namespace_command(), "sh", "-c", script, str(scratch)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except FileNotFoundError as e:
        return f"{e.filename} is missing"
    if done.returncode != 0 or (scratch / "x").exists():
        return f"no read-only bind mount in a private mount namespace: {done.stderr}"
    return None


def start_in_namespace(
    name: str, root: Path, model: Path, store: Path, read_only: bool
) -> Engine:
    """A server in its own mount namespace, where ``store`` is bind-mounted
    onto itself (read-only if ``read_only``), so only this server's view of
    it changes when the test remounts it."""
    port = serve_demo.free_port()
    kv = {
        "kv_connector": "StoreConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"path": str(store)},
    }
    remount = ' && mount -o remount,bind,ro "$0"' if read_only else ""
    script = f'mount --bind "$0" "$0"{remount} && exec "$@"'
    command = [*namespace_command(), "sh", "-c", script, str(store)]
    command += serve_demo.server_command(model, port, kv, eager=True)
    server = serve_demo.Server(command, serve_demo.server_env(), root / f"{name}.log")
    return Engine(name, server, port)


def remount(engine: Engine, store: Path, mode: str) -> None:
    subprocess.run(
        [
            *nsenter_command(engine.server.proc.pid),
            "mount",
            "-o",
            f"remount,bind,{mode}",
            str(store),
        ],
        check=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Both servers, and the first prompt the writer stored."""
    root = tmp_path_factory.mktemp("store-shared")
    why = bind_mounts_work(root / "probe")
    if why is not None:
        if os.environ.get("KVLC_REQUIRE_E2E") == "1":
            pytest.fail(f"{why} (KVLC_REQUIRE_E2E=1)")
        pytest.skip(why)
    model = make_model(root / "model")
    link = root / "mounted-elsewhere"
    link.symlink_to(model, target_is_directory=True)
    store = root / "store"
    store.mkdir()
    writer = start_in_namespace("writer", root, model, store, read_only=False)
    engines = [writer]
    try:
        # The reader opens a store a server made (its layout is what marks a
        # directory as a store): start it once the writer's connector did,
        # while the writer is still starting.
        deadline = time.monotonic() + 600
        while not (store / "chunks").is_dir():
            assert writer.server.proc.poll() is None, writer.server.log_tail()
            assert time.monotonic() < deadline, "the writer made no store"
            time.sleep(1)
        reader = start_in_namespace("reader", root, link, store, read_only=True)
        engines.append(reader)
        for engine in engines:
            engine.server.wait_healthy(engine.url, timeout=600)
        yield {
            "store": store,
            "writer": writer,
            "reader": reader,
            "stored": writer.complete(prompt("shared")),
        }
    finally:
        for engine in engines:
            engine.server.stop()


def store_files(store: Path) -> dict[str, float]:
    return {
        p.relative_to(store).as_posix(): p.stat().st_mtime
        for p in store.rglob("*")
        if p.is_file()
    }


def identity(engine: Engine) -> str:
    for line in engine.server.log_text().splitlines():
        if "StoreConnector (SCHEDULER)" in line and "identity " in line:
            return line.split("identity ", 1)[1].split(";", 1)[0]
    raise AssertionError(f"no identity line in {engine.name}'s log")


def test_one_model_under_two_paths_shares_the_store(setup):
    """The reader serves the model by another path than the writer: same
    identity, so it hits what the writer stored, with the same output."""
    writer: Engine = setup["writer"]
    reader: Engine = setup["reader"]
    assert identity(writer) == identity(reader)
    hit = reader.complete(prompt("shared"))
    assert hit.cached_tokens == 2 * BLOCK
    assert_same_output(hit, setup["stored"])


def test_read_only_store_serves_hits_and_saves_nothing(setup):
    reader: Engine = setup["reader"]
    store: Path = setup["store"]
    before = store_files(store)
    new = [reader.complete(prompt("reader-only")) for _ in range(2)]
    assert [a.cached_tokens for a in new] == [0, 0]  # nothing saved to hit
    assert_same_output(new[1], new[0])
    for _ in range(3):
        hit = reader.complete(prompt("shared"))
        assert hit.cached_tokens == 2 * BLOCK
        assert_same_output(hit, setup["stored"])
    # Nothing written: no chunk, lease, temporary file, no use marked.
    assert store_files(store) == before
    metrics = reader.store_metrics()
    assert metrics.get("vllm:kvlc_store_store_errors_total", 0) == 0
    assert metrics.get("vllm:kvlc_store_stored_chunks_total", 0) == 0
    assert metrics["vllm:kvlc_store_leases_open"] == 0
    log = reader.server.log_text()
    assert log.count(READ_ONLY) == 1
    assert "store read failed" not in log and "store write failed" not in log
    assert "store read works again" not in log
    assert "store write works again" not in log


def test_store_turned_read_only_logs_one_outage_and_its_end(setup):
    """The writer's store turns read-only while it serves (a full or
    remounted disk): the failed saves are logged once and skipped meanwhile
    (new prompts are plain misses, same output); stored chunks are still
    served, without a lease (nothing can evict them now: the failed lease
    write is logged, not taken for a failed read); the end is logged once,
    when writing works again."""
    writer: Engine = setup["writer"]
    store: Path = setup["store"]
    start = len(writer.server.log_text())
    remount(writer, store, "ro")
    try:
        deadline = time.monotonic() + 8  # several retries of each kind
        i = 0
        while time.monotonic() < deadline:
            new = writer.complete(prompt(f"while-read-only-{i}"))
            assert new.cached_tokens == 0
            again = writer.complete(prompt("shared"))
            assert again.cached_tokens == 2 * BLOCK  # served without a lease
            assert_same_output(again, setup["stored"])
            i += 1
        during = writer.server.log_text()[start:]
        assert during.count("store write failed, skipping saves") == 1, during
        assert "lease write to store directory" in during, during
        assert "store read failed" not in during, during
        assert "store write works again" not in during
    finally:
        remount(writer, store, "rw")
    deadline = time.monotonic() + 150  # past the longest wait between retries
    i = 0
    while time.monotonic() < deadline:
        stored = writer.complete(prompt(f"writable-again-{i}"))
        repeat = writer.complete(prompt(f"writable-again-{i}"))
        if repeat.cached_tokens:
            assert_same_output(repeat, stored)
            break
        i += 1
        time.sleep(1)
    else:
        raise AssertionError("saves never resumed")
    after = writer.server.log_text()[start:]
    assert after.count("store write works again") == 1, after
    assert "lease writes to store directory" in after, after
    assert "store read failed" not in after, after


def store_new(writer: Engine, store: Path, tag: str) -> tuple[Answer, list[Path]]:
    """Send ``prompt(tag)`` once (a miss, stored); its answer and the two
    chunk files it added."""
    before = set(store_files(store))
    first = writer.complete(prompt(tag))
    added = [store / name for name in set(store_files(store)) - before]
    chunks = [p for p in added if "chunks" in p.parts]
    assert len(chunks) == 2, added
    return first, chunks


def recomputed_then_hit(writer: Engine, tag: str, first: Answer) -> None:
    """The next request for ``prompt(tag)`` is a miss (stored again) with
    ``first``'s output, the one after it a hit."""
    recomputed = writer.complete(prompt(tag))
    assert recomputed.cached_tokens == 0
    assert_same_output(recomputed, first)
    again = writer.complete(prompt(tag))
    assert again.cached_tokens == 2 * BLOCK
    assert_same_output(again, first)


def test_damaged_chunk_under_the_default_policy_fails_its_request(setup):
    """Under vLLM's default ``kv_load_failure_policy`` (``fail``) a chunk
    whose payload fails its digest at load fails its request (an HTTP
    error), and the log says so; the chunk is deleted, so the next request
    recomputes and stores it again."""
    writer: Engine = setup["writer"]
    first, chunks = store_new(writer, setup["store"], "damaged")
    for path in chunks:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    with pytest.raises(urllib.error.HTTPError) as failed:
        writer.complete(prompt("damaged"))
    assert failed.value.code == 500
    log = writer.server.log_text()
    assert (
        "its block fails to load and vLLM fails the request "
        "(kv_load_failure_policy 'fail'"
    ) in log
    assert "treated as a miss" not in log
    recomputed_then_hit(writer, "damaged", first)


def test_chunk_removed_by_hand_fails_at_most_the_request_that_loads_it(setup):
    """Chunk files removed by hand (an admin, tmpreaper, ``find -delete``)
    do not go through a server, so the lookup still offers them. Under the
    default policy the request whose load finds them gone fails; that load
    forgets them (one line naming a key), so the next request is a miss that
    stores them again, and the one after it a hit; ``size`` stops counting
    them."""
    writer: Engine = setup["writer"]
    store: Path = setup["store"]
    first, chunks = store_new(writer, store, "gone")
    for path in chunks:
        path.unlink()
    with pytest.raises(urllib.error.HTTPError) as failed:
        writer.complete(prompt("gone"))
    assert failed.value.code == 500
    log = writer.server.log_text()
    assert "chunk(s) gone from the store at load (" in log
    assert "their blocks fail to load and vLLM fails the request" in log
    recomputed_then_hit(writer, "gone", first)
    on_disk = sum(p.stat().st_size for p in (store / "chunks").rglob("*.0"))
    assert int((store / "size").read_text()) == on_disk

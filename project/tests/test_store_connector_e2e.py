"""StoreConnector end to end: ``vllm serve`` on the CPU build, real HTTP.

Three servers on the demo model, started together (one engine start costs
about a minute on two cores) and shared by the tests of this module:

* ``dir``: directory backend with a small cap (a few prompts' worth);
* ``redis_a`` and ``redis_b``: one Redis store; ``redis_b`` has scheduler
  lookups off, so every hit it gets is found and loaded by its workers
  (``before_update_states``), from chunks ``redis_a`` stored.

Faults: Redis stopped and hung (SIGSTOP) under ``redis_a``, a writer killed
halfway through a chunk of the ``dir`` store, and a
Redis-backed server SIGKILLed while it holds a lease or halfway through a
write (each with its own Redis and servers: one killed, then a fresh one on
the same store).

The three shared servers run on vLLM's CPU CI compile path (dynamo, see
``conftest.py``); the servers of the fault tests run eager.

The servers log which stack hooks the connector found (``stack hooks:``).
Local prefix caching is off on every server, so ``cached_tokens`` counts
only what the connector supplied. Outputs are compared with the same prompt's
first (miss) answer: identical greedy tokens, logprobs within bf16 noise. A
repeat served from a hit, with the miss's tokens and no lease left, is the
conformance kit's ``hit`` scenario (test_conformance.py), not repeated here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from conftest import REPO
from forked_cli import ForkedCli
from redis_server import RedisServer, StallProxy

sys.path.insert(0, str(REPO / "project" / "demo"))
import serve_demo  # noqa: E402
from kvlc_store import backends  # noqa: E402
from kvlc_store.backends import redis as redis_backend  # noqa: E402
from kvlc_store.chunk import decode_chunk, read_header  # noqa: E402
from make_model import make_model  # noqa: E402

BLOCK = 128  # CPU block size
# Chunk = 2 layers x 128 tokens x 1 KV head x (2 x 64) x 2 bytes + header.
CAP_BYTES = 400_000  # about 6 chunks: the fourth 2-chunk prompt evicts

# The line of a read outage; it names the operation that failed first when
# that was not a plain read (a lease is a read that writes).
READ_OUTAGE = re.compile(r"store read(?: \([a-z ]+\))? failed, running on misses")


def prompt(tag: str) -> str:
    """About 370 tokens (two full blocks to store) that differ from the
    first token on, so every tag has its own block hashes."""
    return f"{tag} says: " + serve_demo.PROMPT


@dataclass
class Answer:
    token_ids: list[int]
    logprobs: list[float]
    prompt_tokens: int
    cached_tokens: int


class Engine:
    def __init__(self, name: str, server: serve_demo.Server, port: int) -> None:
        self.name = name
        self.server = server
        self.url = f"http://127.0.0.1:{port}"

    def complete(self, text: str | list[int]) -> Answer:
        body = {
            "model": serve_demo.SERVED_NAME,
            "prompt": text,
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": 1,
            "return_token_ids": True,
        }
        reply = json.loads(serve_demo.http(f"{self.url}/v1/completions", body))
        choice = reply["choices"][0]
        usage = reply["usage"]
        return Answer(
            token_ids=choice["token_ids"],
            logprobs=choice["logprobs"]["token_logprobs"],
            prompt_tokens=usage["prompt_tokens"],
            cached_tokens=(usage.get("prompt_tokens_details") or {}).get(
                "cached_tokens"
            )
            or 0,
        )

    def tokenize(self, text: str) -> list[int]:
        body = {"model": serve_demo.SERVED_NAME, "prompt": text}
        tokens: list[int] = json.loads(serve_demo.http(f"{self.url}/tokenize", body))[
            "tokens"
        ]
        return tokens

    def metric(self, name: str) -> float:
        text = serve_demo.http(f"{self.url}/metrics")
        value = serve_demo.metric_sum(text, name)
        assert value is not None, f"{name} missing from /metrics of {self.name}"
        return value

    def store_metrics(self) -> dict[str, float]:
        text = serve_demo.http(f"{self.url}/metrics")
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:kvlc_store_"):
                name = line.split("{", 1)[0].split(" ", 1)[0]
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out


def kv_config(extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": "StoreConnector",
        "kv_connector_module_path": "kvlc_store",
        "kv_role": "kv_both",
        # A chunk that fails its checksum at load: recompute its blocks.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


@pytest.fixture(scope="module")
def setup(
    tmp_path_factory: pytest.TempPathFactory, forked_cli: ForkedCli
) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("store-e2e")
    model = make_model(root / "model")
    redis = RedisServer(root / "redis")
    redis.start()
    configs = {
        "dir": {
            "path": str(root / "store"),
            "capacity": CAP_BYTES,
            # vLLM's own key: with the external-match lifecycle installed, a
            # runtime checker raises on any broken prepare/commit/abort
            # guarantee; older builds ignore it.
            "check_external_match_lifecycle": True,
        },
        "redis_a": {
            "backend": "redis",
            "redis_url": redis.url,
            "check_external_match_lifecycle": True,
            # Far above a request's time on a loaded machine, so a request
            # that waits it out stands out (test_hung_redis_...).
            "redis_timeout_s": 5,
        },
        "redis_b": {
            "backend": "redis",
            "redis_url": redis.url,
            "scheduler_lookup": False,
            "redis_timeout_s": 0.5,
        },
    }
    engines: dict[str, Engine] = {}
    try:
        for name, extra in configs.items():
            port = serve_demo.free_port()
            command = serve_demo.server_command(model, port, kv_config(extra))
            server = serve_demo.Server(
                command,
                serve_demo.server_env(),
                root / f"{name}.log",
                forked_cli.starter(command),
            )
            engines[name] = Engine(name, server, port)
        for engine in engines.values():
            engine.server.wait_healthy(engine.url, timeout=600)
        yield {"root": root, "redis": redis, **engines}
    finally:
        for engine in engines.values():
            engine.server.stop()
        redis.stop()


# Requests served together decode in one batch, which bf16 rounds otherwise
# than one request alone: up to 0.06 seen in a burst of four. KV of another
# prompt changes the tokens and moves logprobs by about 2.5 (measured in
# test_before_update_states_e2e.py).
BATCH_NOISE = 0.2


def assert_same_output(hit: Answer, miss: Answer, noise: float = 1e-2) -> None:
    assert hit.token_ids == miss.token_ids
    # A hit prefills fewer tokens in one step, so kernels split the work
    # differently: bf16 noise, far below any real difference.
    assert hit.logprobs == pytest.approx(miss.logprobs, abs=noise)


def repeats_at_once(engine: Engine, texts: list[str]) -> dict[str, float]:
    """Store ``texts`` one after the other (misses), then send their repeats
    all at once: each hits both full blocks before its last token and gives
    its miss's output. Returns how much each store metric grew over the
    repeats (gauges as they are after them)."""
    misses = [engine.complete(t) for t in texts]
    before = engine.store_metrics()
    with ThreadPoolExecutor(len(texts)) as pool:
        hits = list(pool.map(engine.complete, texts))
    after = engine.store_metrics()
    for hit, miss in zip(hits, misses, strict=True):
        assert miss.cached_tokens == 0
        assert hit.cached_tokens == 2 * BLOCK
        # The misses ran alone, the hits together.
        assert_same_output(hit, miss, noise=BATCH_NOISE)
    grew = {name: value - before.get(name, 0.0) for name, value in after.items()}
    grew["vllm:kvlc_store_leases_open"] = after["vllm:kvlc_store_leases_open"]
    return grew


def test_corrupt_payload_fails_at_load_and_is_recomputed(setup):
    """A lookup checks headers only, so a flipped payload byte is offered,
    fails its digest at load, and vLLM recomputes the blocks from the first
    damaged one (``kv_load_failure_policy: recompute``): same output."""
    engine: Engine = setup["dir"]
    miss = engine.complete(prompt("beta"))
    chunks = sorted((setup["root"] / "store" / "chunks").rglob("*.0"))
    beta = [p for p in chunks if engine_chunk_holds(p)]
    assert beta, "no chunk stored"
    before = engine.store_metrics()
    for path in chunks:  # flip one payload byte of every stored chunk
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    again = engine.complete(prompt("beta"))
    assert_same_output(again, miss)
    metrics = engine.store_metrics()
    for name in ("corrupt_chunks", "load_errors"):
        name = f"vllm:kvlc_store_{name}_total"
        assert metrics[name] > before.get(name, 0), name
    assert metrics["vllm:kvlc_store_leases_open"] == 0
    assert "unusable (checksum mismatch)" in engine.server.log_text()
    # The corrupt chunks were dropped and the recomputed blocks stored again.
    third = engine.complete(prompt("beta"))
    assert third.cached_tokens == 2 * BLOCK
    assert_same_output(third, miss)


def engine_chunk_holds(path: Path) -> bool:
    header, _ = read_header(path.read_bytes())
    return bool(header.get("key"))


def test_store_cap_evicts_and_keeps_answering(setup):
    engine: Engine = setup["dir"]
    first = engine.complete(prompt("gamma-0"))
    for i in range(1, 5):
        engine.complete(prompt(f"gamma-{i}"))
        time.sleep(0.05)
    metrics = engine.store_metrics()
    assert metrics["vllm:kvlc_store_evictions_total"] > 0
    size = sum(
        p.stat().st_size for p in (setup["root"] / "store" / "chunks").rglob("*.0")
    )
    assert size <= CAP_BYTES
    again = engine.complete(prompt("gamma-0"))  # evicted long ago: a miss
    assert again.cached_tokens == 0
    assert_same_output(again, first)
    assert engine.store_metrics()["vllm:kvlc_store_leases_open"] == 0


@pytest.mark.parametrize("name", ["dir", "redis_a"])
def test_prompt_of_whole_blocks_hits_all_but_its_last_token(setup, name):
    """A prompt of exactly three blocks: the third block is stored and
    loaded whole, the hit reports every token but the last (which vLLM
    computes to sample from), and the greedy output is the miss's."""
    engine: Engine = setup[name]
    ids = engine.tokenize(prompt(f"theta-{name}") * 2)[: 3 * BLOCK]
    miss = engine.complete(ids)
    hit = engine.complete(ids)
    assert miss.cached_tokens == 0
    assert hit.prompt_tokens == 3 * BLOCK
    assert hit.cached_tokens == 3 * BLOCK - 1
    assert hit.token_ids == miss.token_ids
    # The hit computes the last prompt token alone (a one-token prefill,
    # where the miss ran 384), so bf16 rounds it differently: the first
    # logprob differed by 0.001-0.028 on a Xeon with AMX (other kernels for
    # a one-row and a 384-row matmul), and by 4e-6 at most with the servers
    # in float32 (the load itself is exact).
    assert hit.logprobs == pytest.approx(miss.logprobs, abs=5e-2)
    assert engine.store_metrics()["vllm:kvlc_store_leases_open"] == 0


def test_store_deleted_while_serving_keeps_answering(setup):
    engine: Engine = setup["dir"]
    first = engine.complete(prompt("zeta"))
    shutil.rmtree(setup["root"] / "store")
    # The scheduler's lookup used to fail on the store's .lock: an HTTP 500,
    # and the server exited.
    again = engine.complete(prompt("zeta"))
    assert again.cached_tokens == 0
    assert_same_output(again, first)
    assert "was missing (deleted?); recreated it empty" in engine.server.log_text()
    third = engine.complete(prompt("zeta"))  # stored again in the new store
    assert third.cached_tokens == 2 * BLOCK
    assert_same_output(third, first)


def test_second_server_hits_what_the_first_stored_through_its_workers(setup):
    a: Engine = setup["redis_a"]
    b: Engine = setup["redis_b"]
    stored = a.complete(prompt("delta"))
    repeat_a = a.complete(prompt("delta"))
    assert repeat_a.cached_tokens == 2 * BLOCK
    assert_same_output(repeat_a, stored)
    # redis_b never looked this prompt up when scheduling: its workers
    # find the chunks redis_a stored and report them (before_update_states).
    from_b = b.complete(prompt("delta"))
    assert from_b.cached_tokens == 2 * BLOCK
    assert_same_output(from_b, stored)
    metrics = b.store_metrics()
    assert metrics["vllm:kvlc_store_worker_hit_tokens_total"] == 2 * BLOCK
    assert metrics.get("vllm:kvlc_store_lookups_total", 0) == 0


def test_redis_down_means_misses_not_errors(setup):
    a: Engine = setup["redis_a"]
    redis: RedisServer = setup["redis"]
    reference = a.complete(prompt("epsilon"))
    redis.stop()
    try:
        down = a.complete(prompt("epsilon"))
        assert down.cached_tokens == 0
        assert_same_output(down, reference)
        assert a.store_metrics()["vllm:kvlc_store_store_errors_total"] > 0
        assert READ_OUTAGE.search(a.server.log_text())
    finally:
        redis.start()  # same port, empty
    # The connector skips the store for a few seconds after a failure, then
    # stores the prompt again and hits it.
    back = first_hit(a, prompt("epsilon"), time.monotonic() + 60)
    assert back.cached_tokens == 2 * BLOCK
    assert_same_output(back, reference)


def first_hit(engine: Engine, text: str, deadline: float) -> Answer:
    """Send ``text`` once a second until an answer comes from the store or
    ``deadline`` (a time.monotonic()) passes; the last answer."""
    while True:
        answer = engine.complete(text)
        if answer.cached_tokens or time.monotonic() >= deadline:
            return answer
        time.sleep(1)


def test_hung_redis_is_skipped_then_retried_until_it_answers(setup):
    """Redis stopped (SIGSTOP: connections are accepted, nothing answers):
    after the first timeouts the connector skips the store, so requests are
    plain misses at full speed instead of each waiting out
    ``redis_timeout_s`` (5 s here, several times per request); it retries
    at growing intervals, says so once, and hits again once Redis answers."""
    a: Engine = setup["redis_a"]
    redis: RedisServer = setup["redis"]
    reference = a.complete(prompt("eta"))
    start = len(a.server.log_text())
    assert redis.proc is not None
    redis.proc.send_signal(signal.SIGSTOP)
    seconds: list[float] = []
    try:
        deadline = time.monotonic() + 20
        i = 0
        while time.monotonic() < deadline:
            began = time.monotonic()
            down = a.complete(prompt("eta") if i % 2 else prompt(f"eta-hung-{i}"))
            seconds.append(time.monotonic() - began)
            assert down.cached_tokens == 0
            if i % 2:
                assert_same_output(down, reference)
            i += 1
        during = a.server.log_text()[start:]
    finally:
        redis.proc.send_signal(signal.SIGCONT)
    # The first request waits out the 5 s timeout of the scheduler's lookup
    # and of the workers'; then the store is skipped for 20 s (4 timeouts)
    # and requests take what a miss takes. Before the backoff every request
    # waited out two or three timeouts.
    fast = [s for s in seconds if s < 5]
    assert len(fast) >= 3 and len(fast) > len(seconds) - len(fast), seconds
    assert len(READ_OUTAGE.findall(during)) == 1, during
    assert "store read works again" not in during
    deadline = time.monotonic() + 120  # past the longest wait between retries
    back = first_hit(a, prompt("eta"), deadline)
    assert back.cached_tokens == 2 * BLOCK
    assert_same_output(back, reference)
    # Saves resume once the workers' own wait is over too.
    while time.monotonic() < deadline:
        stored = a.complete(prompt(f"eta-after-{i}"))
        if a.complete(prompt(f"eta-after-{i}")).cached_tokens:
            break
        i += 1
        time.sleep(1)
    again = a.complete(prompt(f"eta-after-{i}"))
    assert stored.cached_tokens == 0 and again.cached_tokens >= 2 * BLOCK
    assert_same_output(again, stored)
    after = a.server.log_text()[start:]
    assert after.count("store read works again") == 1, after
    # Saves stopped with the failed reads: no outage of their own to end.
    assert after.count("store write failed") == after.count("store write works again")


# -- a server killed mid-work ---------------------------------------------

NAMESPACE = "kvlc"  # the connector's default Redis namespace
LEASE_TTL_S = 15.0  # longer than a kill takes, shorter than an engine start


def start_engine(
    cli: ForkedCli, name: str, model: Path, root: Path, extra: dict[str, Any]
) -> Engine:
    port = serve_demo.free_port()
    command = serve_demo.server_command(model, port, kv_config(extra), eager=True)
    log = root / f"{name}.log"
    server = serve_demo.Server(
        command, serve_demo.server_env(), log, cli.starter(command)
    )
    return Engine(name, server, port)


def kill_group(server: serve_demo.Server) -> None:
    """SIGKILL the server's whole process group (API server, EngineCore,
    workers) at once, as a machine losing power would, and wait until no
    process of the group is left."""
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(server.proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError("processes of the killed server are still running")


def redis_chunks(client: redis_lib.Redis) -> dict[str, bytes]:
    """Every stored chunk, by connector key."""
    prefix = f"{NAMESPACE}:c:"
    out: dict[str, bytes] = {}
    for name in client.scan_iter(match=f"{prefix}*"):
        value = client.get(name)
        if isinstance(value, bytes):
            out[name.decode()[len(prefix) :]] = value
    return out


def decode_stored(key: str, data: bytes) -> None:
    """Check the whole chunk ``key`` a server stored (ChunkError on a partial
    one), and that the scheduler keyed it by the KV layout its workers wrote
    it under (their handshake metadata reached it)."""
    header, _ = read_header(data)
    identity, layout = str(header["identity"]), str(header["layout"])
    assert key.split("/", 1)[0] == f"{identity}-{layout}"
    decode_chunk(data, identity, key, layout)


def assert_every_chunk_decodes(chunks: dict[str, bytes]) -> None:
    for key, data in chunks.items():
        decode_stored(key, data)


def open_leases(client: redis_lib.Redis) -> dict[str, int]:
    """Connector key -> number of unexpired leases on it, by Redis's clock
    (the one the connector's scripts use)."""
    seconds, micros = client.time()
    now_ms = seconds * 1000 + micros // 1000
    prefix = f"{NAMESPACE}:l:"
    out: dict[str, int] = {}
    for name in client.scan_iter(match=f"{prefix}*"):
        count = client.zcount(name, now_ms, "+inf")
        if count:
            out[name.decode()[len(prefix) :]] = count
    return out


def holds_half_a_write(client: redis_lib.Redis) -> bool:
    """Whether a connection has at least 16 KiB of a command Redis has not
    run yet (still reading it), within a few seconds."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if any(int(c["qbuf"]) >= 16 * 1024 for c in client.client_list()):
            return True
        time.sleep(0.1)
    return False


def script_sha(script: str) -> bytes:
    """What redis-py sends with EVALSHA to run ``script``."""
    return hashlib.sha1(script.encode()).hexdigest().encode()


@pytest.mark.parametrize("fault", ["holding_a_lease", "halfway_through_a_put"])
def test_redis_server_killed(fault: str, tmp_path: Path, forked_cli: ForkedCli) -> None:
    """A server is SIGKILLed at a point the test picks by stalling one Redis
    command (``StallProxy``):

    * ``holding_a_lease``: between leasing the chunks of a hit and releasing
      them (the worker's release never reaches Redis);
    * ``halfway_through_a_put``: while storing a new prompt, with half of the
      first chunk's write in Redis's input buffer.

    The store stays whole and readable, a lease of the dead server expires
    after ``lease_ttl_s`` and then no longer protects its chunks from
    eviction, and a fresh server on the same store answers from it."""
    model = make_model(tmp_path / "model")
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    proxy = StallProxy(redis.port)
    client = redis_lib.Redis.from_url(redis.url)
    doomed = start_engine(
        forked_cli,
        "doomed",
        model,
        tmp_path,
        {
            "backend": "redis",
            "redis_url": proxy.url,
            "lease_ttl_s": LEASE_TTL_S,
            "redis_timeout_s": 120,  # stalled, not timed out, when killed
        },
    )
    fresh: Engine | None = None
    try:
        doomed.server.wait_healthy(doomed.url, timeout=600)
        miss = doomed.complete(prompt("zeta"))
        assert miss.cached_tokens == 0
        stored = redis_chunks(client)
        assert len(stored) == 2
        assert not open_leases(client)

        armed_at = time.monotonic()
        if fault == "holding_a_lease":
            # A hit: the worker releases the lease right after loading.
            proxy.stall_on(script_sha(redis_backend._LUA_RELEASE))
            doomed_prompt = prompt("zeta")
        else:
            # A miss: the worker writes the first of its chunks (~65 KB).
            proxy.stall_on(script_sha(redis_backend._LUA_PUT), forward=32 * 1024)
            doomed_prompt = prompt("theta")
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(doomed.complete, doomed_prompt)
            assert proxy.stalled.wait(120), f"no {fault} to stall"
            stalled_at = time.monotonic()
            leased = open_leases(client)
            if fault == "halfway_through_a_put":
                assert holds_half_a_write(client), "Redis got no partial write"
            kill_group(doomed.server)
            with pytest.raises(OSError):  # the connection dies with the server
                pending.result(timeout=60)
        proxy.close()
        if fault == "holding_a_lease":
            assert leased == dict.fromkeys(stored, 1)
        else:
            assert leased == {}

        # What the dead server left: the whole chunks it stored (the cut
        # write is not one of them), a byte count that matches them, and
        # its lease if it held one.
        left = redis_chunks(client)
        assert left == stored
        assert_every_chunk_decodes(left)
        assert int(client.get(f"{NAMESPACE}:bytes") or 0) == sum(
            len(v) for v in left.values()
        )
        assert open_leases(client) == leased

        fresh = start_engine(
            forked_cli,
            "fresh",
            model,
            tmp_path,
            {"backend": "redis", "redis_url": redis.url},
        )
        while open_leases(client) and time.monotonic() < stalled_at + LEASE_TTL_S + 5:
            time.sleep(0.2)
        expired_at = time.monotonic()
        assert not open_leases(client), "the dead server's lease never expired"
        if leased:
            # Not early either: the lease was taken after the proxy was armed.
            assert expired_at - armed_at >= LEASE_TTL_S - 0.5
        assert not list(client.scan_iter(match=f"{NAMESPACE}:l:*"))

        fresh.server.wait_healthy(fresh.url, timeout=600)
        hit = fresh.complete(prompt("zeta"))
        assert hit.cached_tokens == 2 * BLOCK
        assert_same_output(hit, miss)
        if fault == "halfway_through_a_put":
            # Never stored: a miss, stored now, then a hit.
            theta = fresh.complete(prompt("theta"))
            assert theta.cached_tokens == 0
            theta_hit = fresh.complete(prompt("theta"))
            assert theta_hit.cached_tokens == 2 * BLOCK
            assert_same_output(theta_hit, theta)
        metrics = fresh.store_metrics()
        assert metrics["vllm:kvlc_store_leases_open"] == 0
        for name in ("corrupt_chunks", "load_errors", "store_errors"):
            assert metrics.get(f"vllm:kvlc_store_{name}_total", 0) == 0, name
        assert not open_leases(client)

        # Nothing protects the dead server's chunks any more: a write over a
        # one-byte cap evicts every unleased chunk, theirs included.
        chunks = redis_chunks(client)
        identity = next(iter(stored)).split("/", 1)[0]
        backend = backends.RedisBackend(redis.url, NAMESPACE, capacity_bytes=1)
        assert backend.put(f"{identity}/{'0' * 64}.0", b"x") == len(chunks) + 1
        backend.close()
        assert not redis_chunks(client)
        again = fresh.complete(prompt("zeta"))
        assert again.cached_tokens == 0
        assert_same_output(again, miss)
        assert fresh.store_metrics()["vllm:kvlc_store_leases_open"] == 0
    finally:
        proxy.close()
        doomed.server.stop()
        if fresh is not None:
            fresh.server.stop()
        client.close()
        redis.stop()


# A process that dies halfway through writing a chunk: os.write puts half of
# what it is given on disk, then the process SIGKILLs itself.
CRASHING_PUT = """
import os, signal, sys
from pathlib import Path
from kvlc_store.backends import DirectoryBackend

real_write = os.write

def write_half_and_die(fd, buffers):
    data = b"".join(buffers)
    real_write(fd, data[: len(data) // 2])
    os.kill(os.getpid(), signal.SIGKILL)

os.writev = write_half_and_die
root, key, chunk = sys.argv[1:]
DirectoryBackend(Path(root), 1 << 30).put(key, Path(chunk).read_bytes())
"""


def dir_chunks(store: Path) -> dict[str, Path]:
    """Every file under chunks/, by the connector key its path stands for."""
    chunks = store / "chunks"
    return {
        f"{p.relative_to(chunks).parts[0]}/{p.name}": p
        for p in chunks.rglob("*")
        if p.is_file()
    }


def test_directory_write_killed_midway_leaves_no_readable_chunk(
    setup: dict[str, Any], tmp_path: Path
) -> None:
    """A writer killed halfway through a chunk leaves a partial file in tmp/
    only: no chunk path ever holds it, the server treats the block as a miss
    (not a corrupt chunk) and stores it again, and the next backend to open
    the store removes the leftover once it is old enough not to be a live
    write."""
    engine: Engine = setup["dir"]
    store: Path = setup["root"] / "store"
    before = set(dir_chunks(store))
    miss = engine.complete(prompt("eta"))
    new = sorted(set(dir_chunks(store)) - before)
    assert len(new) == 2
    # Rewrite one of the prompt's chunks with a writer that dies midway.
    key = new[0]
    path = dir_chunks(store)[key]
    copy = tmp_path / "chunk"
    copy.write_bytes(path.read_bytes())
    backends.DirectoryBackend(store, CAP_BYTES).delete(key)
    leftovers_before = set((store / "tmp").iterdir())
    crashed = subprocess.run(
        [sys.executable, "-c", CRASHING_PUT, str(store), key, str(copy)],
        env=serve_demo.server_env(),
        check=False,
    )
    assert crashed.returncode == -signal.SIGKILL
    assert not path.exists()
    partial = set((store / "tmp").iterdir()) - leftovers_before
    assert len(partial) == 1
    (part,) = partial
    assert 0 < part.stat().st_size < copy.stat().st_size
    for k, p in dir_chunks(store).items():
        decode_stored(k, p.read_bytes())

    corrupt_before = engine.store_metrics().get(
        "vllm:kvlc_store_corrupt_chunks_total", 0
    )
    again = engine.complete(prompt("eta"))
    # Which block's chunk was rewritten is unknown here (keys are hashes):
    # without the first block the lookup finds nothing, without the second
    # it finds one block.
    assert again.cached_tokens in (0, BLOCK)
    assert_same_output(again, miss)
    metrics = engine.store_metrics()
    assert metrics.get("vllm:kvlc_store_corrupt_chunks_total", 0) == corrupt_before
    assert metrics["vllm:kvlc_store_leases_open"] == 0
    third = engine.complete(prompt("eta"))  # the block was stored again
    assert third.cached_tokens == 2 * BLOCK
    assert_same_output(third, miss)

    old = time.time() - 3600
    os.utime(part, (old, old))
    backends.DirectoryBackend(store, CAP_BYTES)
    assert not part.exists()

"""``./wb bench --ttft``: time to first token of a repeated long prompt, served
from each external KV cache, against recomputing it and against the bytes-moved
floor.

One run serves a random-weight model with Qwen2.5-0.5B's shape
(``bench_model.py``, generated once into build/bench-model-qwen2.5-0.5b-shape)
with local prefix caching off, once per system:

* ``recompute``: no connector (the patched build, ``.venv``);
* ``store-dir`` / ``store-redis``: the reference ``StoreConnector``
  (``project/connector``) on a directory store / on a local ``redis-server``;
* ``mooncake``: ``MooncakeStoreConnector`` with a local ``mooncake_master``;
* ``lmcache``: ``LMCacheMPConnector`` with LMCache's multiprocess server
  (build/venv-lmcache: the patched vLLM and lmcache).

Each system gets its own random 4096-token prompt (sent as token ids), after
one warm-up request of another prompt: the first request is a cold miss that
stores, the repeats should hit. TTFT is the time to the first streamed chunk
of a ``max_tokens=1`` completion. A repeat that reports no cached tokens is a
failed measurement, printed as such and never counted as a hit.

The floor is the KV bytes of the cached prefix over this machine's measured
memcpy bandwidth (``memcpy_bandwidth.py``); the compute of the uncached tail
is estimated as the recompute TTFT of a prompt of the tail's length.

Writes ``project/docs/ttft.md``, ``ttft.png`` and ``ttft.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "project"))
sys.path.insert(0, str(ROOT / "project" / "demo"))
sys.path.insert(0, str(ROOT / "project" / "tests"))

from redis_server import RedisServer  # noqa: E402
from serve_demo import Server, free_port, server_env  # noqa: E402
from workbench import devenv  # noqa: E402

DOCS = ROOT / "project" / "docs"
COMMAND = "./wb bench --ttft"
MODEL_DIR = ROOT / "build" / "bench-model-qwen2.5-0.5b-shape"
SERVED = "bench"
BLOCK_SIZE = 128  # vLLM's CPU block size: connectors move whole blocks.
PROMPT_TOKENS = 4096
# The first request after start-up pays one-time costs (on the demo model: 1.1 s
# for 16 tokens, then 0.2 s); four blocks also take each connector through
# its store and lookup paths once.
WARMUP_TOKENS = 512
MAX_MODEL_LEN = 4608
# The demo tokenizer's ids (bench_model.py): vLLM rejects prompt ids past the
# tokenizer's vocabulary. The first three are its special tokens.
TOKEN_IDS = range(3, 512)
SYSTEMS = ("store-dir", "store-redis", "mooncake", "lmcache", "recompute")
PEERS = ("mooncake", "lmcache")
OURS = ("store-dir", "store-redis")
SPEEDUP_TARGET = 10.0
DTYPE_SIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def step(message: str) -> None:
    print(f"[ttft] {message}", flush=True)


def prompt(seed: int, length: int = PROMPT_TOKENS) -> list[int]:
    """Random token ids, a different sequence for every seed."""
    rng = random.Random(seed)
    return [rng.choice(TOKEN_IDS) for _ in range(length)]


@dataclass
class Shot:
    """One streamed request."""

    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


def first_token(base_url: str, token_ids: list[int]) -> Shot:
    """Stream a one-token completion of ``token_ids``; time its first chunk."""
    body = json.dumps(
        {
            "model": SERVED,
            "prompt": token_ids,
            "max_tokens": 1,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    request = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    ttft: float | None = None
    usage: dict[str, Any] = {}
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[len(b"data: ") :])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                usage = chunk["usage"]
    if ttft is None or not usage:
        raise RuntimeError(f"stream without a token or usage: {usage}")
    details = usage.get("prompt_tokens_details") or {}
    return Shot(
        ttft, int(usage["prompt_tokens"]), int(details.get("cached_tokens") or 0)
    )


@dataclass
class System:
    """How to serve one system: interpreter, connector config, environment."""

    name: str
    python: Path
    kv_config: dict[str, Any] | None
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Result:
    name: str
    warmup: Shot
    miss: Shot
    hits: list[Shot]
    tails: dict[int, list[Shot]] = field(default_factory=dict)
    startup_s: float = 0.0
    load_before: float = 0.0
    load_after: float = 0.0


def serve_command(system: System, model: Path, port: int, dtype: str) -> list[str]:
    command = [str(system.python.parent / "vllm"), "serve", str(model)]
    command += [
        "--host", "127.0.0.1",
        "--port", str(port),
        "--served-model-name", SERVED,
        "--dtype", dtype,
        "--max-model-len", str(MAX_MODEL_LEN),
        # Only the connector can then supply cached tokens.
        "--no-enable-prefix-caching",
        "--enable-prompt-tokens-details",
    ]  # fmt: skip
    if system.kv_config is not None:
        command += ["--kv-transfer-config", json.dumps(system.kv_config)]
    return command


def wait_port(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not listen on {port} in 60 s")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group ``proc`` leads, SIGKILL it after 10 s."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def daemon(
    command: list[str], log: Path, port: int, what: str
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``command`` in its own process group until the block ends."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_port(port, proc, what)
            yield proc
        finally:
            stop_process(proc)


@contextlib.contextmanager
def backing_service(name: str, scratch: Path, python: Path) -> Iterator[System]:
    """Start what ``name`` needs besides vLLM; yield how to serve it."""
    scratch.mkdir(parents=True, exist_ok=True)
    if name == "recompute":
        yield System(name, python, None)
    elif name == "store-dir":
        yield System(
            name,
            python,
            {
                "kv_connector": "StoreConnector",
                "kv_connector_module_path": "kvlc_store",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"path": str(scratch / "kv-store")},
            },
        )
    elif name == "store-redis":
        redis = RedisServer(scratch / "redis")
        redis.start()
        try:
            yield System(
                name,
                python,
                {
                    "kv_connector": "StoreConnector",
                    "kv_connector_module_path": "kvlc_store",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {
                        "backend": "redis",
                        "redis_url": redis.url,
                    },
                },
            )
        finally:
            redis.stop()
    elif name == "mooncake":
        master = python.parent / "mooncake_master"
        http_port, rpc_port, metrics_port = (free_port() for _ in range(3))
        command = [
            str(master),
            "-enable_http_metadata_server=true",
            f"-http_metadata_server_port={http_port}",
            "-http_metadata_server_host=127.0.0.1",
            f"-rpc_port={rpc_port}",
            f"-metrics_port={metrics_port}",
        ]
        log = scratch / "mooncake_master.log"
        with daemon(command, log, rpc_port, "mooncake_master") as proc:
            wait_port(http_port, proc, "mooncake_master's metadata server")
            config = scratch / "mooncake.json"
            config.write_text(
                json.dumps(
                    {
                        "metadata_server": f"http://127.0.0.1:{http_port}/metadata",
                        "master_server_address": f"127.0.0.1:{rpc_port}",
                        "protocol": "tcp",
                        "device_name": "",
                        "global_segment_size": "512MB",
                        "local_buffer_size": "128MB",
                    }
                )
            )
            yield System(
                name,
                python,
                {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"},
                {"MOONCAKE_CONFIG_PATH": str(config)},
            )
    elif name == "lmcache":
        # Started here rather than auto-started by the connector: the
        # auto-started server outlives vLLM, this one is ours to stop.
        port, http_port = free_port(), free_port()
        command = [
            str(python),
            "-m", "lmcache.v1.multiprocess.http_server",
            "--host", "127.0.0.1",
            "--port", str(port),
            "--http-host", "127.0.0.1",
            "--http-port", str(http_port),
            "--l1-size-gb", "1",
            "--eviction-policy", "LRU",
            "--chunk-size", str(BLOCK_SIZE),
            "--max-workers", "1",
            "--supported-transfer-mode", "auto",
        ]  # fmt: skip
        with daemon(command, scratch / "lmcache-server.log", port, "LMCache"):
            yield System(
                name,
                python,
                {
                    "kv_connector": "LMCacheMPConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {
                        "lmcache.mp.host": "tcp://127.0.0.1",
                        "lmcache.mp.port": port,
                    },
                },
            )
    else:
        raise ValueError(name)


def loadavg() -> float:
    return os.getloadavg()[0]


def measure(
    system: System,
    scratch: Path,
    seed: int,
    repeats: int,
    dtype: str,
    tail_lengths: Sequence[int] = (),
) -> Result:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    env = {**server_env(), **system.env}
    command = serve_command(system, MODEL_DIR, port, dtype)
    step(f"{system.name}: {' '.join(command[1:3])} ... {json.dumps(system.kv_config)}")
    load_before = loadavg()
    server = Server(command, env, scratch / f"{system.name}.log")
    try:
        startup = server.wait_healthy(base_url, timeout=600)
        warmup = first_token(base_url, prompt(seed + 1000, WARMUP_TOKENS))
        miss = first_token(base_url, prompt(seed))
        step(
            f"{system.name}: started in {startup:.0f} s, warm-up {warmup.ttft_s:.3f} s"
        )
        step(f"{system.name}: miss {miss.ttft_s:.3f} s, cached {miss.cached_tokens}")
        # Mooncake and LMCache store after the reply: let the store land.
        time.sleep(1)
        hits = []
        for _ in range(repeats):
            shot = first_token(base_url, prompt(seed))
            hits.append(shot)
            word = "hit" if system.kv_config is None or shot.cached_tokens else "MISS"
            step(
                f"{system.name}: {word} {shot.ttft_s:.3f} s, "
                f"cached {shot.cached_tokens}/{shot.prompt_tokens}"
            )
        tails = {
            n: [
                first_token(base_url, prompt(seed + 2000 + i, n))
                for i in range(repeats)
            ]
            for n in tail_lengths
        }
        for n, shots in tails.items():
            step(
                f"{system.name}: {n}-token prompt {[round(s.ttft_s, 3) for s in shots]}"
            )
    except Exception:
        step(f"{system.name} failed; last lines of {server.log_path}:")
        print(server.log_tail(), flush=True)
        raise
    finally:
        server.stop()
    return Result(
        system.name, warmup, miss, hits, tails, startup, load_before, loadavg()
    )


def memcpy(python: Path, size: int) -> dict[str, Any]:
    done = subprocess.run(
        [str(python), str(HERE / "memcpy_bandwidth.py"), str(size)],
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def kv_bytes_per_token(model: Path, dtype: str) -> int:
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or (
        config["hidden_size"] // config["num_attention_heads"]
    )
    per_token: int = (
        config["num_hidden_layers"]
        * 2
        * config["num_key_value_heads"]
        * head_dim
        * DTYPE_SIZE[dtype]
    )
    return per_token


def machine() -> str:
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu}, {os.cpu_count()} cores"


def vllm_version(python: Path) -> str:
    done = subprocess.run(
        [str(python), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() or "unknown"


def med(shots: Sequence[Shot]) -> float:
    return statistics.median(s.ttft_s for s in shots)


def analyse(
    results: dict[str, Result], per_token: int, bandwidth: dict[str, Any]
) -> dict[str, Any]:
    recompute = results["recompute"]
    recompute_s = med(recompute.hits)
    rows: dict[str, Any] = {}
    for name, r in results.items():
        times = [s.ttft_s for s in r.hits]
        row: dict[str, Any] = {
            "miss_s": r.miss.ttft_s,
            "warmup_s": r.warmup.ttft_s,
            "hit_median_s": statistics.median(times),
            "hit_min_s": min(times),
            "hit_max_s": max(times),
            "hit_s": times,
            "cached_tokens": [s.cached_tokens for s in r.hits],
            "prompt_tokens": r.miss.prompt_tokens,
            "startup_s": r.startup_s,
            "load_before": r.load_before,
            "load_after": r.load_after,
        }
        if name != "recompute":
            cached = [s.cached_tokens for s in r.hits]
            row["failed_hits"] = sum(1 for c in cached if c == 0)
            row["speedup"] = recompute_s / row["hit_median_s"]
            good = [c for c in cached if c > 0]
            if good:
                n = statistics.median(good)
                floor = n * per_token / (bandwidth["gbps"] * 1e9)
                tail = PROMPT_TOKENS - int(n)
                tail_s = med(recompute.tails[tail]) if tail in recompute.tails else None
                row["floor_s"] = floor
                row["tail_tokens"] = tail
                row["tail_compute_s"] = tail_s
                row["hit_over_floor"] = row["hit_median_s"] / floor
                if tail_s is not None:
                    row["hit_over_floor_plus_tail"] = row["hit_median_s"] / (
                        floor + tail_s
                    )
        rows[name] = row
    return {"recompute_s": recompute_s, "rows": rows}


def goals(analysis: dict[str, Any]) -> list[str]:
    rows = analysis["rows"]
    lines = []
    peers = {p: rows[p]["hit_median_s"] for p in PEERS if p in rows}
    for name in OURS:
        if name not in rows:
            continue
        row = rows[name]
        if row["failed_hits"]:
            lines.append(
                f"- `{name}`: **missed**: {row['failed_hits']} of "
                f"{len(row['hit_s'])} repeats got no cached tokens"
            )
            continue
        speed = "met" if row["speedup"] >= SPEEDUP_TARGET else "**missed**"
        lines.append(
            f"- `{name}` ≥{SPEEDUP_TARGET:.0f}x faster than recompute: {speed} "
            f"({row['speedup']:.1f}x: {row['hit_median_s'] * 1e3:.0f} ms vs "
            f"{analysis['recompute_s'] * 1e3:.0f} ms)"
        )
        for peer, peer_s in peers.items():
            ok = "met" if row["hit_median_s"] < peer_s else "**missed**"
            lines.append(
                f"- `{name}` ahead of `{peer}`: {ok} ({row['hit_median_s'] * 1e3:.0f}"
                f" ms vs {peer_s * 1e3:.0f} ms, ratio "
                f"{row['hit_median_s'] / peer_s:.2f})"
            )
    return lines


def plot(analysis: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = analysis["rows"]
    names = list(rows)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    xs = range(len(names))
    miss = [rows[n]["miss_s"] * 1e3 for n in names]
    hit = [rows[n]["hit_median_s"] * 1e3 for n in names]
    err = [
        [rows[n]["hit_median_s"] * 1e3 - rows[n]["hit_min_s"] * 1e3 for n in names],
        [rows[n]["hit_max_s"] * 1e3 - rows[n]["hit_median_s"] * 1e3 for n in names],
    ]
    ax.bar([x - 0.2 for x in xs], miss, 0.4, label="first request (miss)")
    ax.bar([x + 0.2 for x in xs], hit, 0.4, yerr=err, capsize=3, label="repeat")
    for x, n in zip(xs, names, strict=True):
        floor = rows[n].get("floor_s")
        tail = rows[n].get("tail_compute_s")
        if floor is not None and tail is not None:
            ax.hlines(
                (floor + tail) * 1e3,
                x,
                x + 0.4,
                colors="black",
                linestyles="--",
                label="floor + tail compute" if x == 0 else None,
            )
    ax.set_yscale("log")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("TTFT ms (log)")
    ax.set_title(f"TTFT of a {PROMPT_TOKENS}-token prompt, Qwen2.5-0.5B shape, CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def report(
    analysis: dict[str, Any],
    meta: dict[str, Any],
) -> list[str]:
    rows = analysis["rows"]
    lines = [
        "# TTFT of a repeated prompt: external KV caches vs recompute",
        "",
        f"Made by `{COMMAND}` on {meta['date']}, {meta['machine']}, in "
        f"{meta['minutes']:.1f} min. vLLM {meta['vllm']} (the patched build; "
        f"LMCache: the same build with lmcache {meta['lmcache']}). Model: random "
        f"weights with Qwen2.5-0.5B's shape (Qwen2ForCausalLM, 24 layers, hidden "
        f"896, 14 heads, 2 KV heads, head_dim 64, {meta['dtype']}; "
        "`project/bench/bench_model.py`), local prefix caching off, "
        f"`--max-model-len {MAX_MODEL_LEN}`, "
        f"`VLLM_CPU_KVCACHE_SPACE={meta['kvcache_space']}`.",
        "",
        f"Each system: a {WARMUP_TOKENS}-token warm-up request, then a fresh random {PROMPT_TOKENS}-token "
        f"prompt (token ids) once (the miss, which stores it) and {meta['repeats']} "
        "times more (the hits, from 1 s after the miss). TTFT is the time to the "
        "first streamed chunk of a one-token completion. Recompute: the same "
        "prompt without a connector (every request recomputes it; its hit column "
        "is the median of the repeats).",
        "",
        "| system | miss TTFT ms | hit TTFT ms, median (range) | cached tokens "
        "| speedup vs recompute | hit / floor | hit / (floor + tail compute) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        cached = sorted(set(row["cached_tokens"]))
        if name == "recompute":
            speed = over_floor = over_tail = "-"
        else:
            speed = f"{row['speedup']:.1f}x"
            over_floor = (
                f"{row['hit_over_floor']:.0f}" if "hit_over_floor" in row else "n/a"
            )
            over_tail = (
                f"{row['hit_over_floor_plus_tail']:.2f}"
                if row.get("hit_over_floor_plus_tail") is not None
                else "n/a"
            )
            if row["failed_hits"]:
                speed = f"**{row['failed_hits']} repeats not cached**"
        lines.append(
            f"| {name} | {row['miss_s'] * 1e3:.0f} | "
            f"{row['hit_median_s'] * 1e3:.0f} ({row['hit_min_s'] * 1e3:.0f}–"
            f"{row['hit_max_s'] * 1e3:.0f}) | {', '.join(map(str, cached))} | "
            f"{speed} | {over_floor} | {over_tail} |"
        )
    bw = meta["memcpy"]
    lines += [
        "",
        f"Floor: the KV bytes of the cached prefix ({meta['kv_bytes_per_token']:,} "
        "bytes per token: layers × 2 × KV heads × head_dim × dtype size) over the "
        f"measured memcpy bandwidth, {bw['gbps']:.1f} GB/s (torch copy of a "
        f"{bw['bytes'] / 2**20:.1f} MiB buffer, median of {len(bw['seconds'])}, "
        f"`project/bench/memcpy_bandwidth.py`): "
        f"{meta['floor_ms']:.1f} ms for {meta['floor_tokens']} tokens. "
        "Tail compute: the recompute TTFT of a prompt of the uncached tail's "
        f"length ({meta['tail_ms']}).",
        "",
        "## Goals",
        "",
        *goals(analysis),
        "",
        "## Machine load",
        "",
        "The machine is shared with other sessions. 1-minute load average before "
        "each system's server started / after it stopped (2 cores; our own server "
        "adds up to about 2 while it computes):",
        "",
        "| system | load before | load after |",
        "|---|---:|---:|",
        *(
            f"| {name} | {row['load_before']:.2f} | {row['load_after']:.2f} |"
            for name, row in rows.items()
        ),
        "",
        meta["load_note"],
        "",
        "![TTFT per system](ttft.png)",
        "",
        "Raw numbers: `ttft.json`.",
        "",
    ]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="wb bench --ttft",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--repeats", type=int, default=5, help="hits per system")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--out", type=Path, default=DOCS)
    args = p.parse_args(argv)
    if "recompute" not in args.systems:
        p.error("recompute is the baseline: keep it in --systems")
    started = time.monotonic()
    patched = devenv.ensure(ROOT)
    lmcache = devenv.ensure_lmcache(ROOT) if "lmcache" in args.systems else patched
    subprocess.run(
        [
            str(patched),
            str(HERE / "bench_model.py"),
            str(MODEL_DIR),
            "--dtype",
            args.dtype,
        ],
        check=True,
    )
    per_token = kv_bytes_per_token(MODEL_DIR, args.dtype)
    expected_cached = (PROMPT_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE
    bandwidth = memcpy(patched, expected_cached * per_token)
    step(f"memcpy {bandwidth['gbps']:.2f} GB/s")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    scratch = Path(tempfile.mkdtemp(prefix="kvlc-ttft-"))
    results: dict[str, Result] = {}
    # Recompute runs last: it also measures the tails, whose lengths depend on
    # what the connectors actually loaded.
    order = [s for s in args.systems if s != "recompute"] + ["recompute"]
    try:
        for seed, name in enumerate(order):
            python = lmcache if name == "lmcache" else patched
            tails: list[int] = []
            if name == "recompute":
                cached = {
                    c
                    for r in results.values()
                    for s in r.hits
                    for c in [s.cached_tokens]
                }
                tails = sorted({PROMPT_TOKENS - c for c in cached if c > 0})
                tails = tails or [PROMPT_TOKENS - expected_cached]
            with backing_service(name, scratch / name, python) as system:
                results[name] = measure(
                    system, scratch, 100 * (seed + 1), args.repeats, args.dtype, tails
                )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    analysis = analyse(results, per_token, bandwidth)
    failed = {
        n: r["failed_hits"] for n, r in analysis["rows"].items() if r.get("failed_hits")
    }
    for name, count in failed.items():
        step(f"FAILED MEASUREMENT: {name}: {count} repeats reported 0 cached tokens")
    tail_rows = [r for r in analysis["rows"].values() if r.get("tail_compute_s")]
    floor_rows = [r for r in analysis["rows"].values() if r.get("floor_s")]
    loads = [r.load_before for r in results.values()]
    meta = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "minutes": (time.monotonic() - started) / 60,
        "vllm": vllm_version(patched),
        "lmcache": "0.5.6" if "lmcache" in args.systems else "not run",
        "dtype": args.dtype,
        "kvcache_space": os.environ["VLLM_CPU_KVCACHE_SPACE"],
        "repeats": args.repeats,
        "memcpy": bandwidth,
        "kv_bytes_per_token": per_token,
        "floor_ms": floor_rows[0]["floor_s"] * 1e3 if floor_rows else float("nan"),
        "floor_tokens": expected_cached,
        "tail_ms": ", ".join(
            sorted(
                {
                    f"{r['tail_tokens']} tokens: {r['tail_compute_s'] * 1e3:.0f} ms"
                    for r in tail_rows
                }
            )
        )
        or "not measured",
        "load_note": (
            f"Load average before the servers: {min(loads):.2f} to {max(loads):.2f}"
            + (
                "; runs were made under load from other work."
                if max(loads) > 0.5
                else "; the machine was otherwise quiet."
            )
        ),
    }
    lines = report(analysis, meta)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ttft.md").write_text("\n".join(lines))
    plot(analysis, args.out / "ttft.png")
    raw = {
        "meta": meta,
        "analysis": analysis,
        "tails": {
            str(n): [s.ttft_s for s in shots]
            for n, shots in results["recompute"].tails.items()
        },
    }
    (args.out / "ttft.json").write_text(json.dumps(raw, indent=1) + "\n")
    print("\n".join(lines))
    step(f"wrote {args.out / 'ttft.md'}, ttft.png, ttft.json")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How ``./wb bench --ttft`` (``ttft.py``) serves each system and times a
request: the model and prompts, the ``vllm serve`` command line, the services a
connector needs beside vLLM (Redis, ``mooncake_master``, LMCache's server),
each in its own process group, and one streamed request's time to first token.
``ttft_queue.py`` uses the same pieces.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "project" / "demo"))
sys.path.insert(0, str(ROOT / "project" / "tests"))

from mooncake_master import mooncake_master  # noqa: E402
from redis_server import RedisServer, wait_port  # noqa: E402
from serve_demo import Server, free_port, server_env  # noqa: E402

MODEL_DIR = ROOT / "build" / "bench-model-qwen2.5-0.5b-shape"
SERVED = "bench"
BLOCK_SIZE = 128  # vLLM's CPU block size: connectors move whole blocks.
PROMPT_TOKENS = 4096
MAX_MODEL_LEN = 4608
# The demo tokenizer's ids (bench_model.py): vLLM rejects prompt ids past the
# tokenizer's vocabulary. The first three are its special tokens.
TOKEN_IDS = range(3, 512)


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
    prefix_caching: bool = False
    # More ``vllm serve`` options, e.g. ``--max-num-seqs``.
    serve_args: list[str] = field(default_factory=list)


def make_model(python: Path, dtype: str) -> None:
    """Generate the bench model into ``MODEL_DIR`` with ``python`` (a vLLM
    environment); ``bench_model.py`` leaves a complete one untouched."""
    subprocess.run(
        [str(python), str(HERE / "bench_model.py"), str(MODEL_DIR), "--dtype", dtype],
        check=True,
    )


def store_system(name: str, python: Path, extra: dict[str, Any]) -> System:
    """The reference ``StoreConnector`` with ``extra`` as its own config."""
    return System(
        name,
        python,
        {
            "kv_connector": "StoreConnector",
            "kv_connector_module_path": "kvlc_store",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        },
    )


def serve_command(system: System, model: Path, port: int, dtype: str) -> list[str]:
    command = [str(system.python.parent / "vllm"), "serve", str(model)]
    command += [
        "--host", "127.0.0.1",
        "--port", str(port),
        "--served-model-name", SERVED,
        "--dtype", dtype,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--enable-prompt-tokens-details",
    ]  # fmt: skip
    # Without local prefix caching only the connector supplies cached tokens.
    command.append(
        "--enable-prefix-caching"
        if system.prefix_caching
        else "--no-enable-prefix-caching"
    )
    if system.kv_config is not None:
        command += ["--kv-transfer-config", json.dumps(system.kv_config)]
    return command + system.serve_args


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
    elif name == "resident":
        yield System(name, python, None, prefix_caching=True)
    elif name == "store-dir":
        yield store_system(name, python, {"path": str(scratch / "kv-store")})
    elif name == "store-redis":
        redis = RedisServer(scratch / "redis")
        redis.start()
        try:
            yield store_system(
                name, python, {"backend": "redis", "redis_url": redis.url}
            )
        finally:
            redis.stop()
    elif name == "mooncake":
        master = python.parent / "mooncake_master"
        with mooncake_master(master, scratch) as config:
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


@contextlib.contextmanager
def serving(system: System, scratch: Path, dtype: str) -> Iterator[tuple[str, float]]:
    """Serve ``system``; yield its base URL and how long it took to start."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    env = {**server_env(), **system.env}
    command = serve_command(system, MODEL_DIR, port, dtype)
    step(f"{system.name}: {' '.join(command[1:3])} ... {json.dumps(system.kv_config)}")
    server = Server(command, env, scratch / f"{system.name}.log")
    try:
        yield base_url, server.wait_healthy(base_url, timeout=600)
    except Exception:
        step(f"{system.name} failed; last lines of {server.log_path}:")
        print(server.log_tail(), flush=True)
        raise
    finally:
        server.stop()

"""Serve the demo model with this interpreter's vLLM (no KV connector) and
measure time to first token and request throughput over HTTP.

Prints one JSON object: ``ttft_s`` (per sequential streamed request),
``throughput_rps`` (per concurrent burst) and ``startup_s``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "demo"))
from serve_demo import (  # noqa: E402
    SERVED_NAME,
    Server,
    free_port,
    http,
    server_command,
    server_env,
)

WORDS = [
    "cache",
    "block",
    "token",
    "prefix",
    "store",
    "load",
    "layer",
    "key",
    "value",
    "attention",
]


def prompt(i: int, words: int) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(words)) + f" {i}"


def first_token_seconds(base_url: str, text: str) -> float:
    body = json.dumps(
        {
            "model": SERVED_NAME,
            "prompt": text,
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    request = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            if line.startswith(b"data: ") and b'"text"' in line:
                seconds = time.perf_counter() - start
                response.read()
                return seconds
    raise RuntimeError("stream ended without a token")


def complete(base_url: str, text: str) -> None:
    body = {
        "model": SERVED_NAME,
        "prompt": text,
        "max_tokens": 32,
        "temperature": 0,
        "ignore_eos": True,
    }
    http(f"{base_url}/v1/completions", body)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--ttft-requests", type=int, default=20)
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--burst-size", type=int, default=32)
    args = p.parse_args()
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(
            server_command(args.model_dir, port, None),
            server_env(),
            Path(tmp) / "server.log",
        )
        try:
            startup = server.wait_healthy(base_url, timeout=300)
            for i in range(3):
                complete(base_url, prompt(10_000 + i, 300))
            # Distinct prompts: no prefix caching hit between them.
            ttft = [
                first_token_seconds(base_url, prompt(i, 300))
                for i in range(args.ttft_requests)
            ]
            throughput = []
            with ThreadPoolExecutor(args.burst_size) as pool:
                for b in range(args.bursts):
                    texts = [
                        prompt(1000 * (b + 1) + i, 200) for i in range(args.burst_size)
                    ]
                    start = time.perf_counter()
                    list(pool.map(lambda t: complete(base_url, t), texts))
                    throughput.append(args.burst_size / (time.perf_counter() - start))
        except Exception:
            print(server.log_tail(), file=sys.stderr)
            raise
        finally:
            server.stop()
    print(
        json.dumps({"ttft_s": ttft, "throughput_rps": throughput, "startup_s": startup})
    )


if __name__ == "__main__":
    main()

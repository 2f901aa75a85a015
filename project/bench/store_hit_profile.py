"""Where a StoreConnector hit spends its time, outside vLLM: the store work of
``ttft.py``'s hit (31 chunks of one 128-token block of the Qwen2.5-0.5B-shape
model, 1.5 MiB each) and of its miss (32 chunks written), per backend.

The steps are the ones ``kvlc_store`` runs, on its own backends and chunk
format: scheduler lookup = ``lease`` + (with ``verify_on_lookup``, the
default) ``get`` and checksum of every chunk; worker load = ``get``, checksum
(``decode_chunk``) and the copy into the KV cache (timed here as a copy into
a buffer of the same size); miss = ``encode_chunk`` (checksum) and ``put``.

Run with the python of the vLLM install that has ``kvlc_store`` (Redis
backend: Debian's ``redis-server`` on PATH)::

    python store_hit_profile.py [--reps 5]

Prints a table (median ms over ``--reps``) and then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from kvlc_store.backends import Backend, DirectoryBackend, RedisBackend, new_lease_id
from kvlc_store.chunk import decode_chunk, encode_chunk

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from redis_server import running_redis  # noqa: E402

BLOCK_BYTES = 128 * 24 * 2 * 2 * 64 * 2  # tokens × layers × K,V × heads × dim × bf16
HIT_CHUNKS = 31  # (4096 - 1) // 128: the last prompt token is always computed
MISS_CHUNKS = 32
IDENTITY = "profile"


class Timer:
    """Collects the seconds of each named step over the repetitions."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds.setdefault(name, []).append(time.perf_counter() - start)


def profile(backend: Backend, reps: int) -> dict[str, list[float]]:
    timer = Timer()
    # Zeroed: vLLM's KV cache is touched long before a load writes into it.
    kv = torch.zeros(HIT_CHUNKS * BLOCK_BYTES, dtype=torch.uint8)
    for rep in range(reps):
        keys = [f"{IDENTITY}/{rep:04x}{i:060x}.0" for i in range(MISS_CHUNKS)]
        payloads = [os.urandom(BLOCK_BYTES) for _ in keys]
        with timer("miss: encode (checksum)"):
            chunks = [
                encode_chunk(IDENTITY, k, p)
                for k, p in zip(keys, payloads, strict=True)
            ]
        with timer("miss: put"):
            for key, chunk in zip(keys, chunks, strict=True):
                backend.put(key, chunk)
        hit = keys[:HIT_CHUNKS]
        lease = new_lease_id()
        with timer("hit, scheduler: lease"):
            backend.lease(hit, lease, 60)
        with timer("hit, scheduler: verify (get + checksum)"):
            for key in hit:
                decode_chunk(backend.get(key) or b"", IDENTITY, key)
        with timer("hit, worker: get"):
            data = [backend.get(key) or b"" for key in hit]
        with timer("hit, worker: checksum"):
            views = [
                decode_chunk(d, IDENTITY, k) for d, k in zip(data, hit, strict=True)
            ]
        with timer("hit, worker: copy into KV"), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer
            for i, view in enumerate(views):
                src = torch.frombuffer(view, dtype=torch.uint8)
                kv[i * BLOCK_BYTES : (i + 1) * BLOCK_BYTES].copy_(src)
        with timer("hit, worker: release"):
            backend.release(hit, lease)
    return timer.seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvlc-profile-") as tmp:
        directory = DirectoryBackend(Path(tmp) / "store", 8 << 30)
        results["directory"] = profile(directory, args.reps)
        with running_redis(Path(tmp) / "redis") as redis:
            backend = RedisBackend(redis.url, "kvlc", 8 << 30)
            results["redis"] = profile(backend, args.reps)
            backend.close()
    steps = list(results["directory"])
    print("| step | directory ms | redis ms |")
    print("|---|---:|---:|")
    for name in steps:
        cells = [statistics.median(results[b][name]) * 1e3 for b in results]
        print(f"| {name} | {cells[0]:.0f} | {cells[1]:.0f} |")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a StoreConnector hit spends its time, outside vLLM: the store work of
``ttft.py``'s hit (32 chunks of one 128-token block of the Qwen2.5-0.5B-shape
model, 1.5 MiB each in bf16: the prompt's last block is loaded too) and of its miss
(32 chunks written), per backend.

The steps are ``kvlc_store``'s own, on its backends, chunk format and worker
side, over a KV cache of that model's shape in host memory (24 layers of
``[2, blocks x 128, 2 heads, 64]``, as vLLM's CPU backend lays it out, in the
dtype the TTFT bench serves on this CPU: bf16 with native bf16, else fp32):
miss = the worker's save (digest, then write straight from the KV cache);
scheduler lookup = ``lease`` + (with ``verify_on_lookup``, the default) the
headers of every chunk (``peek`` + ``check_header``); worker load = read
straight into the KV cache, digest and release (``start_load_kv``).

Run with the python of the vLLM install that has ``kvlc_store`` (Redis
backend: Debian's ``redis-server`` on PATH)::

    python store_hit_profile.py [--reps 5] [--dtype float32]

Prints the machine, a table (median ms over ``--reps``) and one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from kvlc_store.backends import Backend, DirectoryBackend, RedisBackend, new_lease_id
from kvlc_store.chunk import HEADER_BYTES, check_header
from kvlc_store.config import parse_config
from kvlc_store.core import StoreCore
from kvlc_store.metadata import LoadSpec, SaveSpec, StoreMetadata
from kvlc_store.worker_side import WorkerSide

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402
from redis_server import running_redis  # noqa: E402

LAYERS, HEADS, HEAD_DIM, BLOCK = 24, 2, 64, 128
HIT_CHUNKS = 32  # 4095 of 4096 tokens: the last block is loaded whole
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


def profile(backend: Backend, reps: int, dtype: torch.dtype) -> dict[str, list[float]]:
    timer = Timer()
    # The settings only: the store is ``backend``, not this path.
    config = parse_config({"path": tempfile.gettempdir()}, check_store=False)
    core = StoreCore(config, backend, IDENTITY, 1)
    worker = WorkerSide(core, BLOCK)
    num_blocks = MISS_CHUNKS + HIT_CHUNKS
    kv = {
        f"layer.{i:02d}": torch.randn(
            2, num_blocks * BLOCK, HEADS, HEAD_DIM, dtype=dtype
        )
        for i in range(LAYERS)
    }
    worker.register(kv, num_blocks, 0)
    for rep in range(reps):
        keys = [f"{IDENTITY}/{rep:04x}{i:060x}.0" for i in range(MISS_CHUNKS)]
        saves = [SaveSpec(b, [k]) for b, k in enumerate(keys)]
        with timer("miss: save (digest + write from KV)"):
            worker.save(StoreMetadata(saves=saves))
        hit = keys[:HIT_CHUNKS]
        lease = new_lease_id()
        with timer("hit, scheduler: lease"):
            backend.lease(hit, lease, 60)
        with timer("hit, scheduler: check headers"):
            for key, head in zip(hit, backend.peek(hit, HEADER_BYTES), strict=True):
                assert head is not None
                check_header(head[0], IDENTITY, key, head[1])
        load = LoadSpec(
            "r", lease, list(range(MISS_CHUNKS, num_blocks)), [[k] for k in hit]
        )
        with timer("hit, worker: load (read into KV + digest + release)"):
            worker.start_load(StoreMetadata(loads=[load], sync_loads_first=True))
        assert not worker.take_load_errors()
    return timer.seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="auto: what ttft.py serves on this CPU (machine.native_dtype)",
    )
    args = parser.parse_args(argv)
    dtype_name = machine.native_dtype() if args.dtype == "auto" else args.dtype
    dtype = getattr(torch, dtype_name)
    chunk_mib = LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * dtype.itemsize / 2**20
    print(f"{machine.describe()}; KV {dtype_name}, {chunk_mib:.1f} MiB per chunk")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvlc-profile-") as tmp:
        directory = DirectoryBackend(Path(tmp) / "store", 8 << 30)
        results["directory"] = profile(directory, args.reps, dtype)
        with running_redis(Path(tmp) / "redis") as redis:
            backend = RedisBackend(redis.url, "kvlc", 8 << 30)
            results["redis"] = profile(backend, args.reps, dtype)
            backend.close()
    steps = list(results["directory"])
    print("| step | directory ms | redis ms |")
    print("|---|---:|---:|")
    for name in steps:
        cells = [statistics.median(results[b][name]) * 1e3 for b in results]
        print(f"| {name} | {cells[0]:.0f} | {cells[1]:.0f} |")
    print(json.dumps({"dtype": dtype_name, "seconds": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

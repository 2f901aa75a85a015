"""Measure this machine's memory copy bandwidth for a buffer of a given size
with torch (the copy a KV load cannot avoid), for ``ttft.py``'s floor.

Prints one JSON object: ``bytes``, ``seconds`` (every timed copy),
``median_s`` and ``gbps`` (bytes / median, 1e9 bytes per second).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch


def measure(size: int, reps: int) -> dict[str, Any]:
    src = torch.randint(0, 255, (size,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    # The first copies fault the destination pages in; a KV load writes into
    # an already allocated cache, so they are not timed.
    for _ in range(3):
        dst.copy_(src)
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds)
    return {
        "bytes": size,
        "seconds": seconds,
        "median_s": median,
        "gbps": size / median / 1e9,
        "torch_threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bytes", type=int)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.bytes, args.reps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

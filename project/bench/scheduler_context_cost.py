"""What the SchedulerContext's touch() + free_blocks() cost next to BlockPool's.

SimpleCPUOffload calls both every step with the GPU block ids of its
transfers; the context checks every id (type, range, null block, the
references it holds) before it changes anything. This times, in one process
and interleaved, one ``touch`` + ``free_blocks`` round trip of N ids:

* ``block_pool``: ``BlockPool.touch(blocks)`` + ``BlockPool.free_blocks(blocks)``
  on the block objects (no checks);
* ``context``: ``BlockPoolSchedulerContext.touch(ids)`` + ``.free_blocks(ids)``
  on plain int ids (a Python list, as SimpleCPUOffload passes them).

Each sample is the fastest of ``--repeat`` round trips; the ratio is
context / block_pool. Prints one JSON object. Run with the patched build:

    python project/bench/scheduler_context_cost.py [--num-ids 4096]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable


def fastest(fn: Callable[[], None], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-ids", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from vllm.v1.core.block_pool import BlockPool

    from vllm.distributed.kv_transfer.kv_connector.v1.scheduler_context import (
        BlockPoolSchedulerContext,
    )

    num_blocks = 2 * args.num_ids + 1
    pool = BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=16)
    context = BlockPoolSchedulerContext(pool)
    # Every other block, so the free queue removals are not all at one end.
    ids = list(range(1, num_blocks, 2))[: args.num_ids]
    blocks = [pool.blocks[i] for i in ids]

    def pool_round_trip() -> None:
        pool.touch(blocks)
        pool.free_blocks(blocks)

    def context_round_trip() -> None:
        context.touch(ids)
        context.free_blocks(ids)

    samples: dict[str, list[float]] = {"block_pool": [], "context": []}
    for _ in range(args.rounds):
        samples["block_pool"].append(fastest(pool_round_trip, args.repeat))
        samples["context"].append(fastest(context_round_trip, args.repeat))
    block_pool = min(samples["block_pool"])
    ctx = min(samples["context"])
    print(
        json.dumps(
            {
                "num_ids": args.num_ids,
                "block_pool_ms": round(block_pool * 1e3, 3),
                "context_ms": round(ctx * 1e3, 3),
                "ratio": round(ctx / block_pool, 2),
            }
        )
    )


if __name__ == "__main__":
    main()

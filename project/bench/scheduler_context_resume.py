"""What resuming ``SchedulerContext.iter_free_blocks(after_block_id)`` costs.

For pools of 1k, 10k, 100k and 1M blocks (patched build only), the seconds
from ``iter_free_blocks(cursor)`` to its first yielded block, with the cursor
in the middle of the free queue: the median of many timed batches. Resuming
follows the free queue's linked list from the cursor, so the cost must not
grow with the pool (0.32.0's connectors had to restart a scan from the head
when the cursor went stale; a resume that scanned from the head would grow
1000x from 1k to 1M).

Prints one JSON line:
``{"resume_s": {"1000": s, "10000": s, "100000": s, "1000000": s},
"ratio_1M_1k": r}``. Run with the patched build's interpreter:
``.venv/bin/python project/bench/scheduler_context_resume.py``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

from vllm.v1.core.block_pool import BlockPool

from vllm.distributed.kv_transfer.kv_connector.v1.scheduler_context import (
    BlockPoolSchedulerContext,
)

SIZES = (1_000, 10_000, 100_000, 1_000_000)


def resume_seconds(num_blocks: int, batches: int, per_batch: int) -> float:
    """Median seconds of one resume (call plus first block) on a pool."""
    pool = BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=16)
    context = BlockPoolSchedulerContext(pool)
    # Shuffle the queue a little so it is not in block-id order.
    blocks = pool.get_new_blocks(min(64, num_blocks - 1))
    pool.free_blocks(reversed(blocks))
    # A cursor must come from a scan: take the block in the middle.
    scan = context.iter_free_blocks()
    for _ in range(pool.get_num_free_blocks() // 2):
        cursor = next(scan).block_id
    scan.close()
    timings: list[float] = []
    gc.disable()
    try:
        for _ in range(batches):
            start = time.perf_counter()
            for _ in range(per_batch):
                next(context.iter_free_blocks(cursor))
            timings.append((time.perf_counter() - start) / per_batch)
    finally:
        gc.enable()
    return statistics.median(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=31)
    parser.add_argument("--per-batch", type=int, default=2000)
    args = parser.parse_args()
    resume = {str(n): resume_seconds(n, args.batches, args.per_batch) for n in SIZES}
    print(
        json.dumps(
            {
                "resume_s": resume,
                "ratio_1M_1k": resume["1000000"] / resume["1000"],
            }
        )
    )


if __name__ == "__main__":
    main()

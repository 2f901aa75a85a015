"""What the SchedulerContext's touch() + free_blocks() cost next to BlockPool's.

SimpleCPUOffload calls both every step with the GPU block ids of its
transfers; the context checks every id (type, range, null block, the
references it holds) before it changes anything. This times, in one process
and interleaved, one ``touch`` + ``free_blocks`` round trip of N ids:

* ``block_pool``: ``BlockPool.touch(blocks)`` + ``BlockPool.free_blocks(blocks)``
  on the block objects (no checks), the reference;
* the context on the same ids given as each id type its contract accepts: a
  list of ints (as SimpleCPUOffload passes them), a list of numpy integers,
  a numpy int64 / int32 array, a torch int64 tensor.

Each sample is the CPU time (``time.process_time``) of one round trip; the
figures are medians over ``--samples`` interleaved samples, and each ratio is
the id type's median over block_pool's. Prints one JSON object. Run with the
patched build:

    python project/bench/scheduler_context_cost.py [--num-ids 4096]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any


def cpu_time(fn: Callable[[], None]) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-ids", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument(
        "--max-ratio",
        type=float,
        default=None,
        help="exit 1 if any id type's median ratio exceeds this",
    )
    args = parser.parse_args()

    import numpy as np
    import torch
    from vllm.v1.core.block_pool import BlockPool

    from vllm.distributed.kv_transfer.kv_connector.v1.scheduler_context import (
        KVConnectorSchedulerContext,
    )

    num_blocks = 2 * args.num_ids + 1
    pool = BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=16)
    context = KVConnectorSchedulerContext(pool)
    # Every other block, so the free queue removals are not all at one end.
    ids = list(range(1, num_blocks, 2))[: args.num_ids]
    blocks = [pool.blocks[i] for i in ids]

    def pool_round_trip() -> None:
        pool.touch(blocks)
        pool.free_blocks(blocks)

    def context_round_trip(given: Iterable[Any]) -> Callable[[], None]:
        def run() -> None:
            context.touch(given)
            context.free_blocks(given)

        return run

    variants: dict[str, Callable[[], None]] = {
        "block_pool": pool_round_trip,
        "list[int]": context_round_trip(ids),
        "list[np.int64]": context_round_trip([np.int64(i) for i in ids]),
        "np.ndarray[int64]": context_round_trip(np.array(ids, dtype=np.int64)),
        "np.ndarray[int32]": context_round_trip(np.array(ids, dtype=np.int32)),
        "torch.Tensor[int64]": context_round_trip(torch.tensor(ids)),
    }
    for run in variants.values():
        run()  # warm up
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.samples):
        for name, run in variants.items():
            samples[name].append(cpu_time(run))
    medians = {name: statistics.median(times) for name, times in samples.items()}
    reference = medians["block_pool"]
    ratios = {
        name: round(median / reference, 2)
        for name, median in medians.items()
        if name != "block_pool"
    }
    print(
        json.dumps(
            {
                "num_ids": args.num_ids,
                "samples": args.samples,
                "median_ms": {
                    name: round(median * 1e3, 3) for name, median in medians.items()
                },
                "ratio_to_block_pool": ratios,
            }
        )
    )
    if args.max_ratio is not None and max(ratios.values()) > args.max_ratio:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

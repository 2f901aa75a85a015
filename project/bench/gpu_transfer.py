"""The connector's batched GPU path alone, on a Llama-3.1-8B-shaped paged KV
cache: one batch of ``L`` tokens' blocks moved by pointer copies (vLLM's
``swap_blocks_batch``, the default) against a staging buffer with
``index_select`` / ``index_copy_`` per layer (the path before it, kept for
layouts with many runs per block), and the host link itself. No vLLM engine;
needs CUDA, torch, vLLM's kernels and kvlc_store.

    python project/bench/gpu_transfer.py --out results/

Writes ``gpu_transfer.json`` and prints a table: seconds per direction and
GB/s, the median of ``--reps`` runs after a warm-up, each ended by a
synchronize.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from kvlc_store.device_transfer import DeviceTransfer
from kvlc_store.transfer import BlockLayout

LAYERS, HEADS, DIM, BLOCK = 32, 8, 128, 16


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(
    layout: BlockLayout, ids: list[int], staged: bool, reps: int
) -> tuple[float, float]:
    """(save, load) seconds of one batch of blocks ``ids``: pointer copies
    to and from consecutive chunk payloads in pinned memory (the host
    tier's path), or staged through the pool."""
    n = len(ids)
    transfer = DeviceTransfer(layout, 2 * n * layout.block_bytes)
    region = transfer.pool.take(n)
    assert region.count == n
    if staged:
        save = timed(lambda: transfer.wait(transfer.gather(ids, region, None)), reps)
        rows = list(range(n))
        load = timed(lambda: transfer.wait(transfer.scatter(ids, rows, region)), reps)
    else:
        at = [region.host.data_ptr() + j * layout.block_bytes for j in range(n)]
        save = timed(lambda: transfer.wait(transfer.save_to(ids, at, None)), reps)
        load = timed(lambda: transfer.wait(transfer.load_from(ids, at)), reps)
    transfer.pool.give(region)
    return save, load


def link(nbytes: int, reps: int) -> float:
    """Seconds of one pinned host-to-device copy of ``nbytes``."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    return timed(lambda: dev.copy_(host, non_blocking=True), reps)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="4096,32768")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("gpu-transfer"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    num_blocks = 2 * max(lengths) // BLOCK + 8
    # FlashAttention's layout: [2, num_blocks, block_size, heads, dim].
    kv = {
        f"layers.{i}": torch.randn(
            2, num_blocks, BLOCK, HEADS, DIM, device="cuda", dtype=torch.bfloat16
        )
        for i in range(LAYERS)
    }
    layout = BlockLayout(kv, num_blocks)
    rows = []
    for length in lengths:
        n = length // BLOCK
        ids = list(range(num_blocks - 1, num_blocks - 1 - 2 * n, -2))  # scattered
        gb = n * layout.block_bytes / 1e9
        for name, staged in (("pointers (swap_blocks_batch)", False), ("staged", True)):
            save, load = measure(layout, ids, staged, args.reps)
            rows.append(
                {"L": length, "path": name, "GB": round(gb, 3),
                 "save_s": round(save, 4), "load_s": round(load, 4)}
            )  # fmt: skip
        h2d = link(n * layout.block_bytes, args.reps)
        rows.append(
            {"L": length, "path": "one pinned H2D copy (the link)", "GB": round(gb, 3),
             "save_s": None, "load_s": round(h2d, 4)}
        )  # fmt: skip
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__}")
    print("| L | path | GB | save (D2H) | load (H2D) |\n|---:|---|---:|---:|---:|")
    for r in rows:
        save = "-"
        if r["save_s"]:
            save = f"{r['save_s']:.4f} s ({r['GB'] / r['save_s']:.1f} GB/s)"
        load = f"{r['load_s']:.4f} s ({r['GB'] / r['load_s']:.1f} GB/s)"
        print(f"| {r['L']} | {r['path']} | {r['GB']} | {save} | {load} |")
    (args.out / "gpu_transfer.json").write_text(
        json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The host side of the connector's GPU path, on CPU tensors: what a hit and
a save cost besides the copies over the link, where no GPU is at hand.

A GPU worker's KV cache is replaced by host tensors of the same shape (per
TP rank of Llama-3.1-8B: 32 layers, 8 KV heads, head_dim 128, 16-token
blocks, 2 bytes per element, ``[2, num_blocks, heads, block, head_dim]`` as
``LBHNC`` lays it out: 2 MiB per chunk, two runs per layer). The worker runs
``start_batched_transfers``, the path ``register_kv_caches`` takes for a KV
cache on a GPU, over a directory store in a temporary directory (page
cache). For each prompt length it times, median of ``--reps`` after a
warm-up:

- ``save``: the step's ``wait_for_save`` until ``get_finished`` reports the
  request: pointer copies into host tier slots, XXH3, the chunk writes;
- ``hot hit``: ``start_load_kv`` of chunks the host tier holds;
- ``hot hit, no copies``: the same with the pointer copies not executed:
  the host's own work (pointer lists, tier bookkeeping), which a GPU hit
  pays besides one ``swap_blocks_batch`` per batch;
- ``lookup, first`` and ``lookup, again`` (``verify_on_lookup`` on and
  off): the scheduler's lookup of the prompt (``get_num_new_matched_tokens``:
  the lease, and with verify on the chunk headers) and the release of its
  lease, by a scheduler that has not seen the chunks yet (a restart, another
  server's chunks: the store's record of checked headers as the saving
  worker left it), and by one that has (the store unchanged since: the
  repeated hit); ``lookup, first, no record``: the same with the record
  removed (chunks stored before a reboot, or by a server that keeps none),
  so the lookup reads and checks every header;
- ``hit, host work``: all the host does for a repeated hot hit before the
  forward, as one: the lookup (verify on), the load plan, ``start_load_kv``
  with the copies not executed, the lease's release;
- ``cold hit``: ``start_load_kv`` with ``host_tier: 0``: the chunks read
  from the store (page cache warm) by the read threads, checked, copied;
- ``memcpy`` and ``read``: the floors, a torch copy of the same bytes and a
  plain threaded read of the same chunk files.

On CPU the copies are ``memmove`` calls, one per run, from Python: they are
not what a GPU's DMA costs, which is why ``hot hit, no copies`` is shown.

    .venv/bin/python project/bench/host_path.py [--lengths 4096,32768]

Prints the machine, a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import machine
import torch
from kvlc_store.backends import DirectoryBackend
from kvlc_store.config import parse_config
from kvlc_store.core import StoreCore
from kvlc_store.metadata import LoadSpec, SaveSpec, StoreMetadata
from kvlc_store.scheduler_side import SchedulerSide
from kvlc_store.worker_side import READ_THREADS, WorkerSide

LAYERS, HEADS, DIM, BLOCK = 32, 8, 128, 16
CHUNK_BYTES = LAYERS * 2 * HEADS * BLOCK * DIM * 2


def timed(
    fn: Callable[[], object], reps: int, before: Callable[[], object] = lambda: None
) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn`` after one untimed, each
    after an untimed call of ``before``."""
    fn()
    out = []
    for _ in range(reps):
        before()
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def worker(
    root: Path, num_blocks: int, tier_bytes: int, touched: bool = True
) -> WorkerSide:
    # pinned_buffer's default: what host_tier 0 moves its batches through.
    config = parse_config({"path": str(root), "host_tier": tier_bytes})
    core = StoreCore(config, DirectoryBackend(root, 1 << 40), "bench", 1)
    side = WorkerSide(core, BLOCK)
    kv = {
        # Untouched (``touched`` False): pages never written take no memory,
        # and the host work does not depend on the bytes.
        f"layer.{i}": (torch.zeros if touched else torch.empty)(
            2, num_blocks, HEADS, BLOCK, DIM, dtype=torch.int16
        )
        for i in range(LAYERS)
    }
    side.register(kv, num_blocks, 0)
    side.start_batched_transfers()
    return side


def key(rep: int, block: int) -> str:
    return f"bench/{block_hash(rep, block).hex()}.0"


def block_hash(rep: int, block: int) -> bytes:
    return bytes.fromhex(f"{rep:032x}{block:032x}")


class Prompt:
    """What the scheduler side reads of a vLLM request: a prompt of
    ``tokens`` tokens whose blocks are the first save's."""

    def __init__(self, tokens: int) -> None:
        self.request_id = "r"
        self.num_tokens = self.num_prompt_tokens = tokens
        self.block_hashes = [block_hash(0, b) for b in range(tokens // BLOCK)]


def scheduler(root: Path, verify: bool) -> SchedulerSide:
    """A scheduler side on its own view of the store, as in a server."""
    config = parse_config({"path": str(root), "verify_on_lookup": verify})
    core = StoreCore(config, DirectoryBackend(root, 1 << 40), "bench", 1)
    return SchedulerSide(core, BLOCK, worker_hits=False, manager=lambda: None)


def lookup(on: list[SchedulerSide], prompt: Prompt) -> Callable[[], None]:
    """The lookup of ``prompt`` by ``on[0]``, and its lease released."""

    def run() -> None:
        offer = on[0].offer(prompt, 0)  # type: ignore[arg-type]
        assert offer is not None and offer.num_blocks == len(prompt.block_hashes)
        on[0].abort(offer)

    return run


# A scheduler output with nothing scheduled: build_meta hands over the loads.
_NOTHING = SimpleNamespace(
    scheduled_new_reqs=[],
    scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
    has_sync_kv_loads=True,
    num_scheduled_tokens={},
    preempted_req_ids=set(),
)


def hit(on: SchedulerSide, worker: WorkerSide, prompt: Prompt) -> Callable[[], None]:
    """The lookup, the load plan and ``start_load_kv`` (which releases the
    lease) of ``prompt``."""
    blocks = list(range(len(prompt.block_hashes)))

    def run() -> None:
        offer = on.offer(prompt, 0)  # type: ignore[arg-type]
        assert offer is not None
        on.commit(prompt, blocks, offer, offer.num_tokens)  # type: ignore[arg-type]
        meta = on.build_meta(_NOTHING)  # type: ignore[arg-type]
        worker.start_load(meta)
        assert worker.take_load_errors() == set()

    return run


def load(on: WorkerSide, blocks: int) -> Callable[[], None]:
    """``start_load_kv`` of the first save's chunks into blocks 0.."""
    spec = LoadSpec(
        "r", None, list(range(blocks)), [[key(0, b)] for b in range(blocks)]
    )

    def run() -> None:
        on.start_load(StoreMetadata(loads=[spec], sync_loads_first=True))
        assert on.take_load_errors() == set()

    return run


def saves_and_hot_hits(
    root: Path, blocks: int, reps: int, hit_only: bool = False
) -> dict[str, list[float]]:
    total = blocks * CHUNK_BYTES
    # Room for every chunk of the hit, and a quarter more for the batches.
    side = worker(
        root, blocks, total + total // 4 + 8 * CHUNK_BYTES, touched=not hit_only
    )
    # The first save's chunks are the ones loaded; the timed ones write more.
    saves = iter(range(reps + 2))
    saved: list[int] = []

    def save() -> None:
        rep = next(saves)
        saved.append(rep)
        req = f"save-{rep}"
        side.save(
            StoreMetadata(
                saves=[SaveSpec(b, [key(rep, b)], req_id=req) for b in range(blocks)]
            )
        )
        while not side.finished_saves({req}):
            time.sleep(0.001)

    def drop_last_save() -> None:
        # Every save writes new chunks; only the first one's are loaded.
        if saved[-1] != 0:
            for path in (root / "chunks").rglob(f"{saved[-1]:032x}*.0"):
                path.unlink()

    save()
    # The worker's DeviceTransfer, its copies made no-ops: a bench reaches
    # in where no setting should exist.
    transfer = side._device
    assert transfer is not None
    out: dict[str, list[float]] = {}
    if not hit_only:
        out["save"] = timed(save, reps, drop_last_save)
        # The untimed first load reads the chunks into the tier.
        out["hot hit"] = timed(load(side, blocks), reps)
    transfer._copy_batch = lambda *args: None
    out["hot hit, no copies"] = timed(load(side, blocks), reps)
    prompt = Prompt(blocks * BLOCK)
    for verify in (True, False):
        on = [scheduler(root, verify)]

        def fresh(verify: bool = verify, on: list[SchedulerSide] = on) -> None:
            on[0] = scheduler(root, verify)

        state = "on" if verify else "off"
        out[f"lookup, first (verify {state})"] = timed(lookup(on, prompt), reps, fresh)
        if verify:

            def unrecorded(on: list[SchedulerSide] = on) -> None:
                for record in (root / "checked").iterdir():
                    record.unlink()
                on[0] = scheduler(root, True)

            out["lookup, first, no record (verify on)"] = timed(
                lookup(on, prompt), reps, unrecorded
            )
        on[0] = scheduler(root, verify)
        out[f"lookup, again (verify {state})"] = timed(lookup(on, prompt), reps)
    out["hit, host work"] = timed(hit(scheduler(root, True), side, prompt), reps)
    side.close()
    return out


def cold_hits(root: Path, blocks: int, reps: int) -> list[float]:
    cold = worker(root, blocks, 0)
    try:
        return timed(load(cold, blocks), reps)
    finally:
        cold.close()


def floors(root: Path, blocks: int, reps: int) -> dict[str, list[float]]:
    """A threaded read of the chunk files, and a memcpy of their bytes (of
    at most 1 GiB, scaled: the machine has no room for two copies of 32k
    tokens' KV beside the rest)."""
    files = sorted(str(p) for p in (root / "chunks").rglob(f"{0:032x}*.0"))
    assert len(files) == blocks

    def read_one(path: str) -> int:
        with open(path, "rb", buffering=0) as f:
            return len(f.read())

    with ThreadPoolExecutor(READ_THREADS) as pool:
        read = timed(lambda: sum(pool.map(read_one, files)), reps)
    total = blocks * CHUNK_BYTES
    size = min(total, 1 << 30)
    src = torch.empty(size, dtype=torch.uint8)
    dst = torch.empty_like(src)
    memcpy = [s * total / size for s in timed(lambda: dst.copy_(src), reps)]
    return {"read": read, "memcpy": memcpy}


def measure(
    root: Path, tokens: int, reps: int, hit_only: bool = False
) -> dict[str, list[float]]:
    blocks = tokens // BLOCK
    out = saves_and_hot_hits(root, blocks, reps, hit_only)
    if hit_only:
        return out
    out["cold hit"] = cold_hits(root, blocks, reps)
    out.update(floors(root, blocks, reps))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,32768")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--hit-only",
        action="store_true",
        help="only the hit's host work (lookups, hot hit without copies): "
        "needs a KV cache and a tier of the prompt's size, not four times it",
    )
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    print(f"{machine.describe()}; torch threads {torch.get_num_threads()}")
    results: dict[str, Any] = {}
    for tokens in lengths:
        with tempfile.TemporaryDirectory(prefix="kvlc-host-path-") as tmp:
            results[str(tokens)] = measure(Path(tmp), tokens, args.reps, args.hit_only)
    steps = list(results[str(lengths[0])])
    print("| step | " + " | ".join(f"{n} tokens, ms (GB/s)" for n in lengths) + " |")
    print("|---|" + "---:|" * len(lengths))
    for step in steps:
        cells = []
        for tokens in lengths:
            s = statistics.median(results[str(tokens)][step])
            gbps = tokens // BLOCK * CHUNK_BYTES / s / 1e9
            # Tenths of a millisecond: a repeated lookup takes about one.
            cells.append(f"{s * 1e3:.1f} ({gbps:.1f})")
        print(f"| {step} | " + " | ".join(cells) + " |")
    print(json.dumps({"machine": machine.describe(), "seconds": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

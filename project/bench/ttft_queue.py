"""TTFT of concurrent repeats: the baseline a prefetch for waiting requests
(issue 20, item 4) would have to beat.

Serves the TTFT bench's model (``ttft.py``: Qwen2.5-0.5B shape, the dtype this
CPU runs natively) with the reference ``StoreConnector`` on a local Redis,
stores ``--prompts`` different 4096-token prompts (one request each, one after
the other), then sends all their repeats at once and times each one's first
token. It also times one repeat alone, after the burst, and reads from the
server's ``/metrics`` how many engine steps scheduled the burst's prompts
(``vllm:iteration_tokens_total``'s count): a prefetch can only hide a fetch
behind time a request spends waiting in the queue, so if the whole burst is
scheduled in one step there is no such time.

Run with ``.venv/bin/python project/bench/ttft_queue.py`` on a quiet machine
(needs ``redis-server``); prints the machine, the per-request TTFTs and one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "demo"))

import machine  # noqa: E402
import ttft  # noqa: E402
from serve_demo import http, metric_sum  # noqa: E402
from ttft_serve import (  # noqa: E402
    backing_service,
    first_token,
    make_model,
    prompt,
    serving,
)

# Engine steps: the sample count of vLLM's tokens-per-step histogram.
STEPS = "vllm:iteration_tokens_total_count"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    args = parser.parse_args(argv)
    dtype = machine.native_dtype()
    python = Path(sys.executable)
    make_model(python, dtype)
    print(f"{machine.describe()}; {dtype}", flush=True)
    # Every prompt's KV at once: 8 x 4096 tokens are 0.4 GB in bf16, 0.8 in fp32.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    prompts = [prompt(500 + i) for i in range(args.prompts)]
    with tempfile.TemporaryDirectory(prefix="kvlc-ttft-queue-") as tmp:
        scratch = Path(tmp)
        with (
            backing_service("store-redis", scratch / "redis", python) as system,
            serving(system, scratch, dtype) as (url, _),
        ):
            first_token(url, prompt(1500, ttft.WARMUP_TOKENS))
            misses = []
            for ids in prompts:
                time.sleep(ttft.PAUSE_S)
                misses.append(first_token(url, ids))
            time.sleep(ttft.PAUSE_S)
            steps_before = metric_sum(http(f"{url}/metrics"), STEPS) or 0.0
            start = time.perf_counter()
            with ThreadPoolExecutor(len(prompts)) as pool:
                burst = list(pool.map(lambda ids: first_token(url, ids), prompts))
            burst_s = time.perf_counter() - start
            steps = (metric_sum(http(f"{url}/metrics"), STEPS) or 0.0) - steps_before
            time.sleep(ttft.PAUSE_S)
            alone = first_token(url, prompts[0])
    for i, shot in enumerate(burst):
        print(
            f"repeat {i}: TTFT {shot.ttft_s * 1e3:.0f} ms, cached "
            f"{shot.cached_tokens}/{shot.prompt_tokens}"
        )
    mean = statistics.mean(s.ttft_s for s in burst)
    miss_s = [s.ttft_s for s in misses]
    print(
        f"{len(burst)} concurrent repeats: mean TTFT {mean * 1e3:.0f} ms, all done "
        f"in {burst_s * 1e3:.0f} ms, {steps:.0f} engine steps; one repeat alone "
        f"{alone.ttft_s * 1e3:.0f} ms; a miss {statistics.mean(miss_s):.1f} s"
    )
    print(
        json.dumps(
            {
                "machine": machine.describe(),
                "dtype": dtype,
                "burst_ttft_s": [s.ttft_s for s in burst],
                "burst_cached": [s.cached_tokens for s in burst],
                "burst_s": burst_s,
                "steps": steps,
                "alone_ttft_s": alone.ttft_s,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

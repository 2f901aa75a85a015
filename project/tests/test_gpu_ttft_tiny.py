"""``project/bench/gpu_ttft.py``'s own logic, on CPU: a lent GPU machine is
short, and the StoreConnector hit rows of its first runs were lost (one
measured vLLM's own prefix cache, the next waited on a refused reset).

``--tiny`` serves a 2-layer model on CPU with StoreConnector on the path of
a KV cache on a GPU (``gpu_path_on_cpu.py``: host tier, saves on a thread, a
finished request's blocks kept until its saves are written). vLLM refuses a
prefix-cache reset while it keeps them; the benchmark steps the engine until
the reset takes, so every repeat is a hit the store served (the prompt less
its last token), not vLLM's own cache.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO

BENCH = REPO / "project" / "bench" / "gpu_ttft.py"
TOKENS = 256


def test_tiny_run_resets_the_prefix_cache_and_measures_store_hits(tmp_path: Path):
    out = tmp_path / "out"
    command = [sys.executable, str(BENCH), "--tiny", "--configs", "v1-store"]
    command += ["--lengths", str(TOKENS), "--repeats", "2", "--out", str(out)]
    command += ["--budget-s", "500", "--config-timeout-s", "450"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((out / "gpu_ttft.json").read_text())["results"]["v1-store"]
    assert result["rc"] == 0, (out / "v1-store.log").read_text()[-3000:]
    row = result["per_length"][str(TOKENS)]
    assert row["first"]["cached"] == 0
    assert [hit["cached"] for hit in row["repeats"]] == [TOKENS - 1] * 2
    assert [hit["tokens"] for hit in row["repeats"]] == [row["first"]["tokens"]] * 2
    # Each reset took (before the first request, each repeat, the answer
    # and the control), so vLLM's own cache was empty at each repeat. The
    # first follows the warm-up request, whose saves kept its blocks until
    # a later step: refused at least once.
    assert len(result["reset_steps"]) == 5
    assert result["reset_steps"][0] >= 1
    log = (out / "v1-store.log").read_text()
    assert "batched transfers through a host tier" in log
    assert "Failed to reset prefix cache" in log

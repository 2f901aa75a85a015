"""The ``tensor_parallel_2`` scenario: the connector under two ranks.

A TP=2 engine cannot run in the kit's process (its workers are processes of
their own), so ``run_tp2`` starts this module as a child process, which
builds ``vllm.LLM`` with two ranks on the tiny model (float32: two ranks sum
the heads in another order than one, and float32 keeps greedy tokens the
same), serves the reference prompt three times (a miss that stores, a repeat
the connector should serve, and vLLM's recompute: a request that reads no
cached prefix) and prints one ``RESULT`` line. The parent compares: the
repeat must take a hit and give the recompute's tokens; a child that hangs
past the timeout, crashes or errors fails the scenario. It costs an engine
start on two cores (about a minute here), so it runs only when asked
(``--tp2``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from vllm_kv_conformance.engine import BLOCK_SIZE, MAX_MODEL_LEN
from vllm_kv_conformance.results import ScenarioResult, Status

NAME = "tensor_parallel_2"
RESULT = "RESULT "
MAX_TOKENS = 8


def run_tp2(
    kv_transfer_config: dict[str, Any],
    model_dir: Path,
    prompt: list[int],
    timeout_s: float = 600.0,
) -> ScenarioResult:
    """Serve ``prompt`` through the connector on a TP=2 engine in a child
    process and judge what it printed."""
    request = {"config": kv_transfer_config, "model": str(model_dir), "prompt": prompt}
    env = dict(os.environ)
    # Two ranks, one core each; the child's engine core runs in its own
    # process as vLLM's multiprocess executor requires.
    env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    # The child imports this package however the parent found it.
    kit_src = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [kit_src, env.get("PYTHONPATH")]))
    try:
        child = subprocess.run(
            [sys.executable, "-m", "vllm_kv_conformance.tp2", json.dumps(request)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return ScenarioResult(
            NAME, Status.FAIL, f"the TP=2 engine did not finish in {timeout_s:.0f} s"
        )
    lines = [line for line in child.stdout.splitlines() if line.startswith(RESULT)]
    if child.returncode != 0 or not lines:
        tail = (child.stderr.strip().splitlines() or ["no output"])[-1]
        why = f"the TP=2 engine failed (exit {child.returncode}): {tail}"
        return ScenarioResult(NAME, Status.FAIL, why)
    return judge(json.loads(lines[-1][len(RESULT) :]))


def judge(served: dict[str, Any]) -> ScenarioResult:
    """PASS when the repeat was served from the connector on both ranks with
    the recompute's tokens."""
    miss, repeat, recompute = served["miss"], served["repeat"], served["recompute"]
    if repeat["num_cached_tokens"] <= 0:
        return ScenarioResult(
            NAME, Status.FAIL, "the repeat took no hit from the connector under TP=2"
        )
    for what, answer in (("miss", miss), ("repeat", repeat)):
        if answer["token_ids"] != recompute["token_ids"]:
            return ScenarioResult(
                NAME,
                Status.FAIL,
                f"the {what}'s tokens {answer['token_ids']} differ from the "
                f"recompute's {recompute['token_ids']} under TP=2",
            )
    return ScenarioResult(
        NAME,
        Status.PASS,
        f"two ranks: the repeat hit {repeat['num_cached_tokens']} tokens and gave "
        "the recompute's tokens; a per-rank fault is not injected",
    )


def _serve(request: dict[str, Any]) -> dict[str, Any]:
    """The child's side: the engine, the three requests, their answers."""
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from vllm import LLM, SamplingParams

    llm = LLM(
        model=request["model"],
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=False,
        enforce_eager=True,
        seed=0,
        # On CPU the share of host memory the engine may reserve.
        gpu_memory_utilization=0.1,
        kv_transfer_config=KVTransferConfig(**request["config"]),
    )
    prompt = TokensPrompt(prompt_token_ids=request["prompt"])

    def answer(**extra: Any) -> dict[str, Any]:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **extra)
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        return {
            "token_ids": list(output.outputs[0].token_ids),
            "num_cached_tokens": output.num_cached_tokens or 0,
        }

    return {
        "miss": answer(),
        "repeat": answer(),
        "recompute": answer(skip_reading_prefix_cache=True),
    }


if __name__ == "__main__":
    print(RESULT + json.dumps(_serve(json.loads(sys.argv[1]))), flush=True)

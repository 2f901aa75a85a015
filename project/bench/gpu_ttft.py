"""TTFT of a repeated prompt on a GPU, in one call of a lent machine:
recompute, OffloadingConnector's hit, StoreConnector's first request, its
hot hit (host tier) and its cold hit (a second, fresh process on the same
store), and a greedy check of the hit's answer.

Needs a CUDA machine with the patched vLLM and the reference connector
installed; no network (the model is a Llama-3.1-8B-shaped config with
vLLM's dummy weights, re-initialised like a fresh checkpoint and seeded, so
every process serves the same model and answers depend on the context).

    python project/bench/gpu_ttft.py --out results/            # plan 1
    python project/bench/gpu_ttft.py --plan 2 --out results/   # V1, graphs, load_async
    python project/bench/gpu_ttft.py --plan-only               # the time plan alone
    python project/bench/gpu_ttft.py --summarize results/      # summary.md again
    python3 project/bench/gpu_ttft.py --kit build/bundle --out results/  # offline

``--kit`` installs the kit ``./wb bundle`` built (``offline_kit.py``; once
per kit, reused after) and runs every process with it on ``PYTHONPATH``:
the one command a GPU host without a package index needs.

Plan 1 runs on Model Runner V2 at 4k and 32k tokens: recompute (no
connector), OffloadingConnector, StoreConnector (first request, hot hit),
then StoreConnector again in a fresh process on the first one's store (cold
hit). Plan 2: V1, CUDA graphs and ``load_async``. The time plan is printed
before any engine starts, and steps that would not fit ``--budget-s`` are
trimmed, least important first (``gpu_plan.py``). Each configuration runs
in its own process (offline ``LLM`` API, engine in process), one after
another. Per length: an unrelated warm-up prompt, then the prompt; vLLM's
prefix cache is reset before each timed request that must not hit it.

Each figure is appended to ``results.jsonl`` by the process that measured
it, flushed to disk at once: a run stopped at any point keeps every figure
so far, and ``--summarize`` builds the table from them. ``--out`` holds
``plan.json``, ``results.jsonl``, ``summary.md`` and ``processes.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import machine as bench_machine
from gpu_plan import GREEDY, TOKENS, make_plan, render_plan, summarize
from offline_kit import KitError, install, with_site

LLAMA_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
# --tiny: the same run on a 2-layer model, to try the script without a GPU
# (StoreConnector then takes the GPU path over host memory: gpu_path_on_cpu.py).
# Its answers barely depend on the context, so its control check says nothing.
TINY = {
    **LLAMA_8B,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 32000,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

GiB = 2**30


def connector(kind: str, store_dir: str, cuda: bool) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` of a process's connector."""
    if kind == "none":
        return None
    if kind == "offload":
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 16 * GiB},
        }
    extra: dict[str, Any] = {
        "path": store_dir,
        "capacity": "48GiB",
        "host_tier": "16GiB",
    }
    if kind == "store-async":
        extra["load_async"] = True
    elif kind != "store":
        raise ValueError(f"unknown connector {kind!r}")
    config = {
        "kv_connector": "StoreConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
    if not cuda:  # --tiny: the GPU path over host memory (gpu_path_on_cpu.py)
        config["kv_connector"] = "BatchedStoreConnector"
        config["kv_connector_module_path"] = "gpu_path_on_cpu"
    return config


def reinit_weights(worker: Any, factor: float = 0.02) -> int:
    """On the worker: norms 1, matrices N(0, factor), seeded."""
    import torch

    model = worker.model_runner.model
    torch.manual_seed(1234)
    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_floating_point():
                continue
            if p.dim() == 1:
                p.fill_(1.0 if "norm" in name else 0.0)
            else:
                p.normal_(0.0, factor)
            n += 1
    return n


def runner_class(worker: Any) -> str:
    runner = type(worker.model_runner)
    return f"{runner.__module__}.{runner.__name__}"


def prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(1000, vocab - 1) for _ in range(n)]


def append(results: Path, row: dict[str, Any]) -> None:
    """One line, on disk before the caller goes on: a kill loses nothing
    measured before it."""
    with open(results, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def child(spec: dict[str, Any]) -> None:
    """One process of the plan: its steps, each figure appended at once."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    # Greedy requests only; FlashInfer (its sampler's default) is neither in
    # the kit nor in the GPU image, and the check imports it.
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if spec["runner"] == "v2" else "0"
    # On CPU (--tiny) vLLM would take most of the host's memory for KV.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from vllm.inputs import TokensPrompt
    from vllm.v1.metrics.reader import Counter

    from vllm import LLM, SamplingParams

    cuda = torch.cuda.is_available()
    results = Path(spec["results"])
    kw: dict[str, Any] = dict(
        model=spec["model"],
        skip_tokenizer_init=True,
        load_format="dummy",
        dtype="bfloat16" if cuda else "float32",
        max_model_len=spec["max_len"] + 64,
        enable_prefix_caching=True,
        enforce_eager=not spec["graphs"],
        seed=0,
        # The connector's counters reach get_metrics only with stats on.
        disable_log_stats=False,
    )
    if cuda:
        kw["gpu_memory_utilization"] = 0.85
    transfer = connector(spec["connector"], spec["store"], cuda)
    if transfer is not None:
        kw["kv_transfer_config"] = transfer
    t0 = time.perf_counter()
    llm = LLM(**kw)
    start_s = round(time.perf_counter() - t0, 1)
    llm.collective_rpc(reinit_weights)
    runner = "v2" if llm.llm_engine.vllm_config.use_v2_model_runner else "v1"
    base = {"process": spec["name"], "pid": os.getpid(), "runner": runner}
    append(results, {**base, "event": "start", "start_s": start_s,
                     "model_runner": llm.collective_rpc(runner_class)[0],
                     "graphs": spec["graphs"], "torch": torch.__version__})  # fmt: skip
    vocab = spec["vocab"]
    one = SamplingParams(max_tokens=1, temperature=0.0)
    answer = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)

    def counters() -> dict[str, float]:
        """The connector's counters so far (``vllm:kvlc_store_*``)."""
        out: dict[str, float] = {}
        for m in llm.get_metrics():
            if isinstance(m, Counter) and m.name.startswith("vllm:kvlc_store_"):
                name = m.name.removeprefix("vllm:kvlc_store_")
                out[name] = out.get(name, 0) + m.value
        return out

    def timed(ids: list[int], params: SamplingParams) -> dict[str, Any]:
        before = counters()
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        s = time.perf_counter() - t
        after = counters()
        return {
            "s": round(s, 4),
            "cached": out[0].num_cached_tokens,
            "tokens": list(out[0].outputs[0].token_ids),
            "counters": {
                k: int(v - before.get(k, 0))
                for k, v in after.items()
                if v != before.get(k, 0)
            },
        }

    reset_steps: list[int] = []

    def reset() -> None:
        # vLLM refuses while a connector holds finished requests' blocks
        # (StoreConnector until their saves are written), and gives them
        # back at a later engine step: step with a one-token request until
        # the reset takes, or a repeat would hit vLLM's own prefix cache.
        deadline = time.monotonic() + 120
        steps = 0
        while not llm.reset_prefix_cache():
            assert time.monotonic() < deadline, "prefix cache never reset"
            llm.generate([TokensPrompt(prompt_token_ids=[7])], one, use_tqdm=False)
            steps += 1
            time.sleep(0.05)
        reset_steps.append(steps)

    def emit(figure: str, length: int, r: dict[str, Any], **extra: Any) -> None:
        row = {**base, "figure": figure, "length": length, **r, **extra}
        row["reset_steps"] = reset_steps[-1] if reset_steps else None
        append(results, row)
        print(f"[{spec['name']}] L={length} {figure}: {r['s']:.3f} s, "
              f"cached {r['cached']}, {r['counters']}", flush=True)  # fmt: skip

    role = spec["role"]
    # Most important first (the plan's order): a process stopped at the
    # budget has measured what mattered most.
    for item in spec["items"]:
        if item == GREEDY:
            n = spec["greedy_length"]
            rng = random.Random(n)
            g = prompt(rng, vocab, n)
            control = prompt(rng, vocab, n // 2) + g[n // 2 :]
            reset()
            timed(g, answer)  # computed by vLLM, and saved
            resident = timed(g, answer)  # vLLM's own prefix cache
            reset()
            hit = timed(g, answer)  # the connector's
            reset()
            other = timed(control, answer)
            emit("greedy", n, hit, same=hit["tokens"] == resident["tokens"],
                 resident_tokens=resident["tokens"], resident_cached=resident["cached"],
                 control_differs=other["tokens"] != resident["tokens"])  # fmt: skip
            continue
        length = int(item)
        rng = random.Random(length)
        a = prompt(rng, vocab, length)
        warm = prompt(rng, vocab, length)
        if role == "cold":
            # Both prompts were written by another process: the warm-up is
            # a cold hit too, so the figure is not the first load's set-up.
            emit("warm-up", length, timed(warm, one))
            reset()
            emit("cold hit", length, timed(a, one))
            continue
        emit("warm-up", length, timed(warm, one))
        if role == "recompute":
            emit("recompute", length, timed(a, one))
            for _ in range(2):
                emit("resident hit", length, timed(a, one))
            continue
        reset()
        emit("first request", length, timed(a, one))
        for _ in range(2):
            reset()
            emit("hit" if role == "offload" else "hot hit", length, timed(a, one))
    # Every save written before the process ends: the cold process reads them.
    reset()
    append(results, {**base, "event": "done", "reset_steps": reset_steps})


def machine() -> str:
    """The GPU, driver and host CPU (with its dtype flags), as one line."""
    gpu = "no GPU"
    with_smi = shutil.which("nvidia-smi")
    if with_smi:
        gpu = subprocess.run(
            [with_smi, "--query-gpu=name,memory.total,driver_version",
             "--format=csv,noheader"],
            capture_output=True, text=True, check=False,
        ).stdout.strip().replace("\n", "; ")  # fmt: skip
    return f"{gpu} | {bench_machine.describe()}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", type=int, choices=(1, 2), default=1,
                   help="1: V2 recompute/Offloading/Store hot and cold hits; "
                   "2: V1, CUDA graphs, load_async")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=330,
                   help="the whole run's seconds: the plan is trimmed to fit, "
                   "and a process still running at the end is stopped")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-ttft")))
    p.add_argument("--tiny", action="store_true", help="a 2-layer model, on CPU")
    p.add_argument("--kit", type=Path,
                   help="run with the kit ./wb bundle wrote to this folder, "
                   "installed first if it is not yet")  # fmt: skip
    p.add_argument("--kit-dest", type=Path,
                   help="where the kit is installed "
                   "(default: ~/.cache/kvlc-kit/SHA)")  # fmt: skip
    p.add_argument("--plan-only", action="store_true",
                   help="print the time plan and exit")  # fmt: skip
    p.add_argument("--summarize", type=Path, metavar="DIR",
                   help="rebuild DIR/summary.md from DIR/results.jsonl")  # fmt: skip
    args = p.parse_args()
    if args.summarize:
        text = summarize(args.summarize)
        (args.summarize / "summary.md").write_text(text)
        print(text, end="")
        return 0
    t_start = time.monotonic()
    if args.kit and not args.plan_only:
        try:
            site = install(args.kit, args.kit_dest)
        except KitError as e:
            print(f"gpu_ttft: {e}", file=sys.stderr)
            return 1
        os.environ.update(with_site(site))
    plan = make_plan(args.plan, args.tiny, args.budget_s)
    print("\n".join(render_plan(plan)), flush=True)
    if args.plan_only:
        return 0
    plan.machine = machine()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(plan.to_json(), indent=1))
    results = out / "results.jsonl"
    results.unlink(missing_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-ttft-"))
    config = TINY if args.tiny else LLAMA_8B
    model = work / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    deadline = t_start + args.budget_s
    with open(out / "processes.log", "w") as log:
        for proc in plan.processes:
            items = [s.item for s in plan.steps if s.process == proc.name]
            if not items:
                continue
            spec = {
                "name": proc.name, "runner": proc.runner, "connector": proc.connector,
                "role": proc.role, "graphs": proc.graphs, "items": items,
                "model": str(model), "vocab": config["vocab_size"],
                "max_len": max(plan.lengths + [plan.greedy_length]),
                "greedy_length": plan.greedy_length,
                "store": str(work / f"store-{proc.writer or proc.name}"),
                "results": str(results),
            }  # fmt: skip
            log.write(f"\n===== {proc.name}: {json.dumps(spec)}\n")
            log.flush()
            t = time.monotonic()
            left = deadline - t
            rc: int | str = "not started: out of time"
            if left >= 5:
                try:
                    rc = subprocess.run(
                        [sys.executable, __file__, "--child", json.dumps(spec)],
                        stdout=log, stderr=subprocess.STDOUT, timeout=left,
                        check=False,
                    ).returncode  # fmt: skip
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            wall = round(time.monotonic() - t, 1)
            append(results, {"process": proc.name, "event": "exit", "rc": rc,
                             "wall_s": wall})  # fmt: skip
            print(f"== {proc.name}: rc={rc} in {wall} s", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    text = summarize(out)
    (out / "summary.md").write_text(text)
    print(text, end="", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
    else:
        sys.exit(main())

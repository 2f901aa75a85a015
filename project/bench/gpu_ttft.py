"""TTFT of a repeated prompt on a GPU: recompute, vLLM's resident hit, and
each external KV cache's hit and first request, with a check of the answer.

Needs a CUDA machine with the patched vLLM and the reference connector
installed; no network (the model is a Llama-3.1-8B-shaped config with
vLLM's dummy weights, re-initialised like a fresh checkpoint and seeded, so
every process serves the same model and answers depend on the context).

Each configuration runs in its own process (offline ``LLM`` API, engine in
process), one after another, so no two share the GPU while timed. Per
prompt length ``L``: an unrelated warm-up prompt of the same length, the
first request of prompt A (``max_tokens=1``; with a connector it also
saves), ``--repeats`` repeats of A with vLLM's prefix cache reset before
each (a hit can only come from the connector; the first may race the saves
of the first request, so the table takes the best), two resident repeats
(vLLM's own prefix cache), then a 16-token greedy answer to A and to a
control A' whose first half differs. Every configuration's answer must
equal OffloadingConnector's (vLLM's own CPU tier) and differ from the
control's: a wrong KV shows.

    python project/bench/gpu_ttft.py --out results/   # all configurations
    python project/bench/gpu_ttft.py --configs v2-none,v2-store --lengths 4096

Writes ``gpu_ttft.json`` (every figure) and ``gpu_ttft.md`` (the table, with
the machine line) to ``--out``. ``--budget-s`` skips what would not finish
in time (a lent GPU machine is short); what was skipped is listed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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


def offloading(cpu_gib: int) -> dict[str, Any]:
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_gib * GiB},
    }


def store(path: str, cuda: bool, **extra: Any) -> dict[str, Any]:
    config = {
        "kv_connector": "StoreConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"path": path, "capacity": "48GiB", **extra},
    }
    if not cuda:  # --tiny: the GPU path over host memory (gpu_path_on_cpu.py)
        config["kv_connector"] = "BatchedStoreConnector"
        config["kv_connector_module_path"] = "gpu_path_on_cpu"
    return config


def connector(kind: str, store_dir: str, cuda: bool) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` of a configuration's connector."""
    if kind == "none":
        return None
    if kind == "offload":
        return offloading(16)
    if kind == "store":  # the host tier holds the hit: one copy over the link
        return store(store_dir, cuda, host_tier="16GiB")
    if kind == "store-cold":  # no host tier: every hit read from the store
        return store(store_dir, cuda, host_tier=0)
    if kind == "store-async":
        return store(store_dir, cuda, host_tier="16GiB", load_async=True)
    if kind == "multi":
        # The composition not picked: vLLM's own CPU tier in front of the
        # store through MultiConnector (a hit in host memory is
        # OffloadingConnector's, one only in the store the store's).
        return {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "connectors": [offloading(16), store(store_dir, cuda, host_tier=0)]
            },
        }
    raise ValueError(f"unknown connector {kind!r}")


# name -> (model runner, connector, CUDA graphs); run in this order.
CONFIGS: dict[str, tuple[str, str, bool]] = {
    "v2-none": ("v2", "none", False),
    "v2-offload": ("v2", "offload", False),
    "v2-store": ("v2", "store", False),
    "v2-store-cold": ("v2", "store-cold", False),
    "v2-multi": ("v2", "multi", False),
    "v1-store": ("v1", "store", False),
    "v2-store-graphs": ("v2", "store", True),
    "v2-store-async": ("v2", "store-async", False),
    "v1-offload": ("v1", "offload", False),
    "v1-store-graphs": ("v1", "store", True),
}


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


def prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(1000, vocab - 1) for _ in range(n)]


def child(spec: dict[str, Any]) -> None:
    """One configuration, in this process; prints one RESULT line."""
    runner, kind, graphs = CONFIGS[spec["name"]]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
    # On CPU (--tiny) vLLM would take most of the host's memory for KV.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from vllm.inputs import TokensPrompt

    from vllm import LLM, SamplingParams

    cuda = torch.cuda.is_available()
    kw: dict[str, Any] = dict(
        model=spec["model"],
        skip_tokenizer_init=True,
        load_format="dummy",
        dtype="bfloat16" if cuda else "float32",
        max_model_len=max(spec["lengths"]) + 64,
        enable_prefix_caching=True,
        enforce_eager=not graphs,
        seed=0,
    )
    if cuda:
        kw["gpu_memory_utilization"] = 0.85
    transfer = connector(kind, spec["store"], cuda)
    if transfer is not None:
        kw["kv_transfer_config"] = transfer
    t0 = time.perf_counter()
    llm = LLM(**kw)
    result: dict[str, Any] = {"start_s": round(time.perf_counter() - t0, 1)}
    result["reinitialised"] = llm.collective_rpc(reinit_weights)
    vocab = spec["vocab"]
    one = SamplingParams(max_tokens=1, temperature=0.0)
    sixteen = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def timed(ids: list[int], params: SamplingParams) -> dict[str, Any]:
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        s = time.perf_counter() - t
        return {
            "s": round(s, 4),
            "cached": out[0].num_cached_tokens,
            "tokens": list(out[0].outputs[0].token_ids),
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

    per_length = {}
    for length in spec["lengths"]:
        rng = random.Random(length)
        a = prompt(rng, vocab, length)
        control = prompt(rng, vocab, length // 2) + a[length // 2 :]
        warm = prompt(rng, vocab, length)
        row: dict[str, Any] = {"warm": timed(warm, one)}
        reset()
        row["first"] = timed(a, one)
        row["repeats"] = []
        for _ in range(spec["repeats"]):
            reset()
            row["repeats"].append(timed(a, one))
        row["resident"] = [timed(a, one) for _ in range(2)]
        reset()
        row["answer"] = timed(a, sixteen)["tokens"]
        reset()
        row["control"] = timed(control, sixteen)["tokens"]
        per_length[str(length)] = row
        print(
            f"[{spec['name']}] L={length} first {row['first']['s']:.3f}s | hits "
            + " ".join(f"{r['s']:.3f}s/{r['cached']}" for r in row["repeats"])
            + " | resident "
            + " ".join(f"{r['s']:.3f}s" for r in row["resident"]),
            flush=True,
        )
    result["per_length"] = per_length
    # Requests stepped before each reset took: above 0 where the connector
    # kept finished requests' blocks for their saves.
    result["reset_steps"] = reset_steps
    print("RESULT " + json.dumps(result), flush=True)


def machine() -> str:
    """The GPU, driver and host CPU, as one line."""
    gpu = "no GPU"
    with_smi = shutil.which("nvidia-smi")
    if with_smi:
        gpu = subprocess.run(
            [with_smi, "--query-gpu=name,memory.total,driver_version",
             "--format=csv,noheader"],
            capture_output=True, text=True, check=False,
        ).stdout.strip().replace("\n", "; ")  # fmt: skip
    cpu = platform.processor() or "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import torch

    return f"{gpu} | {cpu}, {os.cpu_count()} cores | torch {torch.__version__}"


def best(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    return min(rows, key=lambda r: r["s"]) if rows else None


def table(results: dict[str, Any], lengths: list[int]) -> list[str]:
    """Markdown: per configuration and length, the first request, the best
    hit (and the tokens it loaded), and whether its answer is right."""
    ref = results.get("v2-offload") or results.get("v1-offload")
    base = results.get("v2-none")
    lines = [
        "| config | L | first request | vs recompute | best hit | cached | "
        "resident | answer = OffloadingConnector's | control differs |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for name, res in results.items():
        if "per_length" not in res:
            lines.append(f"| {name} | | {res.get('error', 'no result')} | | | | | | |")
            continue
        for length in lengths:
            row = res["per_length"].get(str(length))
            if row is None:
                continue
            hit = best(row["repeats"])
            recompute = base["per_length"][str(length)]["first"]["s"] if base else None
            ratio = f"{row['first']['s'] / recompute:.2f}x" if recompute else "-"
            same = "-"
            ref_row = (ref or {}).get("per_length", {}).get(str(length))
            if ref_row is not None:
                same = "yes" if row["answer"] == ref_row["answer"] else "NO"
            differs = "yes" if row["control"] != row["answer"] else "NO"
            resident = best(row["resident"])
            lines.append(
                f"| {name} | {length} | {row['first']['s']:.3f} s | {ratio} | "
                f"{hit['s']:.3f} s | {hit['cached']} | "
                f"{resident['s'] if resident else 0:.3f} s | {same} | {differs} |"
            )
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated, run in order (default: all)")  # fmt: skip
    p.add_argument("--lengths", default="4096,32768")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-ttft")))
    p.add_argument("--budget-s", type=float, default=480,
                   help="skip a configuration that may not finish by then")  # fmt: skip
    p.add_argument("--config-timeout-s", type=float, default=150)
    p.add_argument(
        "--logs", type=Path, help="one log per configuration (default: --out)"
    )
    p.add_argument("--tiny", action="store_true", help="a 2-layer model, on CPU")
    args = p.parse_args()
    names = [n for n in args.configs.split(",") if n]
    for name in names:
        if name not in CONFIGS:
            p.error(f"unknown configuration {name!r}; known: {', '.join(CONFIGS)}")
    lengths = [int(x) for x in args.lengths.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.logs or args.out
    logs.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-ttft-"))
    config = TINY if args.tiny else LLAMA_8B
    model = work / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    deadline = time.monotonic() + args.budget_s
    results: dict[str, Any] = {}
    skipped: list[str] = []
    line = machine()
    print(line, flush=True)
    for name in names:
        left = deadline - time.monotonic()
        if left < 45:
            skipped.append(name)
            continue
        spec = {
            "name": name,
            "model": str(model),
            "vocab": config["vocab_size"],
            "lengths": lengths,
            "repeats": args.repeats,
            "store": str(work / f"store-{name}"),
        }
        log = logs / f"{name}.log"
        t = time.monotonic()
        try:
            with open(log, "w") as f:
                proc = subprocess.run(
                    [sys.executable, __file__, "--child", json.dumps(spec)],
                    stdout=f, stderr=subprocess.STDOUT,
                    timeout=min(args.config_timeout_s, left), check=False,
                )  # fmt: skip
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        shutil.rmtree(work / f"store-{name}", ignore_errors=True)
        res: dict[str, Any] = {"rc": rc, "wall_s": round(time.monotonic() - t, 1)}
        for text in log.read_text(errors="replace").splitlines():
            if text.startswith("RESULT "):
                res.update(json.loads(text[len("RESULT ") :]))
            elif text.startswith("["):
                print(text, flush=True)
        if "per_length" not in res:
            res["error"] = f"rc={rc}, see {log.name}"
            print(log.read_text(errors="replace")[-2000:], flush=True)
        results[name] = res
        print(f"== {name}: rc={rc} in {res['wall_s']} s", flush=True)
        report = {"machine": line, "lengths": lengths, "results": results,
                  "skipped": skipped}  # fmt: skip
        (args.out / "gpu_ttft.json").write_text(json.dumps(report, indent=1))
    md = [f"Machine: {line}", "", *table(results, lengths)]
    if skipped:
        md += ["", f"Skipped (time budget): {', '.join(skipped)}"]
    (args.out / "gpu_ttft.md").write_text("\n".join(md) + "\n")
    (args.out / "gpu_ttft.json").write_text(json.dumps(
        {"machine": line, "lengths": lengths, "results": results, "skipped": skipped},
        indent=1))  # fmt: skip
    print("\n".join(md), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
    else:
        sys.exit(main())

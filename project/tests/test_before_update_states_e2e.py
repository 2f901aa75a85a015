"""End to end: KVConnectorBase_V1.before_update_states with the real engine.

Each engine runs in its own process (before_update_states_driver.py) on the
demo model. RecordedKVConnector (kv_hits_connector.py) saves the KV the model
computed for each prompt, then in later runs reports worker hits and writes
that KV (or garbage) back. Runs that do not depend on each other run two or
three at a time (an engine's start is mostly one busy core; the CI machine
has two), each later run on its own copy of the saved KV.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
DEMO = HERE.parent / "demo"
DRIVER = HERE / "before_update_states_driver.py"
HIT_TOKENS = 256
# Chunked prefill budget below the long prompt's length: one block a chunk.
CHUNK = 128


def run_engine(model: Path, config: dict[str, Any]) -> list[dict[str, Any]]:
    env = dict(
        os.environ,
        PYTHONPATH=str(HERE),
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
    )
    # vLLM's default binding pins a one-rank engine to core 0, where the
    # engines that run at the same time would share it.
    env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1" if config.get("tp", 1) == 2 else "nobind"
    if config["mode"] is not None:
        for steps in Path(config["path"]).glob("steps-rank*.jsonl"):
            steps.unlink()
    result = subprocess.run(
        [sys.executable, str(DRIVER), str(model), json.dumps(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    line = next(ln for ln in result.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def computed_tokens(path: Path, rank: int = 0) -> int:
    lines = (path / f"steps-rank{rank}.jsonl").read_text().splitlines()
    return sum(json.loads(line)["num_tokens"] for line in lines)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model")
    subprocess.run([sys.executable, str(DEMO / "make_model.py"), str(out)], check=True)
    return out


@pytest.fixture(scope="module")
def captured(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A run without connector, and one that saves each prompt's KV."""
    path = tmp_path_factory.mktemp("kv")
    with ThreadPoolExecutor(2) as pool:
        reference = pool.submit(run_engine, model, {"mode": None})
        capture = pool.submit(run_engine, model, {"mode": "capture", "path": str(path)})
        return {
            "path": path,
            "reference": reference.result(),
            "capture": capture.result(),
            "computed": computed_tokens(path),
        }


# The runs that load the captured KV, by test.
LOADS: dict[str, dict[str, Any]] = {
    "load": {"mode": "load", "hit_tokens": [HIT_TOKENS]},
    "continuation": {
        "mode": "load",
        "hit_tokens": [HIT_TOKENS],
        "hit_on": "continuation",
        "max_num_batched_tokens": CHUNK,
    },
    "garbage": {"mode": "garbage", "hit_tokens": [HIT_TOKENS]},
}


Run = tuple[Path, "Future[list[dict[str, Any]]]"]


@pytest.fixture(scope="module")
def loads(
    model: Path, captured: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Run]:
    """Each of ``LOADS`` on its own copy of the captured KV (a run records
    its steps there), all at once: the copy and the finished run, whose
    result each test takes (a failed run fails its own test only)."""
    paths = {}
    for name in LOADS:
        paths[name] = tmp_path_factory.mktemp(f"kv-{name}")
        shutil.copytree(captured["path"], paths[name], dirs_exist_ok=True)
    with ThreadPoolExecutor(len(LOADS)) as pool:
        return {
            name: (
                paths[name],
                pool.submit(run_engine, model, {**config, "path": str(paths[name])}),
            )
            for name, config in LOADS.items()
        }


def test_capture_run_matches_run_without_connector(captured: dict[str, Any]):
    for ref, cap in zip(captured["reference"], captured["capture"]):
        assert cap["token_ids"] == ref["token_ids"]
        assert cap["num_cached_tokens"] == 0


def test_loaded_kv_gives_same_output_with_fewer_computed_tokens(
    captured: dict[str, Any], loads: dict[str, Run]
):
    path, run = loads["load"]
    load = run.result()
    for ref, cap, out in zip(captured["reference"], captured["capture"], load):
        assert out["token_ids"] == ref["token_ids"]
        # vLLM runs the demo model in bfloat16 on CPU, and a prefill of
        # another length is another GEMM shape: on CPUs with AMX the logprobs
        # then move by up to ~0.03 (measured: the capture run, which loads
        # nothing, differs from the run without connector by 0.031), on
        # others by ~1e-3. The greedy tokens must not move at all.
        assert out["logprobs"] == pytest.approx(ref["logprobs"], abs=5e-2)
        assert out["logprobs"] == pytest.approx(cap["logprobs"], abs=5e-2)
    long_prompt, short_prompt = load
    assert long_prompt["prompt_len"] > HIT_TOKENS
    assert long_prompt["num_cached_tokens"] == HIT_TOKENS
    # The short prompt's hit is clamped: its last token is computed.
    assert short_prompt["prompt_len"] < HIT_TOKENS
    assert short_prompt["num_cached_tokens"] == short_prompt["prompt_len"] - 1
    skipped = HIT_TOKENS + short_prompt["prompt_len"] - 1
    assert computed_tokens(path) == captured["computed"] - skipped


def test_hit_on_continuation_chunk_gives_same_output(
    captured: dict[str, Any], loads: dict[str, Run]
):
    """Chunked prefill with chunks of one block: the connector reports its hit
    in the long prompt's second chunk, on a request the runner already holds.
    The greedy output must equal the run without a connector."""
    path, run = loads["continuation"]
    load = run.result()
    for ref, out in zip(captured["reference"], load):
        assert out["token_ids"] == ref["token_ids"]
        # bf16 noise of other prefill shapes, as above.
        assert out["logprobs"] == pytest.approx(ref["logprobs"], abs=5e-2)
    long_prompt, short_prompt = load
    assert long_prompt["prompt_len"] > 2 * CHUNK
    # The second chunk keeps its last token: CHUNK - 1 tokens skipped.
    assert long_prompt["num_cached_tokens"] == CHUNK - 1
    # The short prompt fits one chunk: no continuation, no hit.
    assert short_prompt["prompt_len"] < CHUNK
    assert short_prompt["num_cached_tokens"] == 0
    assert computed_tokens(path) == captured["computed"] - (CHUNK - 1)


def test_wrong_kv_changes_output(captured: dict[str, Any], loads: dict[str, Run]):
    garbage = loads["garbage"][1].result()
    ref = captured["reference"][0]
    assert garbage[0]["num_cached_tokens"] == HIT_TOKENS
    # Far beyond the bf16 noise above (measured: other tokens, logprobs 2.5
    # apart).
    assert garbage[0]["token_ids"] != ref["token_ids"] or garbage[0][
        "logprobs"
    ] != pytest.approx(ref["logprobs"], abs=0.5)


def test_tp2_ranks_reporting_different_hits_apply_the_minimum(
    model: Path, tmp_path: Path
):
    capture = run_engine(model, {"mode": "capture", "path": str(tmp_path), "tp": 2})
    load = run_engine(
        model,
        {"mode": "load", "path": str(tmp_path), "hit_tokens": [256, 128], "tp": 2},
    )
    assert load[0]["num_cached_tokens"] == 128
    for cap, out in zip(capture, load):
        assert out["token_ids"] == cap["token_ids"]
        # bf16 noise of another prefill length, as above (measured 0.004).
        assert out["logprobs"] == pytest.approx(cap["logprobs"], abs=5e-2)

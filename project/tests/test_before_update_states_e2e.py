"""End to end: KVConnectorBase_V1.before_update_states with the real engine.

Each engine runs in its own process (before_update_states_driver.py) on the
demo model, and runs the prompts once per run it is given, one run after
another. RecordedKVConnector (kv_hits_connector.py) saves the KV the model
computed for each prompt, then in later runs reports worker hits and writes
that KV (or garbage) back; each request carries the run's settings, so one
engine captures, then loads. An engine start costs a minute of CPU and the
runs a few seconds: the module starts one engine per configuration, the
three of one TP rank together (a start is mostly one busy core; the CI
machine has two), and each run on the saved KV gets its own copy of it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
DEMO = HERE.parent / "demo"
DRIVER = HERE / "before_update_states_driver.py"
HIT_TOKENS = 256
# Chunked prefill budget below the long prompt's length: one block a chunk.
CHUNK = 128
# Seconds an engine may take to start and do one run, or one more run.
RUN_TIMEOUT = 900


class Engine:
    """A driver process holding one engine, started at once: ``run`` hands
    it a run and waits for the result (the first, for the engine's start)."""

    def __init__(self, model: Path, log: Path, **engine: Any):
        env = dict(
            os.environ,
            PYTHONPATH=str(HERE),
            VLLM_CPU_KVCACHE_SPACE="1",
            HF_HUB_OFFLINE="1",
        )
        # vLLM's default binding pins a one-rank engine to core 0, where the
        # engines that run at the same time would share it.
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1" if engine.get("tp", 1) == 2 else "nobind"
        self.log = log
        with log.open("w") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, str(DRIVER), str(model), json.dumps(engine)],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )

    def run(self, **run: Any) -> list[dict[str, Any]]:
        """The prompts' results with RecordedKVConnector's ``run`` settings
        (none: the engine has no connector). A run with a ``path`` records
        its steps there, anew."""
        if "path" in run:
            for steps in Path(run["path"]).glob("steps-rank*.jsonl"):
                steps.unlink()
        assert self.process.stdin is not None and self.process.stdout is not None
        watchdog = threading.Timer(RUN_TIMEOUT, self.process.kill)
        watchdog.start()
        try:
            self.process.stdin.write(json.dumps(run) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        except BrokenPipeError:
            line = ""
        finally:
            watchdog.cancel()
        assert line.startswith("RESULT "), (
            f"the engine exited ({self.process.poll()}):\n"
            + self.log.read_text()[-8000:]
        )
        return json.loads(line.removeprefix("RESULT "))

    def stop(self) -> None:
        """Let the driver end (its engine's shutdown takes ~8 s)."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.close()
        except BrokenPipeError:
            pass

    def close(self) -> None:
        """Stop the driver and wait for its end."""
        self.stop()
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def computed_tokens(path: Path, rank: int = 0) -> int:
    lines = (path / f"steps-rank{rank}.jsonl").read_text().splitlines()
    return sum(json.loads(line)["num_tokens"] for line in lines)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model")
    subprocess.run([sys.executable, str(DEMO / "make_model.py"), str(out)], check=True)
    return out


# The module's engines of one TP rank. Each configuration needs its own:
# "reference" has no connector (what a connector's runs must give: it cannot
# be an engine with one); "connector" captures, then runs each load that
# takes its hit in the prompt's first step; "chunked" has a scheduler's
# budget below the long prompt, which an engine cannot change (and which
# would split the capture and the first-step loads).
ENGINES: dict[str, dict[str, Any]] = {
    "reference": {},
    "connector": {"connector": True},
    "chunked": {"connector": True, "max_num_batched_tokens": CHUNK},
}


@pytest.fixture(scope="module")
def engines(
    model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Engine]]:
    """``ENGINES``, started together; their logs in ``engines/``."""
    logs = tmp_path_factory.mktemp("engines")
    started = {
        name: Engine(model, logs / f"{name}.log", **config)
        for name, config in ENGINES.items()
    }
    yield started
    # Their shutdowns at once.
    for engine in started.values():
        engine.stop()
    for engine in started.values():
        engine.close()


@pytest.fixture(scope="module")
def captured(
    engines: dict[str, Engine], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """A run without connector, and one that saves each prompt's KV."""
    path = tmp_path_factory.mktemp("kv")
    capture = engines["connector"].run(mode="capture", path=str(path))
    return {
        "path": path,
        "reference": engines["reference"].run(),
        "capture": capture,
        "computed": computed_tokens(path),
    }


def copy_of_captured(captured: dict[str, Any], tmp_path: Path) -> Path:
    """A copy of the captured KV, for one run to load and record steps in."""
    shutil.copytree(captured["path"], tmp_path, dirs_exist_ok=True)
    return tmp_path


def test_capture_run_matches_run_without_connector(captured: dict[str, Any]):
    for ref, cap in zip(captured["reference"], captured["capture"]):
        assert cap["token_ids"] == ref["token_ids"]
        assert cap["num_cached_tokens"] == 0


def test_loaded_kv_gives_same_output_with_fewer_computed_tokens(
    engines: dict[str, Engine], captured: dict[str, Any], tmp_path: Path
):
    path = copy_of_captured(captured, tmp_path)
    load = engines["connector"].run(
        mode="load", path=str(path), hit_tokens=[HIT_TOKENS]
    )
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
    engines: dict[str, Engine], captured: dict[str, Any], tmp_path: Path
):
    """Chunked prefill with chunks of one block: the connector reports its hit
    in the long prompt's second chunk, on a request the runner already holds.
    The greedy output must equal the run without a connector."""
    path = copy_of_captured(captured, tmp_path)
    load = engines["chunked"].run(
        mode="load", path=str(path), hit_tokens=[HIT_TOKENS], hit_on="continuation"
    )
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


def test_wrong_kv_changes_output(
    engines: dict[str, Engine], captured: dict[str, Any], tmp_path: Path
):
    path = copy_of_captured(captured, tmp_path)
    garbage = engines["connector"].run(
        mode="garbage", path=str(path), hit_tokens=[HIT_TOKENS]
    )
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
    # Its own engine: two TP ranks, each pinned to one of the two cores
    # (started after the module's others, which it would only slow down).
    engine = Engine(model, tmp_path / "engine.log", connector=True, tp=2)
    try:
        capture = engine.run(mode="capture", path=str(tmp_path))
        load = engine.run(mode="load", path=str(tmp_path), hit_tokens=[256, 128])
    finally:
        engine.close()
    assert load[0]["num_cached_tokens"] == 128
    for cap, out in zip(capture, load):
        assert out["token_ids"] == cap["token_ids"]
        # bf16 noise of another prefill length, as above (measured 0.004).
        assert out["logprobs"] == pytest.approx(cap["logprobs"], abs=5e-2)

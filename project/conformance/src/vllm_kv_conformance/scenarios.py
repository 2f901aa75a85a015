"""The scenarios, named after the lifecycle contract; each returns a result.

``runner.run_conformance`` calls the functions of ``MAIN_ENGINE`` in order on
one engine (``Run``), then ``failed_load`` once per ``kv_load_failure_policy``
on an engine of its own (the policy is engine configuration), and
``tensor_parallel_2``. Each scenario submits its requests, steps the engine by
hand where it must act between steps (abort, a raising step), compares greedy
tokens with vLLM's own recompute of the same prompt (a request that reads no
cached prefix, so the connector supplies nothing) and ends with
``checks.settle``. What each checks, and which contract text it comes from,
is in the package README.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_kv_conformance import checks, introspect
from vllm_kv_conformance.engine import Completion, KitEngine
from vllm_kv_conformance.prompts import Prompts
from vllm_kv_conformance.recorder import LIFECYCLE, Ledger, LifecycleRecorder
from vllm_kv_conformance.results import ScenarioResult

NO_LIFECYCLE = "vLLM has no external-match lifecycle"


@dataclass
class Run:
    """One engine with the connector under test, and what earlier scenarios
    learned (the hit, the references)."""

    engine: KitEngine
    recorder: LifecycleRecorder
    tracker: checks.ContextTracker
    prompts: Prompts
    config: dict[str, Any]
    lifecycle: bool
    """This vLLM has the lifecycle (the patch stack)."""
    references: dict[str, list[int]] = field(default_factory=dict)
    hit_tokens: int = 0
    """Tokens the hit scenario's repeat was served from the connector."""
    totals: Ledger = field(default_factory=Ledger)
    preempted: list[str] = field(default_factory=list)
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def mode(self) -> str:
        return self.recorder.mode

    def request_id(self, scenario: str, tag: str) -> str:
        return f"{scenario}-{tag}-{next(self._ids)}"


class Scenario:
    """One scenario's requests on ``run``'s engine; ``finish`` settles them."""

    def __init__(self, run: Run, name: str) -> None:
        self.run = run
        self.name = name
        self.ids: list[str] = []
        run.recorder.reset()
        self.leases_before = checks.lease_snapshot(run.engine)

    def submit(self, tag: str, prompt: list[int], recompute: bool = False) -> str:
        rid = self.run.request_id(self.name, tag)
        self.ids.append(rid)
        self.run.engine.submit(rid, prompt, recompute=recompute)
        return rid

    def serve(self, tag: str, prompt: list[int], recompute: bool = False) -> Completion:
        rid = self.submit(tag, prompt, recompute)
        self.run.engine.run_until_idle()
        return self.run.engine.completion(rid)

    def reference(self, name: str, prompt: list[int]) -> list[int]:
        """vLLM's own tokens for ``prompt``: a request that reads no cached
        prefix (``skip_reading_prefix_cache``), so nothing comes from the
        connector; once per prompt and run."""
        if name not in self.run.references:
            self.run.references[name] = self.serve(
                f"recompute-{name}", prompt, recompute=True
            ).token_ids
        return self.run.references[name]

    def finish(self) -> checks.Settled:
        settled = checks.settle(
            self.run.engine, self.run.recorder, self.ids, self.leases_before
        )
        _add(self.run.totals, settled.ledger)
        return settled

    def result(
        self, problems: list[str], what: str, settled: checks.Settled
    ) -> ScenarioResult:
        problems = problems + settled.problems
        if problems:
            return ScenarioResult.failed(self.name, "; ".join(problems))
        return ScenarioResult.passed(self.name, "; ".join([what, *settled.checked]))


def _add(total: Ledger, part: Ledger) -> None:
    for name in (
        "prepared",
        "committed",
        "committed_tokens",
        "aborted",
        "offered_tokens",
        "async_offers",
        "async_commits",
        "legacy_lookups",
        "legacy_allocs",
    ):
        setattr(total, name, getattr(total, name) + getattr(part, name))


def _tokens_differ(served: Completion, reference: list[int], what: str) -> list[str]:
    if served.token_ids == reference:
        return []
    return [
        f"{what}: greedy tokens {served.token_ids} differ from vLLM's recompute "
        f"{reference} (served {served.num_cached_tokens} cached tokens)"
    ]


# -- the lifecycle ------------------------------------------------------------


def miss(run: Run) -> ScenarioResult:
    s = Scenario(run, "miss")
    served = s.serve("fresh", run.prompts.miss)
    settled = s.finish()
    problems = []
    if settled.ledger.committed_tokens or served.num_cached_tokens:
        problems.append(
            f"{max(settled.ledger.committed_tokens, served.num_cached_tokens)} "
            "tokens served for a prompt never stored"
        )
    return s.result(problems, "nothing offered for a fresh prompt", settled)


def hit(run: Run) -> ScenarioResult:
    s = Scenario(run, "hit")
    first = s.serve("first", run.prompts.reference)
    first_tokens = s.run.recorder.ledger.committed_tokens
    repeat = s.serve("repeat", run.prompts.reference)
    settled = s.finish()
    problems: list[str] = []
    if first_tokens or first.num_cached_tokens:
        problems.append(
            f"the first request of a fresh prompt got {first_tokens} tokens"
        )
    else:
        run.references["reference"] = first.token_ids
    if repeat.num_cached_tokens == 0:
        if run.config.get("kv_role") == "kv_producer":
            return ScenarioResult.not_applicable(
                s.name, "kv_role kv_producer: the connector serves no hits"
            )
        problems.append("a repeated prompt got no token from the connector")
    problems += _tokens_differ(repeat, first.token_ids, "the repeat")
    run.hit_tokens = repeat.num_cached_tokens
    what = f"repeat served {repeat.num_cached_tokens} tokens, same tokens as the miss"
    return s.result(problems, what, settled)


def partial_hit(run: Run) -> ScenarioResult:
    s = Scenario(run, "partial_hit")
    if not run.hit_tokens:
        return ScenarioResult.not_applicable(s.name, "no hit (see hit)")
    served = s.serve("prefix", run.prompts.partial)
    reference = s.reference("partial", run.prompts.partial)
    settled = s.finish()
    shared = run.prompts.shared_prefix
    if served.num_cached_tokens == 0 and not settled.problems:
        return ScenarioResult.not_applicable(
            s.name,
            f"no token served for a prompt sharing its first {shared} tokens "
            "with a stored one: the connector serves whole prompts only",
        )
    problems = []
    if served.num_cached_tokens > shared:
        problems.append(
            f"{served.num_cached_tokens} tokens served, only {shared} are shared"
        )
    problems += _tokens_differ(served, reference, "the prefix hit")
    what = (
        f"{served.num_cached_tokens} of {shared} shared tokens served, "
        "same tokens as the recompute"
    )
    return s.result(problems, what, settled)


def preemption_while_loading(run: Run) -> ScenarioResult:
    s = Scenario(run, "preemption_while_loading")
    if not run.hit_tokens:
        return ScenarioResult.not_applicable(s.name, "no hit (see hit)")
    reference = run.references.get("reference") or s.reference(
        "reference", run.prompts.reference
    )
    before = len(run.preempted)
    ids = [s.submit(f"r{i}", run.prompts.reference) for i in range(3)]
    run.engine.run_until_idle()
    preempted = sorted(set(run.preempted[before:]))
    served = [run.engine.completion(rid) for rid in ids]
    settled = s.finish()
    if not preempted and not settled.problems:
        return ScenarioResult.not_applicable(
            s.name, "three requests of the hit did not preempt one another"
        )
    problems: list[str] = []
    for rid, completion in zip(ids, served, strict=True):
        problems += _tokens_differ(completion, reference, rid)
    what = (
        f"{len(preempted)} of 3 hit requests preempted after their match was "
        "committed, admitted again; all tokens equal the recompute"
    )
    return s.result(problems, what, settled)


def abort_before_load(run: Run) -> ScenarioResult:
    s = Scenario(run, "abort_before_load")
    rid = s.submit("aborted", run.prompts.reference)
    run.engine.abort(rid)
    run.engine.run_until_idle()
    settled = s.finish()
    return s.result([], "aborted while waiting, before any step", settled)


def abort_after_load(run: Run) -> ScenarioResult:
    s = Scenario(run, "abort_after_load")
    if not run.hit_tokens:
        return ScenarioResult.not_applicable(s.name, "no hit (see hit)")
    rid = s.submit("aborted", run.prompts.reference)
    run.engine.step()
    committed = run.recorder.ledger.committed_tokens
    asynchronous = run.recorder.ledger.async_commits > 0
    run.engine.abort(rid)
    run.engine.run_until_idle()
    settled = s.finish()
    if not committed and not settled.problems:
        return ScenarioResult.not_applicable(
            s.name, "the request was not admitted with a hit in its first step"
        )
    when = "during its asynchronous load" if asynchronous else "after its load"
    what = f"aborted {when} ({committed} tokens committed)"
    return s.result([], what, settled)


def async_load(run: Run) -> ScenarioResult:
    s = Scenario(run, "async_load")
    if not run.totals.async_offers:
        return ScenarioResult.not_applicable(
            s.name, "the connector offered no asynchronous load (load_kv_async)"
        )
    reference = run.references.get("reference") or s.reference(
        "reference", run.prompts.reference
    )
    served = s.serve("loaded", run.prompts.reference)
    asynchronous = run.recorder.ledger.async_commits
    settled = s.finish()
    problems = _tokens_differ(served, reference, "the asynchronous hit")
    if not asynchronous:
        problems.append("the hit was not committed as an asynchronous load")
    what = (
        f"{served.num_cached_tokens} tokens loaded between steps, same tokens as "
        "the recompute"
    )
    return s.result(problems, what, settled)


def step_raises(run: Run) -> ScenarioResult:
    """The scheduler's pass raises right after the connector was asked about
    the request (its match prepared, or its legacy lookup answered)."""
    s = Scenario(run, "step_raises")
    reference = run.references.get("reference") or s.reference(
        "reference", run.prompts.reference
    )
    manager = run.engine.scheduler.kv_cache_manager
    original = manager.allocate_slots
    target_id = s.submit("raised", run.prompts.reference)
    target = run.engine.internal_id(target_id)
    raised: list[str] = []

    def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
        recorder = run.recorder
        asked = target in recorder.open_matches or target in recorder.pending_lookups
        if request.request_id == target and asked and not raised:
            raised.append(target)
            raise RuntimeError("kit: injected failure after the connector was asked")
        return original(request, *args, **kwargs)

    manager.allocate_slots = allocate_slots
    try:
        try:
            run.engine.step()
        except RuntimeError as e:
            if "kit: injected" not in str(e):
                raise
    finally:
        vars(manager).pop("allocate_slots", None)
    if not raised:
        run.engine.run_until_idle()
        s.finish()
        return ScenarioResult.not_applicable(
            s.name, "the connector was not asked about the request in its first step"
        )
    aborted = run.recorder.ledger.aborted
    run.engine.run_until_idle()
    served = run.engine.completion(target_id)
    settled = s.finish()
    problems = []
    if run.mode == LIFECYCLE:
        if not aborted:
            problems.append("the match of the raising pass was not aborted")
        what = "the pass raised after prepare: match aborted, the request served after"
    else:
        what = (
            "the pass raised after the legacy lookup (nothing for vLLM to abort: "
            "the connector's own state), the request served after"
        )
    problems += _tokens_differ(served, reference, "the request after the raise")
    return s.result(problems, what, settled)


# -- correctness -------------------------------------------------------------


def correctness(run: Run) -> ScenarioResult:
    s = Scenario(run, "correctness")
    if not run.hit_tokens:
        return ScenarioResult.not_applicable(s.name, "no hit (see hit)")
    prompts = run.prompts
    control = s.serve("control", prompts.control)
    control_ref = s.reference("control", prompts.control)
    repeat = s.serve("repeat", prompts.reference)
    reference = run.references.get("reference") or s.reference(
        "reference", prompts.reference
    )
    settled = s.finish()
    if control_ref == reference and not settled.problems:
        return ScenarioResult.not_applicable(
            s.name,
            "the control prompt's recompute equals the reference's on this model: "
            "a wrong KV would not show",
        )
    problems = _tokens_differ(repeat, reference, "the hit")
    if control.token_ids != control_ref:
        loaded = (
            " (the reference prompt's tokens)" if control.token_ids == reference else ""
        )
        problems.append(
            "the control prompt (first half changed) served "
            f"{control.num_cached_tokens} cached tokens and answered "
            f"{control.token_ids}{loaded}, not its recompute {control_ref}: "
            "a hit loaded another prompt's KV"
        )
    what = (
        f"hit of {repeat.num_cached_tokens} tokens equals the recompute; the control "
        f"prompt ({control.num_cached_tokens} cached) equals its own recompute, "
        "which differs from the reference's"
    )
    return s.result(problems, what, settled)


# -- the bridge and the scheduler context -------------------------------------


def legacy_bridge(run: Run) -> ScenarioResult:
    name = "legacy_bridge"
    if not run.lifecycle:
        return ScenarioResult.not_applicable(name, f"{NO_LIFECYCLE} (no bridge)")
    if run.mode == LIFECYCLE:
        return ScenarioResult.not_applicable(name, "the connector uses the lifecycle")
    t = run.totals
    if not t.legacy_lookups or not t.legacy_allocs:
        return ScenarioResult.failed(
            name, "the scheduler never called the legacy pair on a legacy connector"
        )
    if run.hit_tokens and not t.committed_tokens and _hits_from_worker_hook(run):
        # kvlc-aibrix: the scheduler's lookup offers 0 and the worker reports
        # the cached prefix in before_update_states; the bridge carries nothing.
        return ScenarioResult.not_applicable(
            name,
            "the connector's hits come from its worker hook (before_update_states), "
            "not through the legacy pair: nothing for the bridge to carry",
        )
    if not run.hit_tokens or not t.committed_tokens:
        return ScenarioResult.failed(name, "no hit served through the bridge")
    return ScenarioResult.passed(
        name,
        f"driven through the bridge: {t.legacy_lookups} lookups, "
        f"{t.legacy_allocs} update_state_after_alloc calls, "
        f"{t.committed_tokens} external tokens, hits equal the recompute",
    )


def _hits_from_worker_hook(run: Run) -> bool:
    """Whether the connector's class overrides the stack's worker hook
    ``before_update_states`` (it reports cached prompt tokens from the worker)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    base = getattr(KVConnectorBase_V1, "before_update_states", None)
    hook = getattr(type(run.engine.connector), "before_update_states", None)
    return base is not None and hook is not None and hook is not base


def scheduler_context(run: Run) -> ScenarioResult:
    name = "scheduler_context"
    if not run.tracker.available:
        return ScenarioResult.not_applicable(name, "vLLM has no scheduler context")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    bind = getattr(type(run.engine.connector), "bind_scheduler_context", None)
    if bind is None or bind is KVConnectorBase_V1.bind_scheduler_context:
        return ScenarioResult.not_applicable(
            name, "the connector does not bind the scheduler context"
        )
    if not run.tracker.contexts:
        return ScenarioResult.not_applicable(name, "no scheduler context was bound")
    held = run.tracker.references_held()
    if held is None:
        return ScenarioResult.not_applicable(
            name, "the scheduler context exposes no reference counts"
        )
    problems = []
    if held:
        problems.append(f"{held} block references held with no request left")
    if run.tracker.over_frees:
        problems.append(f"freed more than touched: {run.tracker.over_frees[0]}")
    if problems:
        return ScenarioResult.failed(name, "; ".join(problems))
    return ScenarioResult.passed(
        name,
        f"{run.tracker.contexts} context(s): every reference released, none freed "
        "twice, after all scenarios",
    )


MAIN_ENGINE: tuple[Callable[[Run], ScenarioResult], ...] = (
    miss,
    hit,
    correctness,
    partial_hit,
    preemption_while_loading,
    abort_before_load,
    abort_after_load,
    async_load,
    step_raises,
    legacy_bridge,
    scheduler_context,
)


# -- a failed load, on an engine per policy --------------------------------------


def failed_load(run: Run, policy: str) -> ScenarioResult:
    """The run's engine is configured with ``kv_load_failure_policy=policy``."""
    s = Scenario(run, f"failed_load_{policy}")
    prompt = run.prompts.failed_load[policy]
    first = s.serve("store", prompt)
    hit_rid = s.submit("hit", prompt)
    run.engine.run_until_idle()
    query = run.recorder.ledger.last_query.get(run.engine.internal_id(hit_rid))
    if not run.engine.completion(hit_rid).num_cached_tokens:
        s.finish()
        return ScenarioResult.not_applicable(s.name, "no hit to break")
    if not introspect.break_hit(run.engine.connector, query):
        s.finish()
        return ScenarioResult.not_applicable(
            s.name, "the connector's fault hook could not break the hit"
        )
    before = run.recorder.ledger.committed_tokens
    broken = s.serve("broken", prompt)
    offered = run.recorder.ledger.committed_tokens - before
    settled = s.finish()
    if not offered and not settled.problems:
        return ScenarioResult.not_applicable(
            s.name, "the connector did not offer the damaged tokens again"
        )
    problems: list[str] = []
    if policy == "recompute":
        if broken.finish_reason == "error":
            problems.append("the request failed under kv_load_failure_policy=recompute")
        problems += _tokens_differ(broken, first.token_ids, "the recomputed request")
        what = f"load of {offered} damaged tokens failed, recomputed to the same tokens"
    else:
        if broken.finish_reason != "error":
            problems.append(
                f"finished {broken.finish_reason!r}, not 'error', under "
                "kv_load_failure_policy=fail"
            )
        what = f"load of {offered} damaged tokens failed the request (finish 'error')"
    return s.result(problems, what, settled)


def tensor_parallel_2(_: Run | None = None) -> ScenarioResult:
    """Without ``--tp2``: the TP=2 engine (tp2.py) costs a minute of two
    cores, so it runs only when asked."""
    return ScenarioResult.not_applicable(
        "tensor_parallel_2",
        "not asked for: --tp2 serves the connector on two ranks in a child "
        "process (vLLM's multiprocess executor, about a minute of two cores)",
    )

"""The checks every scenario ends with, once its requests are finished.

``scenarios.Scenario.finish`` calls ``settle``: the recorder's contract
violations, matches left prepared, ``request_finished`` exactly once for each
request the scenario submitted, leases or pins opened during the scenario and
still open (``introspect.open_leases``; N/A when the connector exposes none),
and blocks of the scheduler's pool not returned (every block is free again
once the engine is idle: local prefix caching is off).

``ContextTracker`` is the scheduler-context check (the stack's
``bind_scheduler_context``): it records every ``KVConnectorSchedulerContext``
vLLM creates while the engine is built (the one bound to the connector and
those it derives with ``new_context``) and reads their own reference counts.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from vllm_kv_conformance.engine import KitEngine
from vllm_kv_conformance.introspect import open_leases
from vllm_kv_conformance.recorder import Ledger, LifecycleRecorder


@dataclass
class Settled:
    """What ``settle`` found: problems (empty when the scenario conforms) and
    one line of what was checked."""

    problems: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)
    ledger: Ledger = field(default_factory=Ledger)


def lease_snapshot(engine: KitEngine) -> frozenset[Hashable] | None:
    return open_leases([engine.connector, engine.worker_connector])


def settle(
    engine: KitEngine,
    recorder: LifecycleRecorder,
    request_ids: list[str],
    leases_before: frozenset[Hashable] | None,
) -> Settled:
    """Check the state once the scenario's requests are done (the engine idle);
    start the recorder's next ledger."""
    out = Settled()
    if engine.busy():
        engine.run_until_idle()

    def released() -> bool:
        after = lease_snapshot(engine)
        leaked = after is not None and bool(after - (leases_before or frozenset()))
        free, usable = engine.free_blocks()
        return not leaked and free == usable

    # What a connector releases between steps (an async load's end) gets a
    # few seconds of idle steps before it counts as left over.
    engine.settle(released)
    ledger = recorder.reset()
    out.ledger = ledger
    out.problems.extend(ledger.violations)
    if recorder.open_matches:
        out.problems.append(f"matches still prepared: {recorder.open_matches}")
    for req_id in request_ids:
        n = ledger.finished.get(engine.internal_id(req_id), 0)
        if n != 1:
            out.problems.append(f"request_finished called {n} times for {req_id}")
    out.checked.append(ledger.summary(recorder.mode))
    leases_after = lease_snapshot(engine)
    if leases_after is None:
        out.checked.append("leases: N/A (connector exposes none)")
    else:
        left = sorted(map(str, leases_after - (leases_before or frozenset())))
        if left:
            out.problems.append(f"{len(left)} lease(s) left open: {', '.join(left)}")
        else:
            out.checked.append("no lease left")
    free, usable = engine.free_blocks()
    if free != usable:
        out.problems.append(f"{usable - free} of {usable} KV blocks not freed")
    return out


class ContextTracker:
    """Scheduler contexts created while an engine is built, and their counts.

    ``tracking`` is the ``KitEngine`` build hook; ``references_held`` and
    ``over_frees`` are read by the ``scheduler_context`` scenario.
    """

    def __init__(self) -> None:
        # Strong references: a context lives as long as its engine anyway,
        # and one the connector dropped must still be counted.
        self._contexts: list[Any] = []
        self.over_frees: list[str] = []
        self.available = False

    @contextmanager
    def tracking(self) -> Iterator[None]:
        try:
            from vllm.distributed.kv_transfer.kv_connector.v1 import (
                scheduler_context,
            )
        except ImportError:
            yield
            return
        # Any: its __init__ is replaced while the engine is built.
        cls: Any = scheduler_context.KVConnectorSchedulerContext
        self.available = True
        original_init = cls.__init__
        tracker = self

        def init(ctx: Any, *args: Any, **kwargs: Any) -> None:
            original_init(ctx, *args, **kwargs)
            tracker._adopt(ctx)

        cls.__init__ = init
        try:
            yield
        finally:
            cls.__init__ = original_init

    def _adopt(self, ctx: Any) -> None:
        self._contexts.append(ctx)
        free_blocks = ctx.free_blocks
        new_context = ctx.new_context
        tracker = self

        def checked_free(block_ids: Any) -> None:
            try:
                free_blocks(block_ids)
            except ValueError as e:
                tracker.over_frees.append(str(e))
                raise

        def tracked_new_context() -> Any:
            child = new_context()
            tracker._adopt(child)
            return child

        ctx.free_blocks = checked_free
        ctx.new_context = tracked_new_context

    def references_held(self) -> int | None:
        """References the contexts took with touch() and have not freed; None
        when a context exposes no counts."""
        total = 0
        for ctx in list(self._contexts):
            touched = getattr(ctx, "_touched", None)
            if touched is None:
                return None
            total += sum(touched)
        return total

    @property
    def contexts(self) -> int:
        return len(self._contexts)

"""Records every lifecycle call the scheduler makes on the connector, and checks
the contract as it goes.

``runner.run_conformance`` installs one ``LifecycleRecorder`` on the
scheduler-side connector of each ``KitEngine``: it replaces the instance's
methods the scheduler calls (instance attributes shadow the class's, so
vLLM's scheduler calls the recorder, which calls the connector's own
method). Which methods depends on how this scheduler drives the connector:

- ``lifecycle``: ``prepare_external_match`` / ``commit_external_match`` /
  ``abort_external_match`` (the stack's ``ExternalMatchLifecycle``);
- ``legacy``: ``get_num_new_matched_tokens`` / ``update_state_after_alloc``
  (vLLM 0.32.0, or the stack's bridge for a connector that implements only
  that pair);

and ``request_finished`` (``request_finished_all_groups`` for a
``SupportsHMA`` connector) in both. The checks are the contract's text
(``external_match.py`` and ``base.py`` of the stack): every prepared match
gets exactly one commit or abort, before the next prepare of its request,
before the request is freed and before the scheduling pass ends; a commit
carries the prepared ``query_result`` and at most the prepared tokens; no
commit or abort of a match that is not open (so none after an abort); a
non-zero commit only from a prepared match; ``load_kv_async`` only with
tokens; ``request_finished`` exactly once per request. The engine calls
``end_of_step`` after every step (``KitEngine.on_step``).

A broken guarantee is recorded, not raised: the scenario in which it happened
fails with its text, and the engine keeps running the other scenarios.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

LIFECYCLE = "lifecycle"
LEGACY = "legacy"


@dataclass
class Ledger:
    """The calls of one scenario (``LifecycleRecorder.reset`` starts a new one)."""

    prepared: int = 0
    committed: int = 0
    committed_unprepared: int = 0
    """Commits of NO_EXTERNAL_MATCH for a request with no prepared match (a
    resume after an async load, a request that reads no cached prefix)."""
    committed_tokens: int = 0
    aborted: int = 0
    offered_tokens: int = 0
    async_offers: int = 0
    async_commits: int = 0
    legacy_lookups: int = 0
    legacy_allocs: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    last_query: dict[str, Any] = field(default_factory=dict)
    """The ``query_result`` of each request's last prepared match (the
    failed-load scenarios hand it to the fault hook)."""

    def summary(self, mode: str) -> str:
        if mode == LIFECYCLE:
            return (
                f"{self.prepared} matches prepared = {self.committed} committed + "
                f"{self.aborted} aborted"
            )
        return (
            f"{self.legacy_lookups} lookups, {self.legacy_allocs} "
            "update_state_after_alloc calls"
        )


class LifecycleRecorder:
    """Wraps one scheduler-side connector instance; see the module docstring.

    Args:
        connector: the scheduler's connector (``Scheduler.connector``).
        mode: ``LIFECYCLE`` or ``LEGACY``, as ``driving_mode`` says for this
            scheduler.
    """

    def __init__(self, connector: Any, mode: str) -> None:
        self.connector = connector
        self.mode = mode
        self.ledger = Ledger()
        self._open: dict[str, Any] = {}
        self._legacy_offer: dict[str, tuple[int, bool]] = {}
        self._ever_finished: set[str] = set()
        self._finishing: set[str] = set()
        self._installed: list[str] = []
        self._install()

    # -- installation ---------------------------------------------------

    def _install(self) -> None:
        names = ["request_finished"]
        if callable(getattr(self.connector, "request_finished_all_groups", None)):
            # SupportsHMA connectors are told through this one instead.
            names.append("request_finished_all_groups")
        if self.mode == LIFECYCLE:
            names += [
                "prepare_external_match",
                "commit_external_match",
                "abort_external_match",
            ]
        else:
            names += ["get_num_new_matched_tokens", "update_state_after_alloc"]
        for name in names:
            original = getattr(self.connector, name)
            wrapper = getattr(self, "_" + name)
            setattr(self.connector, name, _bound(wrapper, original))
            self._installed.append(name)

    def uninstall(self) -> None:
        for name in self._installed:
            vars(self.connector).pop(name, None)
        self._installed = []

    def reset(self) -> Ledger:
        """Start a new scenario's ledger; return the finished one."""
        done, self.ledger = self.ledger, Ledger()
        return done

    def violation(self, text: str) -> None:
        if text not in self.ledger.violations:
            self.ledger.violations.append(text)

    def end_of_step(self) -> None:
        """After every engine step: no match outlives the pass that prepared
        it (``ExternalMatchLifecycle``: end_pass / abort_open)."""
        for req_id in list(self._open):
            self.violation(f"match of {req_id} still prepared after the step")
            del self._open[req_id]

    @property
    def open_matches(self) -> list[str]:
        return list(self._open)

    @property
    def pending_lookups(self) -> list[str]:
        """Requests a legacy lookup answered and no update_state_after_alloc
        has followed yet."""
        return list(self._legacy_offer)

    # -- the lifecycle ---------------------------------------------------

    def _prepare_external_match(
        self, original: Any, request: Any, num_computed_tokens: int
    ) -> Any:
        req_id = request.request_id
        if req_id in self._open:
            self.violation(f"prepare for {req_id} while its match is open")
        if req_id in self._ever_finished:
            self.violation(f"prepare for {req_id} after request_finished")
        match = original(request, num_computed_tokens)
        if match is None:
            return None
        self.ledger.prepared += 1
        num_tokens = getattr(match, "num_tokens", None)
        load_async = bool(getattr(match, "load_kv_async", False))
        if not isinstance(num_tokens, int) or num_tokens < 0:
            self.violation(f"prepare for {req_id} returned {match!r}")
        elif load_async and num_tokens == 0:
            self.violation(f"prepare for {req_id}: load_kv_async with 0 tokens")
        else:
            self.ledger.offered_tokens += num_tokens
            self.ledger.async_offers += load_async
        self._open[req_id] = match
        self.ledger.last_query[req_id] = getattr(match, "query_result", None)
        return match

    def _commit_external_match(
        self, original: Any, request: Any, blocks: Any, match: Any
    ) -> None:
        req_id = request.request_id
        prepared = self._open.pop(req_id, None)
        if prepared is None:
            self.ledger.committed_unprepared += 1
            if match.num_tokens != 0:
                self.violation(
                    f"commit of {match.num_tokens} tokens for {req_id} "
                    "without an open prepared match"
                )
        else:
            if match.query_result is not prepared.query_result:
                self.violation(f"commit for {req_id} with another query_result")
            if not 0 <= match.num_tokens <= prepared.num_tokens:
                self.violation(
                    f"commit of {match.num_tokens} tokens for {req_id}, "
                    f"{prepared.num_tokens} prepared"
                )
            if match.load_kv_async and not prepared.load_kv_async:
                self.violation(f"commit for {req_id}: an async load never offered")
        if match.load_kv_async and match.num_tokens == 0:
            self.violation(f"commit for {req_id}: async load of 0 tokens")
        self.ledger.committed += prepared is not None
        self.ledger.committed_tokens += match.num_tokens
        self.ledger.async_commits += bool(match.load_kv_async)
        original(request, blocks, match)

    def _abort_external_match(self, original: Any, request: Any, match: Any) -> None:
        req_id = request.request_id
        prepared = self._open.pop(req_id, None)
        if prepared is None:
            self.violation(f"abort for {req_id} of a match that is not open")
        elif match is not prepared:
            self.violation(f"abort for {req_id} with another match than prepared")
        self.ledger.aborted += 1
        original(request, match)

    # -- the legacy pair ---------------------------------------------------

    def _get_num_new_matched_tokens(
        self, original: Any, request: Any, num_computed_tokens: int
    ) -> Any:
        answer = original(request, num_computed_tokens)
        num_tokens, load_async = answer
        self.ledger.legacy_lookups += 1
        if num_tokens is not None:
            if num_tokens < 0 or (load_async and num_tokens == 0):
                self.violation(
                    f"get_num_new_matched_tokens for {request.request_id} "
                    f"returned {answer!r}"
                )
            self.ledger.offered_tokens += max(num_tokens, 0)
            self.ledger.async_offers += bool(load_async)
            self._legacy_offer[request.request_id] = (num_tokens, bool(load_async))
        return answer

    def _update_state_after_alloc(
        self, original: Any, request: Any, blocks: Any, num_external_tokens: int
    ) -> Any:
        req_id = request.request_id
        offered, load_async = self._legacy_offer.pop(req_id, (0, False))
        if num_external_tokens > offered:
            self.violation(
                f"update_state_after_alloc with {num_external_tokens} tokens for "
                f"{req_id}, {offered} offered"
            )
        self.ledger.legacy_allocs += 1
        self.ledger.committed_tokens += num_external_tokens
        self.ledger.async_commits += bool(load_async and num_external_tokens)
        return original(request, blocks, num_external_tokens)

    # -- both ----------------------------------------------------------------

    def _request_finished_all_groups(
        self, original: Any, request: Any, block_ids: Any
    ) -> Any:
        return self._request_finished(original, request, block_ids)

    def _request_finished(self, original: Any, request: Any, block_ids: Any) -> Any:
        req_id = request.request_id
        if req_id in self._finishing:
            # request_finished_all_groups calling request_finished (a
            # MultiConnector, the base class): one call of the scheduler.
            return original(request, block_ids)
        self._finishing.add(req_id)
        try:
            return self._finished(original, request, block_ids)
        finally:
            self._finishing.discard(req_id)

    def _finished(self, original: Any, request: Any, block_ids: Any) -> Any:
        req_id = request.request_id
        if req_id in self._open:
            self.violation(f"{req_id} finished with its match still prepared")
        self.ledger.finished[req_id] += 1
        if req_id in self._ever_finished:
            self.violation(f"request_finished called twice for {req_id}")
        self._ever_finished.add(req_id)
        self._legacy_offer.pop(req_id, None)
        return original(request, block_ids)


def _bound(wrapper: Any, original: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        return wrapper(original, *args, **kwargs)

    call.__name__ = getattr(original, "__name__", "wrapped")
    return call


def driving_mode(scheduler: Any) -> str:
    """How ``scheduler`` drives its connector: ``LIFECYCLE`` when it owns an
    ``ExternalMatchLifecycle`` (the stack, a lifecycle connector), else
    ``LEGACY`` (vLLM 0.32.0, or the stack's bridge for a legacy connector)."""
    calls = getattr(scheduler, "external_matches", None)
    if calls is None:
        return LEGACY
    from vllm.distributed.kv_transfer.kv_connector.v1 import external_match

    lifecycle = isinstance(calls, external_match.ExternalMatchLifecycle)
    return LIFECYCLE if lifecycle else LEGACY


def vllm_has_lifecycle() -> bool:
    """Whether this vLLM has the external-match lifecycle (the patch stack)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return hasattr(KVConnectorBase_V1, "prepare_external_match")

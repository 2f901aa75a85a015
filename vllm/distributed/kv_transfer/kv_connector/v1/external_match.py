# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The lifecycle of an external KV match on the scheduler side.

A KV connector offers the tokens it can load for a waiting request in
KVConnectorBase_V1.prepare_external_match(); the scheduler then either admits
the request and calls commit_external_match() with the tokens it accepted, or
does not admit it in this step and calls abort_external_match(). A connector
may therefore pin, lease or prefetch in prepare and know that exactly one of
commit or abort follows.

ExternalMatchLifecycle is the scheduler's side of that contract: it keeps the
matches prepared in the current scheduling pass and aborts those still open
when the pass ends, whichever way the request left the pass.
ExternalMatchChecker checks the contract at runtime for connector authors
(kv_connector_extra_config {"check_external_match_lifecycle": true}).
"""

import dataclasses
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

CHECK_EXTERNAL_MATCH_LIFECYCLE = "check_external_match_lifecycle"


@dataclass(frozen=True)
class ExternalKVMatch:
    """Tokens a KV connector can provide for a request beyond its computed ones.

    Returned by KVConnectorBase_V1.prepare_external_match() and handed back to
    commit_external_match() or abort_external_match() of the same connector.
    """

    num_tokens: int
    """Tokens the connector can load, counted from the num_computed_tokens
    passed to prepare_external_match(). In commit_external_match(): the
    tokens the scheduler accepted, at most the prepared number."""
    load_kv_async: bool = False
    """Whether the tokens are loaded asynchronously, between scheduler steps.
    Must be False when num_tokens is 0."""
    query_result: object | None = None
    """Connector-owned state (a lookup result, a lease, pinned blocks). The
    scheduler never reads it and hands back the very same object."""


NO_EXTERNAL_MATCH = ExternalKVMatch(num_tokens=0)
"""What commit_external_match() receives for a request admitted in a step in
which the connector prepared no match for it (e.g. a request resuming after
its asynchronous load finished)."""


class ExternalMatchLifecycleError(RuntimeError):
    """A guarantee of the external match lifecycle was broken."""


class ExternalMatchLifecycle:
    """Matches prepared in the current scheduling pass, owned by the Scheduler.

    Scheduler.schedule() calls prepare() where it asks the connector for
    external tokens, commit() once the request's blocks are allocated, and
    abort_open() when its pass over the waiting queues ends. A request left
    out of the pass (skipped, or the pass stopped at it) has its match
    aborted there, so no match outlives the pass in which it was prepared:
    commit or abort always comes before the next prepare for the request and
    before the request can be freed.

    The connector is passed to every call rather than bound once, as the
    Scheduler's connector may be replaced after construction (tests do).
    """

    def __init__(self, checker: "ExternalMatchChecker | None" = None) -> None:
        self._open: dict[str, tuple[Request, ExternalKVMatch]] = {}
        self._checker = checker

    @classmethod
    def from_config(
        cls, kv_transfer_config: "KVTransferConfig | None"
    ) -> "ExternalMatchLifecycle":
        """Build the lifecycle, with an ExternalMatchChecker if the connector's
        extra config sets check_external_match_lifecycle to true."""
        check = False
        if kv_transfer_config is not None:
            check = kv_transfer_config.get_from_extra_config(
                CHECK_EXTERNAL_MATCH_LIFECYCLE, False
            )
        if not isinstance(check, bool):
            raise ValueError(
                f"kv_connector_extra_config[{CHECK_EXTERNAL_MATCH_LIFECYCLE!r}] "
                f"must be true or false, got {check!r}."
            )
        return cls(ExternalMatchChecker() if check else None)

    def prepare(
        self,
        connector: "KVConnectorBase_V1",
        request: "Request",
        num_computed_tokens: int,
    ) -> tuple[int | None, bool]:
        """Ask the connector for a match; return (tokens, load_kv_async) as
        get_num_new_matched_tokens() does, (None, False) for "ask again"."""
        if self._checker is not None:
            match = self._checker.prepare(connector, request, num_computed_tokens)
        else:
            match = connector.prepare_external_match(request, num_computed_tokens)
        if match is None:
            return None, False
        self._open[request.request_id] = (request, match)
        return match.num_tokens, match.load_kv_async

    def commit(
        self,
        connector: "KVConnectorBase_V1",
        request: "Request",
        blocks: "KVCacheBlocks",
        num_tokens: int,
        load_kv_async: bool,
    ) -> None:
        """Commit the request's match with the external tokens the scheduler
        accepted (NO_EXTERNAL_MATCH if none was prepared in this pass)."""
        entry = self._open.pop(request.request_id, None)
        if entry is None:
            # No prepare in this pass (e.g. the request's async load ended).
            match = (
                NO_EXTERNAL_MATCH
                if num_tokens == 0
                else ExternalKVMatch(num_tokens, load_kv_async)
            )
        else:
            match = entry[1]
            if (match.num_tokens, match.load_kv_async) != (num_tokens, load_kv_async):
                match = dataclasses.replace(
                    match, num_tokens=num_tokens, load_kv_async=load_kv_async
                )
        if self._checker is not None:
            self._checker.commit(connector, request, blocks, match)
        else:
            connector.commit_external_match(request, blocks, match)

    def abort_open(self, connector: "KVConnectorBase_V1 | None") -> None:
        """Abort every match still open; called when the waiting pass ends."""
        if self._open:
            assert connector is not None
            open_matches, self._open = self._open, {}
            for request, match in open_matches.values():
                if self._checker is not None:
                    self._checker.abort(connector, request, match)
                else:
                    connector.abort_external_match(request, match)
        if self._checker is not None:
            self._checker.check_all_closed()


class ExternalMatchChecker:
    """Checks every call of the lifecycle between scheduler and connector and
    raises ExternalMatchLifecycleError, with the request id and its recent
    calls, when a guarantee is broken or the connector answers something
    that is not a valid match. A debugging aid, off by default; enable it
    with kv_connector_extra_config {"check_external_match_lifecycle": true}.
    """

    def __init__(self, max_history: int = 16, max_requests: int = 4096) -> None:
        self._prepared: dict[str, ExternalKVMatch] = {}
        self._history: OrderedDict[str, deque[str]] = OrderedDict()
        self._max_history = max_history
        self._max_requests = max_requests

    def prepare(
        self,
        connector: "KVConnectorBase_V1",
        request: "Request",
        num_computed_tokens: int,
    ) -> ExternalKVMatch | None:
        req_id = request.request_id
        if req_id in self._prepared:
            self._fail(req_id, "prepare_external_match() while a match is open")
        match = connector.prepare_external_match(request, num_computed_tokens)
        self._record(
            req_id,
            f"prepare_external_match(num_computed_tokens={num_computed_tokens})"
            f" -> {_describe(match)}",
        )
        if match is None:
            return None
        name = type(connector).__name__
        if not isinstance(match, ExternalKVMatch):
            self._fail(
                req_id,
                f"{name}.prepare_external_match() returned {type(match).__name__}; "
                "return an ExternalKVMatch, or None to be asked again later",
            )
        if match.num_tokens < 0 or (match.load_kv_async and match.num_tokens == 0):
            self._fail(
                req_id,
                f"{name}.prepare_external_match() returned an invalid match: "
                "num_tokens must be >= 0 and load_kv_async False when it is 0",
            )
        self._prepared[req_id] = match
        return match

    def commit(
        self,
        connector: "KVConnectorBase_V1",
        request: "Request",
        blocks: "KVCacheBlocks",
        match: ExternalKVMatch,
    ) -> None:
        req_id = request.request_id
        self._record(req_id, f"commit_external_match({_describe(match)})")
        prepared = self._prepared.pop(req_id, None)
        if prepared is None:
            if match != NO_EXTERNAL_MATCH:
                self._fail(req_id, "commit of a match that was not prepared")
        elif match.query_result is not prepared.query_result:
            self._fail(req_id, "commit with another query_result than prepared")
        elif not 0 <= match.num_tokens <= prepared.num_tokens:
            self._fail(req_id, "commit of more tokens than prepared")
        elif match.load_kv_async and not prepared.load_kv_async:
            self._fail(req_id, "commit of an asynchronous load never offered")
        connector.commit_external_match(request, blocks, match)

    def abort(
        self,
        connector: "KVConnectorBase_V1",
        request: "Request",
        match: ExternalKVMatch,
    ) -> None:
        req_id = request.request_id
        self._record(req_id, f"abort_external_match({_describe(match)})")
        prepared = self._prepared.pop(req_id, None)
        if prepared is None:
            self._fail(req_id, "abort of a match that is not open")
        elif match is not prepared:
            self._fail(req_id, "abort with another match than prepared")
        connector.abort_external_match(request, match)

    def check_all_closed(self) -> None:
        """Every prepared match is committed or aborted when a pass ends."""
        for req_id in self._prepared:
            self._fail(req_id, "match still open at the end of the scheduling pass")

    def _record(self, req_id: str, call: str) -> None:
        history = self._history.pop(req_id, None)
        if history is None:
            history = deque(maxlen=self._max_history)
            if len(self._history) >= self._max_requests:
                self._history.popitem(last=False)
        history.append(call)
        self._history[req_id] = history

    def _fail(self, req_id: str, problem: str) -> NoReturn:
        calls = "\n  ".join(self._history.get(req_id, ()))
        raise ExternalMatchLifecycleError(
            f"External KV match lifecycle broken for request {req_id!r}: "
            f"{problem}. Recent calls for this request:\n  {calls}"
        )


def missing_match_api(connector: object, method: str) -> str:
    """The error for a connector that implements neither form of the
    scheduler-side match API, raised from the default of ``method``."""
    return (
        f"{type(connector).__name__} must implement prepare_external_match() "
        "and commit_external_match() (or the legacy get_num_new_matched_tokens() "
        f"and update_state_after_alloc()); {method}() was called and has no "
        "default."
    )


def _describe(match: object) -> str:
    if not isinstance(match, ExternalKVMatch):
        return repr(match)
    query_result = match.query_result
    result = (
        "None"
        if query_result is None
        else f"<{type(query_result).__name__} at {id(query_result):#x}>"
    )
    return (
        f"ExternalKVMatch(num_tokens={match.num_tokens}, "
        f"load_kv_async={match.load_kv_async}, query_result={result})"
    )

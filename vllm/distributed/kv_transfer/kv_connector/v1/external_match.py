# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler's side of the external KV match lifecycle.

The contract (prepare, then exactly one commit or abort) is documented on
KVConnectorBase_V1.prepare_external_match(). ExternalMatchCalls.for_connector()
decides once per scheduler whether a connector speaks the lifecycle or gets
the legacy pair; ExternalMatchLifecycle aborts the matches still open when a
pass ends, also when schedule() raises; ExternalMatchChecker checks the
contract at run time (VLLM_CHECK_EXTERNAL_MATCH_LIFECYCLE=1). No run-time
import of base.py, which imports this module.
"""

import dataclasses
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, NoReturn, TypeVar

import vllm.envs as envs

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

QueryResultT = TypeVar("QueryResultT")

LIFECYCLE_METHODS = (
    "prepare_external_match",
    "commit_external_match",
    "abort_external_match",
)


@dataclass(frozen=True)
class ExternalKVMatch(Generic[QueryResultT]):
    """Tokens a KV connector can provide for a request beyond its computed ones.

    Returned by KVConnectorBase_V1.prepare_external_match() and handed back to
    commit_external_match() or abort_external_match() of the same connector.
    A connector annotates its own plan type, ``ExternalKVMatch[MyPlan]``, and
    reads ``query_result`` back as ``MyPlan | None`` without a cast.
    """

    num_tokens: int
    """Tokens the connector can load, counted from the num_computed_tokens
    passed to prepare_external_match(). In commit_external_match(): the
    tokens the scheduler accepted, at most the prepared number."""
    load_kv_async: bool = False
    """Whether the tokens are loaded asynchronously, between scheduler steps.
    Must be False when num_tokens is 0."""
    query_result: QueryResultT | None = None
    """Connector-owned state (a lookup result, a lease, pinned blocks). The
    scheduler never reads it and hands back the very same object."""


NO_EXTERNAL_MATCH: ExternalKVMatch[Any] = ExternalKVMatch(num_tokens=0)
"""What commit_external_match() receives for a request admitted in a step in
which the connector prepared no match for it (e.g. a request resuming after
its asynchronous load finished)."""


class ExternalMatchLifecycleError(RuntimeError):
    """A guarantee of the external match lifecycle was broken."""


def uses_lifecycle(connector: object) -> bool:
    """Whether the scheduler (or a MultiConnector) drives ``connector``
    through the lifecycle: its uses_external_match_lifecycle is True.
    Anything else, including a Mock configured through the legacy methods
    (whose attribute is a Mock, not True), gets the legacy pair."""
    return getattr(connector, "uses_external_match_lifecycle", False) is True


class ExternalMatchCalls:
    """How the Scheduler asks its connector for external tokens and tells it
    what it admitted; chosen once per scheduler by for_connector().

    Scheduler.schedule() calls prepare() at the lookup, commit() once the
    blocks are allocated and end_pass() after the waiting queues; with no
    connector it calls none of them. This class makes the legacy calls;
    ExternalMatchLifecycle the lifecycle ones. The connector is passed to
    every call, as tests replace the Scheduler's connector after it is built.
    """

    @staticmethod
    def for_connector(connector: "KVConnectorBase_V1 | None") -> "ExternalMatchCalls":
        """ExternalMatchLifecycle for a connector that uses the lifecycle
        (checked by an ExternalMatchChecker when
        VLLM_CHECK_EXTERNAL_MATCH_LIFECYCLE=1), else the legacy calls."""
        if not uses_lifecycle(connector):
            return ExternalMatchCalls()
        check = envs.VLLM_CHECK_EXTERNAL_MATCH_LIFECYCLE
        return ExternalMatchLifecycle(ExternalMatchChecker() if check else None)

    def prepare(
        self,
        connector: "KVConnectorBase_V1",
        request: "Request",
        num_computed_tokens: int,
    ) -> tuple[int | None, bool]:
        """Ask the connector for external tokens: (tokens, load_kv_async),
        (None, False) for "ask again later". A request that does not read the
        prefix cache is still looked up, as before the lifecycle, but takes
        no external tokens."""
        matched = connector.get_num_new_matched_tokens(request, num_computed_tokens)
        if request.skip_reading_prefix_cache:
            return 0, False
        return matched

    def commit(
        self,
        connector: "KVConnectorBase_V1",
        request: "Request",
        blocks: "KVCacheBlocks",
        num_tokens: int,
        load_kv_async: bool,
    ) -> None:
        """Tell the connector the request was admitted with ``num_tokens``
        external tokens and ``blocks`` allocated."""
        connector.update_state_after_alloc(request, blocks, num_tokens)

    def end_pass(
        self,
        connector: "KVConnectorBase_V1 | None",
        new_reqs: list["Request"],
        resumed_reqs: list["Request"],
    ) -> None:
        """The pass over the waiting requests ended, having admitted
        ``new_reqs`` and ``resumed_reqs``. Nothing to release here."""
        return

    def abort_open(self, connector: "KVConnectorBase_V1 | None") -> None:
        """Scheduler.schedule() raised; nothing to release here."""
        return


class ExternalMatchLifecycle(ExternalMatchCalls):
    """Matches prepared in the current scheduling pass, owned by the Scheduler
    when its connector uses the lifecycle.

    A request left out of the pass (skipped, or the pass stopped at it) has
    its match aborted in end_pass(), and every match of a pass that raised in
    abort_open(), so no match outlives the pass in which it was prepared:
    commit or abort always comes before the next prepare for the request and
    before the request can be freed.
    """

    def __init__(self, checker: "ExternalMatchChecker | None" = None) -> None:
        self._open: dict[str, tuple[Request, ExternalKVMatch[Any]]] = {}
        self._checker = checker

    def prepare(
        self,
        connector: "KVConnectorBase_V1",
        request: "Request",
        num_computed_tokens: int,
    ) -> tuple[int | None, bool]:
        """Ask the connector for a match; return (tokens, load_kv_async) as
        get_num_new_matched_tokens() does, (None, False) for "ask again".

        A request that does not read the prefix cache loads nothing, so its
        connector is not asked: a prepare would pin or lease for a match the
        scheduler commits with 0 tokens. Its admission still commits
        NO_EXTERNAL_MATCH."""
        if request.skip_reading_prefix_cache:
            return 0, False
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
        match: ExternalKVMatch[Any]
        if entry is None:
            # No prepare in this pass: the request resumed after its
            # asynchronous load, or does not read the prefix cache. The
            # scheduler takes external tokens only from a prepared match.
            if num_tokens != 0:
                raise ExternalMatchLifecycleError(
                    f"{num_tokens} external tokens committed for request "
                    f"{request.request_id!r} without a prepared match"
                )
            match = NO_EXTERNAL_MATCH
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

    def end_pass(
        self,
        connector: "KVConnectorBase_V1 | None",
        new_reqs: list["Request"],
        resumed_reqs: list["Request"],
    ) -> None:
        """Abort every match still open; called when the pass over the
        waiting requests ends, with the requests it admitted (new and
        resumed), which the checker verifies were all committed."""
        self._abort_open_matches(connector)
        if self._checker is not None:
            self._checker.end_pass(new_reqs, resumed_reqs)

    def abort_open(self, connector: "KVConnectorBase_V1 | None") -> None:
        """Abort every match still open; called when the pass raised."""
        self._abort_open_matches(connector)
        if self._checker is not None:
            self._checker.abandon_pass()

    def _abort_open_matches(self, connector: "KVConnectorBase_V1 | None") -> None:
        if not self._open:
            return
        assert connector is not None
        open_matches, self._open = self._open, {}
        for request, match in open_matches.values():
            if self._checker is not None:
                self._checker.abort(connector, request, match)
            else:
                connector.abort_external_match(request, match)


class ExternalMatchChecker:
    """Checks every call of the lifecycle between scheduler and connector and
    raises ExternalMatchLifecycleError, with the request id and its recent
    calls, when a guarantee is broken or the connector answers something
    that is not a valid match. A debugging aid for connector authors, off by
    default; VLLM_CHECK_EXTERNAL_MATCH_LIFECYCLE=1 turns it on.
    """

    def __init__(self, max_history: int = 16, max_requests: int = 4096) -> None:
        self._prepared: dict[str, ExternalKVMatch[Any]] = {}
        self._committed: set[str] = set()
        self._history: OrderedDict[str, deque[str]] = OrderedDict()
        self._max_history = max_history
        self._max_requests = max_requests

    def prepare(
        self,
        connector: "KVConnectorBase_V1",
        request: "Request",
        num_computed_tokens: int,
    ) -> ExternalKVMatch[Any] | None:
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
        match: ExternalKVMatch[Any],
    ) -> None:
        req_id = request.request_id
        self._record(req_id, f"commit_external_match({_describe(match)})")
        self._committed.add(req_id)
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
        elif match.load_kv_async and match.num_tokens == 0:
            self._fail(req_id, "commit of an asynchronous load of 0 tokens")
        connector.commit_external_match(request, blocks, match)

    def abort(
        self,
        connector: "KVConnectorBase_V1",
        request: "Request",
        match: ExternalKVMatch[Any],
    ) -> None:
        req_id = request.request_id
        self._record(req_id, f"abort_external_match({_describe(match)})")
        prepared = self._prepared.pop(req_id, None)
        if prepared is None:
            self._fail(req_id, "abort of a match that is not open")
        elif match is not prepared:
            self._fail(req_id, "abort with another match than prepared")
        connector.abort_external_match(request, match)

    def end_pass(
        self, new_reqs: list["Request"], resumed_reqs: list["Request"]
    ) -> None:
        """Every prepared match is committed or aborted when a pass ends
        (guarantees 1 and 3), and every request the pass admitted was
        committed, with or without external tokens (guarantee 4)."""
        for req_id in self._prepared:
            self._fail(req_id, "match still open at the end of the scheduling pass")
        for request in (*new_reqs, *resumed_reqs):
            if request.request_id not in self._committed:
                self._record(request.request_id, "admitted")
                self._fail(
                    request.request_id,
                    "admitted without commit_external_match()",
                )
        self._committed.clear()

    def abandon_pass(self) -> None:
        """The pass raised: its admissions are not checked."""
        self._committed.clear()

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

"""Connectors with one planted contract bug each, for test_conformance.py.

Each is ``StoreConnector`` (the project's reference connector) with one
change, loaded by the kit through ``kv_connector_module_path``
("conformance_plants"; pytest puts this directory on ``sys.path``):

- ``PreemptionLeakConnector``: pins each hit it commits until its request
  finishes, but keeps one pin per request id, so the pin of a hit committed
  before a preemption is overwritten (never released) when the request is
  admitted again: fails ``preemption_while_loading``.
- ``AbortLeakConnector``: the same pins, released in ``request_finished``,
  except for an aborted request (an early return): fails
  ``abort_after_load``.
- ``WrongKVConnector``: looks a prompt up by the block hashes of the first
  prompt it saw with the same tokens at positions 192-255 (a key that does
  not cover the whole prefix), so a prompt that differs only in its first
  half loads the other prompt's KV: fails ``correctness``.

``LegacyStoreConnector`` is no plant: ``StoreConnector`` driven through its
legacy pair, the kit's legacy connector with leases.

The pins are visible to the kit through its optional introspection protocol
(``kv_conformance_open_leases``, the kit's README). With
``CONFORMANCE_PLANTS_OFF=1`` in the environment each connector does the right
thing instead, which is how one checks that the tests fail without the plants
(``PLANTED`` below).
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from kvlc_store import StoreConnector
from vllm.v1.request import RequestStatus

PLANTED = os.environ.get("CONFORMANCE_PLANTS_OFF") != "1"
TAIL = slice(192, 256)


class _Pinning(StoreConnector):
    """Takes a pin for every committed hit; ``kv_conformance_open_leases``
    lists the pins held (the scheduler-side instance's; the worker-side
    instance holds none)."""

    _pin_ids = itertools.count()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pins: set[int] = set()
        self.pins_of: dict[str, list[int]] = {}

    def kv_conformance_open_leases(self) -> list[str]:
        return [f"pin-{p}" for p in sorted(self.pins)]

    def commit_external_match(self, request: Any, blocks: Any, match: Any) -> None:
        super().commit_external_match(request, blocks, match)
        if match.num_tokens:
            self._pin(request.request_id)

    def _pin(self, req_id: str) -> None:
        pin = next(self._pin_ids)
        self.pins.add(pin)
        self.pins_of.setdefault(req_id, []).append(pin)

    def _unpin(self, req_id: str) -> None:
        for pin in self.pins_of.pop(req_id, []):
            self.pins.discard(pin)

    def request_finished(self, request: Any, block_ids: Any) -> Any:
        self._unpin(request.request_id)
        return super().request_finished(request, block_ids)


class PreemptionLeakConnector(_Pinning):
    def _pin(self, req_id: str) -> None:
        if not PLANTED:
            super()._pin(req_id)
            return
        # The plant: one pin per request id; a second commit of the same
        # request (admitted again after a preemption) drops the first pin
        # from the books without releasing it.
        pin = next(self._pin_ids)
        self.pins.add(pin)
        self.pins_of[req_id] = [pin]


class AbortLeakConnector(_Pinning):
    def request_finished(self, request: Any, block_ids: Any) -> Any:
        if PLANTED and request.status == RequestStatus.FINISHED_ABORTED:
            # The plant: the abort path skips the release.
            return StoreConnector.request_finished(self, request, block_ids)
        return super().request_finished(request, block_ids)


class WrongKVConnector(StoreConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.by_tail: dict[tuple[int, ...], list[Any]] = {}

    def prepare_external_match(self, request: Any, num_computed_tokens: int) -> Any:
        if not PLANTED:
            return super().prepare_external_match(request, num_computed_tokens)
        # The plant: the lookup key is the prompt's tokens 192-255, so the
        # first prompt seen with those tokens answers for every later one.
        key = tuple((request.prompt_token_ids or [])[TAIL])
        own = request.block_hashes
        request.block_hashes = self.by_tail.setdefault(key, list(own))
        try:
            return super().prepare_external_match(request, num_computed_tokens)
        finally:
            request.block_hashes = own


class LegacyStoreConnector(StoreConnector):
    """Not a plant: ``StoreConnector`` driven through the legacy pair
    (``get_num_new_matched_tokens`` / ``update_state_after_alloc``, which it
    implements for vLLM without the lifecycle), as the stack's bridge drives a
    connector that implements only that pair; its leases stay visible to the
    kit, which ExampleConnector has none of."""

    @property
    def uses_external_match_lifecycle(self) -> bool:
        return False

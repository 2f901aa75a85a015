"""Scheduler-side connectors for the step-cost benchmark (no worker side).

Both do the same work: a lookup of the request's first block hash in a set
(half the requests hit three blocks) and a dict entry per admitted request that
``build_connector_meta`` drains. ``LegacyLookupConnector`` reports through
``get_num_new_matched_tokens``/``update_state_after_alloc``; the lifecycle
variant (defined when the installed vLLM has the lifecycle API) through
``prepare``/``commit``/``abort_external_match``.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

HIT_BLOCKS = 3


class _SchedulerOnly(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.pending: dict[str, int] = {}

    def lookup(self, request: Any, num_computed_tokens: int) -> int:
        hashes = request.block_hashes
        # Even request ids "are stored": a deterministic half of the traffic hits.
        if not hashes or int(request.request_id.rsplit("-", 1)[-1]) % 2:
            return 0
        hit = HIT_BLOCKS * self.block_size - num_computed_tokens
        return max(0, min(hit, request.num_prompt_tokens - 1 - num_computed_tokens))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self.pending.clear()
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        raise AssertionError("scheduler-only benchmark connector")

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise AssertionError("scheduler-only benchmark connector")

    def save_kv_layer(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("scheduler-only benchmark connector")

    def wait_for_save(self) -> None:
        raise AssertionError("scheduler-only benchmark connector")


class LegacyLookupConnector(_SchedulerOnly):
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return self.lookup(request, num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        self.pending[request.request_id] = num_external_tokens


if hasattr(KVConnectorBase_V1, "prepare_external_match"):
    from vllm.distributed.kv_transfer.kv_connector.v1.external_match import (
        ExternalKVMatch,
    )

    class LifecycleLookupConnector(_SchedulerOnly):
        def prepare_external_match(
            self, request: Any, num_computed_tokens: int
        ) -> ExternalKVMatch | None:
            return ExternalKVMatch(self.lookup(request, num_computed_tokens))

        def commit_external_match(
            self, request: Any, blocks: Any, match: ExternalKVMatch
        ) -> None:
            self.pending[request.request_id] = match.num_tokens

        def abort_external_match(self, request: Any, match: ExternalKVMatch) -> None:
            pass

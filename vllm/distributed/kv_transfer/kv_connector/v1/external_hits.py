# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tokens that a worker-side KV connector loads instead of computing them,
reported by KVConnectorBase_V1.before_update_states().

Workers: WorkerExternalHits asks the connector, makes the ranks agree and
returns a new scheduler output; both model runners own one per connector.
Scheduler: record_applied_external_hits() counts the applied hits in the
request's prefill stats and the connector's prefix cache stats, and
num_tokens_computed_in_step() lets the failed-load path
(invalid_block_ids) cover the blocks the hits skipped.
"""

from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.distributed.parallel_state import get_pcp_group, get_tp_group
from vllm.logger import init_logger
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import get_skip_reading_prefix_cache

if TYPE_CHECKING:
    from vllm.v1.metrics.stats import PrefixCacheStats
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request
    from vllm.v1.worker.gpu.states import RequestState

logger = init_logger(__name__)

# Sent instead of a rank id in the reduction when the hook succeeded; any
# real rank id is smaller, so the minimum names the first failing rank.
_NO_FAILURE = 2**62


class WorkerExternalHits:
    """Applies a connector's before_update_states() hits on one worker.

    Each model runner creates one for a connector for which
    uses_worker_external_hits() is True and calls apply() on every step,
    before it updates its request states. Only prompt tokens of requests that
    read the prefix cache and have no speculative tokens may be skipped, never
    the last scheduled or last prompt token; models with Mamba layers or more
    than one KV cache group get no hit (a failed load there could not be
    recomputed). docs/features/disagg_prefill.md gives the reasons.
    """

    def __init__(self, connector: "KVConnectorBase_V1"):
        self.connector = connector
        self.source = f"{type(connector).__name__}.before_update_states()"
        kv_cache_config = connector._kv_cache_config
        self.unsupported_reason: str | None = None
        if kv_cache_config.has_mamba_layers:
            self.unsupported_reason = (
                "the model has Mamba layers, whose state cannot be loaded by "
                "token count"
            )
        elif len(kv_cache_config.kv_cache_groups) > 1:
            self.unsupported_reason = (
                "the model has more than one KV cache group, for which a "
                "failed load cannot be recomputed"
            )
        if self.unsupported_reason is not None:
            logger.warning_once(
                "%s is not applied: %s.", self.source, self.unsupported_reason
            )
        # The hits applied by the last apply(), for this step's
        # KVConnectorOutput.applied_external_hits.
        self.applied: dict[str, int] | None = None
        # Blocks of this step's applied hits that the connector will not
        # load, reported as load errors (invalid_block_ids).
        self.failed_block_ids: set[int] = set()
        # Requests seen in scheduled_new_reqs that must compute their prompt;
        # cached requests do not carry their sampling or pooling params.
        self._skip_reading_req_ids: set[str] = set()
        # Block ids of requests still in their prompt: a later chunk's
        # scheduler output carries only its new blocks, and a failed hit
        # must be reported by the id of its first block.
        self._prompt_block_ids: dict[str, list[int]] = {}
        self._hook_error_logged = False

    def apply(self, scheduler_output: SchedulerOutput) -> SchedulerOutput:
        """Return scheduler_output with the connector's hits applied (each the
        minimum over the ranks sharing this step's batch), recorded in
        ``applied`` and passed to on_external_hits_applied().

        Every tensor- and prefill-context-parallel rank calls this every step;
        when a request may take a hit, all join one all-reduce whatever their
        hook did: a raise or bad value on any rank raises RuntimeError on all.
        If on_external_hits_applied() raises, the hits' loads fail
        (failed_block_ids) and kv_load_failure_policy decides."""
        self.applied = None
        self.failed_block_ids = set()
        self._track_requests(scheduler_output)
        limits = self.limits(scheduler_output)
        if not limits:
            # No request may take a hit; every rank decides this alike from
            # the same scheduler output, so no rank waits for another.
            return scheduler_output

        error: Exception | None = None
        local_hits = [0] * len(limits)
        try:
            hits = self.connector.before_update_states(scheduler_output)
            validate_external_hits(hits, self.source)
            local_hits = [
                min(hits.get(req_id, 0), limit) for req_id, limit in limits.items()
            ]
        except Exception as e:
            error = e
        groups = [
            g.cpu_group for g in (get_tp_group(), get_pcp_group()) if g.world_size > 1
        ]
        rank = dist.get_rank() if groups else 0
        *agreed, failed_rank = all_reduce_min(
            [*local_hits, rank if error is not None else _NO_FAILURE], groups
        )
        if failed_rank != _NO_FAILURE:
            raise RuntimeError(
                f"{self.source} failed on rank {failed_rank}; the step is "
                "stopped on every rank. Fix the connector: the hook must "
                "return a dict of request id to a non-negative int."
            ) from error
        applied = {req_id: n for req_id, n in zip(limits, agreed) if n > 0}
        try:
            self.connector.on_external_hits_applied(dict(applied))
        except Exception:
            # The other ranks already skip these tokens: fail their loads.
            self._fail_loads(scheduler_output, applied)
        if not applied:
            return scheduler_output
        self.applied = applied
        return apply_external_hits(scheduler_output, applied, self.source)

    def limits(self, scheduler_output: SchedulerOutput) -> dict[str, int]:
        """Per request that may take a hit in this step (see the class
        docstring), the most tokens its hit may skip, in scheduling order."""
        if self.unsupported_reason is not None:
            return {}
        # Prompt tokens left to compute, per request that is in its prompt.
        num_prompt_tokens_left: dict[str, int] = {}
        for new_req in scheduler_output.scheduled_new_reqs:
            if new_req.num_computed_tokens < new_req.prompt_len:
                num_prompt_tokens_left[new_req.req_id] = (
                    new_req.prompt_len - new_req.num_computed_tokens
                )
        cached_reqs = scheduler_output.scheduled_cached_reqs
        for req_id, num_output_tokens in zip(
            cached_reqs.req_ids, cached_reqs.num_output_tokens
        ):
            # Without output tokens, every scheduled token is a prompt token.
            if num_output_tokens == 0:
                num_prompt_tokens_left[req_id] = (
                    scheduler_output.num_scheduled_tokens.get(req_id, 0)
                )
        limits: dict[str, int] = {}
        for req_id, num_left in num_prompt_tokens_left.items():
            if (
                req_id in scheduler_output.scheduled_spec_decode_tokens
                or req_id in self._skip_reading_req_ids
            ):
                continue
            num_scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            limit = min(num_scheduled, num_left) - 1
            if limit > 0:
                limits[req_id] = limit
        return limits

    def report(self, output: "KVConnectorOutput") -> None:
        """Add this step's applied hits and failed loads to the worker's
        KVConnectorOutput, once: a step without apply() reports nothing."""
        output.applied_external_hits = self.applied
        if self.failed_block_ids:
            output.invalid_block_ids = output.invalid_block_ids | self.failed_block_ids
        self.applied = None
        self.failed_block_ids = set()

    def _fail_loads(
        self, scheduler_output: SchedulerOutput, applied: Mapping[str, int]
    ) -> None:
        if not self._hook_error_logged:
            self._hook_error_logged = True
            logger.exception(
                "%s.on_external_hits_applied() failed; the hits applied in this "
                "step are reported as load errors (kv_load_failure_policy "
                "decides). Logged once.",
                type(self.connector).__name__,
            )
        block_size = self.connector._kv_cache_config.kv_cache_groups[
            0
        ].kv_cache_spec.block_size
        cached_reqs = scheduler_output.scheduled_cached_reqs
        num_computed_tokens = dict(
            zip(cached_reqs.req_ids, cached_reqs.num_computed_tokens)
        )
        for new_req in scheduler_output.scheduled_new_reqs:
            num_computed_tokens[new_req.req_id] = new_req.num_computed_tokens
        # The scheduler recomputes a request from its first failed block.
        self.failed_block_ids = {
            self._prompt_block_ids[req_id][num_computed_tokens[req_id] // block_size]
            for req_id in applied
        }

    def _track_requests(self, scheduler_output: SchedulerOutput) -> None:
        finished_req_ids = scheduler_output.finished_req_ids
        self._skip_reading_req_ids.difference_update(finished_req_ids)
        for req_id in finished_req_ids:
            self._prompt_block_ids.pop(req_id, None)
        for new_req in scheduler_output.scheduled_new_reqs:
            # The same rule as Request.skip_reading_prefix_cache, which makes
            # the scheduler skip local and connector prefix-cache hits.
            if get_skip_reading_prefix_cache(
                new_req.sampling_params, new_req.pooling_params
            ):
                self._skip_reading_req_ids.add(new_req.req_id)
            else:
                self._skip_reading_req_ids.discard(new_req.req_id)
            if self.unsupported_reason is None:
                self._prompt_block_ids[new_req.req_id] = list(new_req.block_ids[0])
        if self.unsupported_reason is not None:
            return
        cached_reqs = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids, num_output_tokens in zip(
            cached_reqs.req_ids,
            cached_reqs.new_block_ids,
            cached_reqs.num_output_tokens,
        ):
            if num_output_tokens:
                # Past its prompt: it takes no more hits.
                self._prompt_block_ids.pop(req_id, None)
            elif req_id in cached_reqs.resumed_req_ids:
                self._prompt_block_ids[req_id] = (
                    list(new_block_ids[0]) if new_block_ids else []
                )
            elif new_block_ids:
                self._prompt_block_ids.setdefault(req_id, []).extend(new_block_ids[0])


def uses_worker_external_hits(connector: object) -> bool:
    """Whether a model runner (or a MultiConnector) calls ``connector``'s
    before_update_states(): a KVConnectorBase_V1 whose
    uses_before_update_states is True. Anything else, including a Mock
    standing in for a connector, gets no call."""
    return (
        isinstance(connector, KVConnectorBase_V1)
        and connector.uses_before_update_states is True
    )


def apply_external_hits(
    scheduler_output: SchedulerOutput, hits: Mapping[str, int], source: str
) -> SchedulerOutput:
    """Return a copy of scheduler_output in which the first ``hits[req_id]``
    scheduled tokens of each request are already computed.

    The caller has clamped hits to WorkerExternalHits.limits(). The scheduler
    output and everything it references are left untouched: the scheduler
    still owns them. The copy does not say which hits it carries: the
    caller reports them (KVConnectorOutput.applied_external_hits), so the
    scheduler output that every step sends does not grow.
    """
    validate_external_hits(hits, source)
    applied = {req_id: n for req_id, n in hits.items() if n > 0}
    if not applied:
        return scheduler_output

    scheduled_new_reqs = [
        replace(req, num_computed_tokens=req.num_computed_tokens + applied[req.req_id])
        if req.req_id in applied
        else req
        for req in scheduler_output.scheduled_new_reqs
    ]
    cached_reqs = scheduler_output.scheduled_cached_reqs
    scheduled_cached_reqs = replace(
        cached_reqs,
        num_computed_tokens=[
            num_computed_tokens + applied.get(req_id, 0)
            for req_id, num_computed_tokens in zip(
                cached_reqs.req_ids, cached_reqs.num_computed_tokens
            )
        ],
    )
    num_scheduled_tokens = dict(scheduler_output.num_scheduled_tokens)
    for req_id, num_hit_tokens in applied.items():
        num_scheduled_tokens[req_id] -= num_hit_tokens
    return replace(
        scheduler_output,
        scheduled_new_reqs=scheduled_new_reqs,
        scheduled_cached_reqs=scheduled_cached_reqs,
        num_scheduled_tokens=num_scheduled_tokens,
        total_num_scheduled_tokens=(
            scheduler_output.total_num_scheduled_tokens - sum(applied.values())
        ),
        # The hit tokens' KV must be in place before this step's forward.
        has_sync_kv_loads=True,
    )


def stage_applied_external_hits(
    req_states: "RequestState",
    scheduler_output: SchedulerOutput,
    applied: Mapping[str, int],
) -> None:
    """Write the advanced num_computed_tokens of running requests with a hit
    to Model Runner V2's GPU copy, within the step's one write of it.

    V2's update_requests() refreshes only the CPU mirror, so a hit on a
    running request (a later chunk) must reach the GPU here, or positions
    and slot mappings use the old count. Call before add_requests(): in a
    step that adds requests the write is only staged and add_requests()
    applies it with theirs (one staging buffer per step in flight).
    """
    cached_reqs = scheduler_output.scheduled_cached_reqs
    num_computed = req_states.num_computed_tokens
    staged = False
    for req_id, num_computed_tokens in zip(
        cached_reqs.req_ids, cached_reqs.num_computed_tokens
    ):
        if req_id in applied:
            num_computed.stage_write_elem(
                req_states.req_id_to_index[req_id], num_computed_tokens
            )
            staged = True
    if staged and not scheduler_output.scheduled_new_reqs:
        num_computed.apply_write()


def validate_external_hits(hits: Mapping[str, int], source: str) -> None:
    """Raise ValueError unless ``hits`` maps request ids to non-negative ints."""
    if not isinstance(hits, Mapping):
        raise ValueError(
            f"{source} must be a dict of request id to number of tokens, "
            f"got {type(hits).__name__}."
        )
    for req_id, num_tokens in hits.items():
        # bool is an int subclass but never a token count.
        if (
            not isinstance(req_id, str)
            or not isinstance(num_tokens, int)
            or isinstance(num_tokens, bool)
            or num_tokens < 0
        ):
            raise ValueError(
                f"{source} gave {num_tokens!r} tokens for request {req_id!r}; "
                "expected a str request id and a non-negative int. Return only "
                "requests whose next tokens are loaded, with how many."
            )


def all_reduce_min(values: list[int], groups: Sequence[dist.ProcessGroup]) -> list[int]:
    """Element-wise minimum of values over all ranks of every group in turn,
    which is the minimum over the ranks the groups span together."""
    if not groups:
        return values
    tensor = torch.tensor(values, dtype=torch.int64)
    for group in groups:
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return tensor.tolist()


def record_applied_external_hits(
    requests: Mapping[str, "Request"],
    applied_external_hits: Mapping[str, int],
    failed_kv_load_req_ids: Collection[str],
    connector_prefix_cache_stats: "PrefixCacheStats | None",
) -> None:
    """Count tokens that workers loaded instead of computing as external
    cache hits, so cached_tokens and the prefix cache metrics include them.

    Must run after the step's failed loads are handled and before its
    outputs are built (a request's prefill stats leave with its first
    output). A request whose load failed in this step counts no hit: it is
    recomputed from the failed block, or failed.
    """
    for req_id, num_tokens in applied_external_hits.items():
        request = requests.get(req_id)
        if request is None or req_id in failed_kv_load_req_ids:
            # Aborted while the step ran, or its load failed.
            continue
        preempted = request.num_preemptions > 0
        # Prefill stats describe the first prefill only, as for the
        # scheduler-side hits of get_num_new_matched_tokens().
        prefill_stats = request.prefill_stats
        if prefill_stats is not None and not preempted:
            prefill_stats.num_computed_tokens -= num_tokens
            prefill_stats.num_cached_tokens += num_tokens
            prefill_stats.num_external_cached_tokens += num_tokens
        if connector_prefix_cache_stats is not None:
            if preempted:
                connector_prefix_cache_stats.preempted_hits += num_tokens
            else:
                connector_prefix_cache_stats.hits += num_tokens


def num_tokens_computed_in_step(
    num_scheduled_tokens: dict[str, int],
    applied_external_hits: Mapping[str, int] | None,
) -> dict[str, int]:
    """The tokens the workers computed per request in a step: the scheduled
    ones less the applied hits.

    The scheduler's failed-load path (invalid_block_ids) checks only the
    blocks of tokens computed before the step; the tokens a hit skipped were
    loaded during the step, so they must count as computed before it for a
    failed load of theirs to be found and recomputed.
    """
    if not applied_external_hits:
        return num_scheduled_tokens
    return {
        req_id: n - applied_external_hits.get(req_id, 0)
        for req_id, n in num_scheduled_tokens.items()
    }

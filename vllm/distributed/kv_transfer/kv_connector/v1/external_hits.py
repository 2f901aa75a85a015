# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tokens that a worker-side KV connector loads instead of computing them,
reported by KVConnectorBase_V1.before_update_states().

Workers: apply_before_update_states() asks the connector, makes the ranks
agree and returns a new scheduler output. Scheduler:
record_applied_external_hits() counts the applied hits in the request's
prefill stats and the connector's prefix cache stats.
"""

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from vllm.distributed.parallel_state import get_pcp_group, get_tp_group
from vllm.v1.core.sched.output import SchedulerOutput, validate_external_hits

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.metrics.stats import PrefixCacheStats
    from vllm.v1.request import Request


def apply_before_update_states(
    connector: "KVConnectorBase_V1", scheduler_output: SchedulerOutput
) -> SchedulerOutput:
    """Return scheduler_output with the hits of connector.before_update_states()
    applied, each the minimum over the ranks that share this step's batch.

    Every tensor- and prefill-context-parallel rank must call this for every
    step: a rank without hits still joins the reduction. The reduction is
    skipped only when no request may take a hit, which every rank decides
    alike from the same scheduler output.
    """
    source = f"{type(connector).__name__}.before_update_states()"
    hits = connector.before_update_states(scheduler_output)
    validate_external_hits(hits, source)
    limits = {
        req_id: limit
        for req_id, limit in scheduler_output.external_hit_limits().items()
        if limit > 0
    }
    if not limits:
        return scheduler_output
    groups = [
        g.cpu_group for g in (get_tp_group(), get_pcp_group()) if g.world_size > 1
    ]
    agreed = all_reduce_min(
        [min(hits.get(req_id, 0), limit) for req_id, limit in limits.items()],
        groups,
    )
    return scheduler_output.apply_external_hits(dict(zip(limits, agreed)), source)


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
    connector_prefix_cache_stats: "PrefixCacheStats | None",
) -> None:
    """Count tokens that workers loaded instead of computing as external
    cache hits, so cached_tokens and the prefix cache metrics include them.

    Must run before the step's outputs are built: a request's prefill stats
    leave with its first output.
    """
    for req_id, num_tokens in applied_external_hits.items():
        request = requests.get(req_id)
        if request is None:
            # Aborted while the step ran.
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

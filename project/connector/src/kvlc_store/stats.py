"""Counters through vLLM's connector stats mechanism.

The scheduler-side and the worker-side connector each count what they did
since their last report (``StoreConnectorStats``, plain integer deltas);
vLLM sums them (``aggregate``), logs the sums (``reduce``) and hands them to
``StorePromMetrics.observe`` in the API server, which adds them to Prometheus
counters on ``/metrics``. ``vllm:kvlc_store_leases_open`` is a gauge: leases
taken minus leases released, whichever process did either; a lease that
expires unreleased (a dead server) stays counted, which is what a leak looks
like.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

COUNTERS: dict[str, str] = {
    "lookups": "Prompt lookups in the KV store.",
    "lookup_hit_tokens": "Tokens offered by lookups (scheduler side).",
    "loaded_tokens": "Tokens whose KV was loaded from the store.",
    "worker_hit_tokens": "Tokens found by workers after scheduling "
    "(before_update_states).",
    "loaded_bytes": "Chunk bytes read from the store for loads.",
    "stored_bytes": "Chunk bytes written to the store.",
    "stored_chunks": "Chunks written to the store.",
    "evictions": "Chunks evicted to stay under the store's cap.",
    "corrupt_chunks": "Chunks found corrupt, truncated or foreign (a miss).",
    "load_errors": "Blocks promised to the scheduler that could not be loaded.",
    "gone_chunks": "Chunks a load found removed from the store by hand "
    "(forgotten: the next lookup misses them).",
    "store_errors": "Store operations that failed (unreachable, full, I/O error).",
    "leases_taken": "Leases taken on offered chunks.",
    "leases_released": "Leases released (loaded or aborted).",
    "prefetched_bytes": "Chunk bytes copied into the prefetch buffer for "
    "waiting requests.",
    "prefetch_loaded_bytes": "Chunk bytes loaded from the prefetch buffer "
    "instead of the store.",
    "host_tier_loaded_bytes": "Chunk bytes loaded from the host tier (pinned "
    "host memory) instead of the store.",
    # In tokens, from TP rank 0 only, so a benchmark can tell a hot hit from a
    # cold one without knowing the KV layout's bytes per block.
    "host_tier_loaded_tokens": "Tokens whose KV workers loaded from the host tier.",
    "store_loaded_tokens": "Tokens whose KV workers read from the store (or "
    "the prefetch buffer), not the host tier.",
}

# Worker-side counts come from the step and from the asynchronous-load thread
# (async_load.py). One lock for every instance: a lock attribute would not
# pickle, and vLLM sends the stats between processes.
_LOCK = threading.Lock()


@dataclass
class StoreConnectorStats(KVConnectorStats):
    """Counter deltas since the last report, name -> int."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {}

    def inc(self, name: str, value: int = 1) -> None:
        if name not in COUNTERS:
            raise KeyError(f"unknown store counter {name!r}")
        if value:
            with _LOCK:
                self.data[name] = self.data.get(name, 0) + value

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + int(value)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: int(value) for name, value in sorted(self.data.items())}

    def take(self) -> StoreConnectorStats | None:
        """The counts so far (None if nothing happened), and start again."""
        with _LOCK:
            if self.is_empty():
                return None
            out = StoreConnectorStats(data=dict(self.data))
            self.reset()
        return out


class StorePromMetrics(KVConnectorPromMetrics):
    """``vllm:kvlc_store_<name>_total`` counters and the leases-open gauge."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, doc in COUNTERS.items():
            counter_cls: Any = self._counter_cls
            metric = counter_cls(
                name=f"vllm:kvlc_store_{name}", documentation=doc, labelnames=labelnames
            )
            self._counters[name] = {
                idx: metric.labels(*values)
                for idx, values in per_engine_labelvalues.items()
            }
        gauge_cls: Any = self._gauge_cls
        gauge = gauge_cls(
            name="vllm:kvlc_store_leases_open",
            documentation="Leases taken and not yet released.",
            multiprocess_mode="livesum",
            labelnames=labelnames,
        )
        self._leases_open: dict[int, Any] = {
            idx: gauge.labels(*values) for idx, values in per_engine_labelvalues.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._counters.get(name)
            if per_engine is not None and value:
                per_engine[engine_idx].inc(value)
        opened = int(transfer_stats_data.get("leases_taken", 0))
        closed = int(transfer_stats_data.get("leases_released", 0))
        if opened - closed:
            self._leases_open[engine_idx].inc(opened - closed)

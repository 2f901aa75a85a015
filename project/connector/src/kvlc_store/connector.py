"""StoreConnector: a content-addressed KV store for vLLM, as a plain package.

Load it with (the package's plugin entry point registers the name; adding
``"kv_connector_module_path": "kvlc_store"`` works too)::

    --kv-transfer-config '{"kv_connector": "StoreConnector",
      "kv_role": "kv_both", "kv_connector_extra_config": {"path": "<store dir>"}}'

One chunk per KV-cache block (``block_size`` tokens, all layers of one TP
rank), keyed by vLLM's block hash of that block (``request.block_hashes``:
the hash of the block's tokens chained with every block before it), so any
server with the same model and KV layout finds the prefixes any other one
stored.

Scheduler side (``scheduler_side.py``): a lookup leases the longest run of
stored chunks after the locally computed prefix, checks their headers and
offers it, up to ``prompt length - 1`` tokens (the prompt's last full block
is loaded whole); the accepted part becomes a load plan in the step's
metadata, the rest of the lease is released at once. With the
explicit external-match lifecycle (``prepare_external_match`` /
``commit_external_match`` / ``abort_external_match``, when the installed vLLM
has it) the scheduler tells the connector exactly which offers it took;
otherwise the legacy pair is used and an offer the scheduler never took is
released at the next lookup of the request or when it finishes. Every lease
also expires after ``lease_ttl_s``.

Worker side (``worker_side.py``, over ``transfer.py``'s view of the KV
cache; on a GPU batched through pinned memory, ``device_transfer.py``):
``start_load_kv`` reads the planned chunks straight into their blocks
(``load_path.py``), checks each once (header and payload digest) and
releases their lease (with ``load_async``, on a thread beside the steps,
reported through ``get_finished``: ``async_load.py``); ``wait_for_save``
writes the step's newly filled prompt blocks that the store lacks, straight
from the KV cache (on a GPU on a thread, a finished request's blocks kept
until its saves are written: ``async_save.py``); ``before_update_states``
looks up blocks of new prompts that were not found when the step was
scheduled (another server may have stored them since), loads them and
reports them as hits. A chunk that fails its checks is deleted, counted
and logged once; at load time its block is reported through
``get_block_ids_with_load_errors``, and vLLM recomputes it under
``kv_load_failure_policy: recompute``.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvlc_store.config import check_vllm_config, parse_config
from kvlc_store.core import StoreCore, logger, make_backend, store_identity
from kvlc_store.metadata import Offer, StoreMetadata
from kvlc_store.offload import LazyOffload, SavedBlocks
from kvlc_store.prefetch import Prefetcher
from kvlc_store.scheduler_side import SchedulerSide
from kvlc_store.stats import StoreConnectorStats, StorePromMetrics
from kvlc_store.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorWorkerMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["StoreConnector", "store_identity"]

# The stack's external-match-lifecycle entry, when installed.
try:
    ExternalKVMatch: Any = importlib.import_module(
        "vllm.distributed.kv_transfer.kv_connector.v1.external_match"
    ).ExternalKVMatch
except ImportError:
    ExternalKVMatch = None

HAS_LIFECYCLE = hasattr(KVConnectorBase_V1, "prepare_external_match")
HAS_WORKER_HITS = hasattr(KVConnectorBase_V1, "before_update_states")
HAS_SCHEDULER_CONTEXT = hasattr(KVConnectorBase_V1, "bind_scheduler_context")


@dataclass
class StoreLayoutHandshake(KVConnectorHandshakeMetadata):
    """A worker's KV layout (``BlockLayout.digest``), sent to the scheduler
    side once the KV cache is registered, before any request."""

    kv_layout: str


def workers_kv_layout(
    metadata: dict[int, KVConnectorHandshakeMetadata], tp_size: int
) -> str | None:
    """The KV layout all ``tp_size`` workers reported in ``metadata`` (vLLM's
    handshake metadata by TP rank, given to the scheduler side at startup),
    or None, warned: then chunks are keyed without it, and a worker refuses
    a chunk of another layout at load instead, as a damaged one.

    Inside MultiConnector the workers send none (``get_handshake_metadata``):
    MultiConnector passes on only its first child's, which NixlConnector
    needs."""
    reports = [m for m in metadata.values() if isinstance(m, StoreLayoutHandshake)]
    layouts = sorted({m.kv_layout for m in reports})
    if len(layouts) == 1 and len(reports) == tp_size:
        return layouts[0]
    logger.warning(
        "StoreConnector: %s; chunks are keyed without it, and a chunk written "
        "by a server with another attention backend or kernel block size "
        "fails its load once (kv_load_failure_policy) and is replaced, "
        "instead of being a miss",
        f"the workers report {len(layouts)} KV layouts ({', '.join(layouts)})"
        if len(layouts) > 1
        else f"the workers' KV layout did not reach the scheduler ({len(reports)} "
        f"of {tp_size} ranks sent it; inside MultiConnector, which passes on "
        "only one child's handshake metadata, they send none)",
    )
    return None


class StoreConnector(KVConnectorBase_V1):
    """A KV connector backed by a shared, content-addressed chunk store."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        config = parse_config(extra)
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError(
                "StoreConnector does not support pipeline parallelism; "
                "set --pipeline-parallel-size 1"
            )
        if not config.scheduler_lookup and not HAS_WORKER_HITS:
            raise ValueError(
                "StoreConnector: kv_connector_extra_config['scheduler_lookup'] = "
                "False needs a vLLM with KVConnectorBase_V1.before_update_states "
                "(the kvlc patch stack); set it to true"
            )
        if config.offload == "lazy" and not HAS_SCHEDULER_CONTEXT:
            raise ValueError(
                "StoreConnector: kv_connector_extra_config['offload'] = 'lazy' "
                "needs a vLLM with KVConnectorBase_V1.bind_scheduler_context "
                "(the kvlc patch stack); set it to 'eager'"
            )
        check_vllm_config(config, bool(vllm_config.cache_config.enable_prefix_caching))
        self._config = config
        self._block_size = vllm_config.cache_config.block_size
        identity = store_identity(vllm_config, kv_cache_config, config.model_id)
        backend = make_backend(config)
        self._core = StoreCore(
            config,
            backend,
            identity,
            vllm_config.parallel_config.tensor_parallel_size,
            load_failure_policy=self._kv_transfer_config.kv_load_failure_policy,
            tells_read_outages=role == KVConnectorRole.SCHEDULER
            or not config.scheduler_lookup,
        )
        self._scheduler = SchedulerSide(
            self._core,
            self._block_size,
            HAS_WORKER_HITS,
            lambda: self._kv_cache_manager,
        )
        if role == KVConnectorRole.SCHEDULER and config.prefetch_buffer_bytes:
            self._scheduler.prefetcher = Prefetcher(
                make_backend(config), config.prefetch_buffer_bytes, self._core.stats
            )
        # On an accelerator the workers save off the forward's path, and a
        # finished request's blocks wait for its saves (request_finished).
        self._scheduler.async_saves = vllm_config.device_config.device_type != "cpu"
        self._worker = WorkerSide(self._core, self._block_size)
        logger.info(
            "StoreConnector (%s) on %s backend, identity %s; stack hooks: "
            "lifecycle=%s before_update_states=%s scheduler_context=%s",
            role.name,
            config.backend,
            identity,
            HAS_LIFECYCLE,
            HAS_WORKER_HITS,
            HAS_SCHEDULER_CONTEXT,
        )
        if role == KVConnectorRole.SCHEDULER and backend.read_only:
            owner = getattr(backend, "owner_uid", None)
            logger.warning(
                "StoreConnector: store %s is read-only: serving hits from it, "
                "saving nothing%s",
                config.path,
                ""
                if owner in (None, os.geteuid())
                else f"; trusting its owner (uid {owner}) for what it holds",
            )
        if (
            role == KVConnectorRole.SCHEDULER
            and self._kv_transfer_config.kv_load_failure_policy != "recompute"
        ):
            logger.info(
                "StoreConnector: a chunk that fails its checksum at load fails "
                "its request under kv_load_failure_policy=%r; set "
                '"kv_load_failure_policy": "recompute" in '
                "--kv-transfer-config to recompute its blocks instead",
                self._kv_transfer_config.kv_load_failure_policy,
            )

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._core.stats.take()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return StoreConnectorStats(data=dict(data or {}))

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """``LBHNC``, the layout OffloadingConnector asks for and vLLM's CPU
        attention's only one: a chunk is a block of each layer in the layout
        the connector sees, so every server sharing a store must have the
        same one, and in it a block of a layer is one or two contiguous runs
        that move by pointer copies through the host tier. Under the layout
        vLLM picks by itself on an H200 (FlashAttention 3, Model Runner V2)
        a block had more runs than that, and moved through staging with no
        host tier."""
        return "LBHNC"

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return StorePromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    def shutdown(self) -> None:
        if self._scheduler.prefetcher is not None:
            self._scheduler.prefetcher.close()
        self._worker.close()
        self._core.backend.close()

    # ------------------------------------------------------------------
    # Scheduler side
    # ------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        self._scheduler.arrived(request)

    # Legacy pair (vLLM without the explicit lifecycle).

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        num_tokens = self._scheduler.offer_legacy(request, num_computed_tokens)
        return num_tokens, self._config.load_async and num_tokens > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler.commit_legacy(
            request, blocks.get_block_ids()[0], num_external_tokens
        )

    # Explicit lifecycle (the external-match-lifecycle entry), used by the
    # scheduler when present.

    def prepare_external_match(self, request: Request, num_computed_tokens: int) -> Any:
        assert ExternalKVMatch is not None
        offer = self._scheduler.offer(request, num_computed_tokens)
        if offer is None:
            return ExternalKVMatch(num_tokens=0)
        return ExternalKVMatch(
            num_tokens=offer.num_tokens,
            load_kv_async=self._config.load_async,
            query_result=offer,
        )

    def commit_external_match(
        self, request: Request, blocks: KVCacheBlocks, match: Any
    ) -> None:
        offer = match.query_result
        if isinstance(offer, Offer):
            self._scheduler.commit(
                request, blocks.get_block_ids()[0], offer, match.num_tokens
            )

    def abort_external_match(self, request: Request, match: Any) -> None:
        offer = match.query_result
        if isinstance(offer, Offer):
            self._scheduler.abort(offer)

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> KVConnectorMetadata:
        return self._scheduler.build_meta(scheduler_output)

    def bind_scheduler_context(self, scheduler_context: Any) -> None:
        """The scheduler-context entry: the scheduler's typed view of its KV cache."""
        self._scheduler.context = scheduler_context
        if self._config.offload == "lazy" and not self._core.backend.read_only:
            scheduler = self._vllm_config.scheduler_config
            window = self._config.offload_window_blocks or 2 * -(
                -scheduler.max_num_batched_tokens // self._block_size
            )
            self._scheduler.lazy = LazyOffload(
                scheduler_context,
                window,
                known_stored=4 * self._kv_cache_config.num_blocks,
            )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if connector_output.invalid_block_ids:
            self._scheduler.on_load_errors(set(connector_output.invalid_block_ids))
        saved = connector_output.kv_connector_worker_meta
        lazy = self._scheduler.lazy
        if lazy is not None and isinstance(saved, SavedBlocks):
            lazy.on_saved(saved)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.finished(request), None

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        layout = workers_kv_layout(metadata, self._core.tp_size)
        if layout is not None:
            self._core.set_kv_layout(layout)
            logger.info(
                "StoreConnector: the workers' KV layout is %s; chunks are "
                "keyed under %s",
                layout,
                self._core.key_prefix,
            )

    # ------------------------------------------------------------------
    # Worker side
    # ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self._worker.register(
            kv_caches,
            self._kv_cache_config.num_blocks,
            get_tensor_model_parallel_rank(),
        )

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """The KV layout, when this connector is the server's only one.
        Inside MultiConnector, which passes on its first child's metadata
        alone, it sends none: listed before NixlConnector, it would take the
        place of NIXL's."""
        from vllm.distributed.kv_transfer import (
            get_kv_transfer_group,
            has_kv_transfer_group,
        )

        if has_kv_transfer_group() and get_kv_transfer_group() is not self:
            return None
        return StoreLayoutHandshake(self._worker.layout.digest)

    def before_update_states(self, scheduler_output: SchedulerOutput) -> dict[str, int]:
        meta = scheduler_output.kv_connector_metadata
        if not isinstance(meta, StoreMetadata) or not meta.probes:
            return {}
        return self._worker.before_update_states(meta)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, StoreMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StoreMetadata)
        self._worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StoreMetadata)
        self._worker.save(meta)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.take_saved()

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        return (
            self._worker.finished_saves(finished_req_ids),
            self._worker.finished_loads(finished_req_ids),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

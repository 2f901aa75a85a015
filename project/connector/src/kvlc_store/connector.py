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

Scheduler side: a lookup leases the longest run of stored chunks after the
locally computed prefix and offers it; the accepted part becomes a load plan
in the step's metadata, the rest of the lease is released at once. With the
explicit external-match lifecycle (``prepare_external_match`` /
``commit_external_match`` / ``abort_external_match``, when the installed vLLM
has it) the scheduler tells the connector exactly which offers it took;
otherwise the legacy pair is used and an offer the scheduler never took is
released at the next lookup of the request or when it finishes. Every lease
also expires after ``lease_ttl_s``.

Worker side: ``start_load_kv`` reads, checks and copies the planned chunks
into the KV cache and releases their lease; ``wait_for_save`` writes the
step's newly filled prompt blocks that the store lacks;
``before_update_states`` looks up blocks of new prompts that were not found
when the step was scheduled (another server may have stored them since) and
reports them as hits. A chunk that fails its checks is deleted, counted and
logged once; at load time its block is reported through
``get_block_ids_with_load_errors``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from kvlc_store.backends import (
    Backend,
    BackendUnavailable,
    DirectoryBackend,
    RedisBackend,
    new_lease_id,
)
from kvlc_store.chunk import ChunkError, decode_chunk, encode_chunk
from kvlc_store.config import StoreConfig, parse_config
from kvlc_store.offload import LazyOffload, SavedBlocks
from kvlc_store.stats import StoreConnectorStats, StorePromMetrics

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

# Under vLLM's logger, so INFO lines get vLLM's handler and format; a logger
# outside it has no handler and Python prints only its warnings.
logger = init_logger(f"vllm.{__name__}")

# Stack entry 2 (the explicit external-match lifecycle), when installed.
try:
    ExternalKVMatch: Any = importlib.import_module(
        "vllm.distributed.kv_transfer.kv_connector.v1.external_match"
    ).ExternalKVMatch
except ImportError:
    ExternalKVMatch = None

HAS_LIFECYCLE = hasattr(KVConnectorBase_V1, "prepare_external_match")
HAS_WORKER_HITS = hasattr(KVConnectorBase_V1, "before_update_states")
HAS_SCHEDULER_CONTEXT = hasattr(KVConnectorBase_V1, "bind_scheduler_context")


def store_identity(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str:
    """A digest of everything that makes stored KV usable by this server:
    the model, its KV cache layout (per group: layers, spec), the TP size, the
    block size and the block hash algorithm. Same on the scheduler and every
    worker of a server, and on every server with the same setup."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    groups = [
        {"layers": list(g.layer_names), "spec": repr(g.kv_cache_spec)}
        for g in kv_cache_config.kv_cache_groups
    ]
    described = {
        "format": 1,
        "model": model.model,
        "revision": model.revision,
        "dtype": str(model.dtype),
        "block_size": cache.block_size,
        "hash_algo": cache.prefix_caching_hash_algo,
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "groups": groups,
    }
    blob = json.dumps(described, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def make_backend(config: StoreConfig) -> Backend:
    if config.backend == "redis":
        assert config.redis_url is not None
        return RedisBackend(
            config.redis_url,
            config.namespace,
            config.capacity_bytes,
            timeout_s=config.redis_timeout_s,
        )
    assert config.path is not None
    return DirectoryBackend(config.path, config.capacity_bytes)


@dataclass
class Offer:
    """A lookup's answer: leased chunks for blocks ``start_block`` on."""

    lease_id: str
    start_block: int
    keys: list[list[str]]  # per block, one key per TP rank

    @property
    def num_blocks(self) -> int:
        return len(self.keys)


@dataclass
class LoadSpec:
    """Blocks to fill from the store before the forward, then release."""

    req_id: str
    lease_id: str | None
    block_ids: list[int]
    keys: list[list[str]]


@dataclass
class WorkerLoad:
    """Blocks a worker found itself (``before_update_states``), with the
    chunks it read and checked then: only whole chunks become hits."""

    lease_id: str
    block_ids: list[int]
    keys: list[str]
    payloads: list[memoryview]


@dataclass
class ProbeSpec:
    """Blocks of a new prompt the scheduler did not find: the worker looks
    them up again in before_update_states."""

    req_id: str
    block_ids: list[int]
    keys: list[list[str]]


@dataclass
class SaveSpec:
    block_id: int
    keys: list[str]
    # Lazy offload: the scheduler pinned the block until the workers report
    # the save done.
    pinned: bool = False


@dataclass
class StoreMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    probes: list[ProbeSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


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
        self._config = parse_config(extra)
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError(
                "StoreConnector does not support pipeline parallelism; "
                "set --pipeline-parallel-size 1"
            )
        if not self._config.scheduler_lookup and not HAS_WORKER_HITS:
            raise ValueError(
                "StoreConnector: kv_connector_extra_config['scheduler_lookup'] = "
                "False needs a vLLM with KVConnectorBase_V1.before_update_states "
                "(the kvlc patch stack); set it to true"
            )
        if self._config.offload == "lazy":
            if not HAS_SCHEDULER_CONTEXT:
                raise ValueError(
                    "StoreConnector: kv_connector_extra_config['offload'] = 'lazy' "
                    "needs a vLLM with KVConnectorBase_V1.bind_scheduler_context "
                    "(the kvlc patch stack); set it to 'eager'"
                )
            if not vllm_config.cache_config.enable_prefix_caching:
                raise ValueError(
                    "StoreConnector: kv_connector_extra_config['offload'] = 'lazy' "
                    "stores blocks the prefix cache is about to evict, and prefix "
                    "caching is off; drop --no-enable-prefix-caching or set it "
                    "to 'eager'"
                )
        self._block_size = vllm_config.cache_config.block_size
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._identity = store_identity(vllm_config, kv_cache_config)
        self._backend = make_backend(self._config)
        self._stats = StoreConnectorStats()
        self._warned: set[str] = set()
        # "read" (lookups, loads, leases) and "write" (saves) fail apart: a
        # full disk stops saves while reads still hit.
        self._store_down: set[str] = set()

        # Scheduler side.
        self._lazy: LazyOffload | None = None
        self._requests: dict[str, Request] = {}
        self._pending: dict[str, Offer] = {}  # legacy path: offered, not taken
        self._loads: list[LoadSpec] = []
        self._loaded_until: dict[str, int] = {}  # blocks known to be stored
        self._saved_until: dict[str, int] = {}

        # Worker side.
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layers: list[tuple[torch.Tensor, int, int]] = []  # tensor, dim, per
        self._rank = 0
        self._load_errors: set[int] = set()
        self._worker_loads: list[WorkerLoad] = []
        self._saved = SavedBlocks()
        logger.info(
            "StoreConnector (%s) on %s backend, identity %s; stack hooks: "
            "lifecycle=%s before_update_states=%s scheduler_context=%s",
            role.name,
            self._config.backend,
            self._identity,
            HAS_LIFECYCLE,
            HAS_WORKER_HITS,
            HAS_SCHEDULER_CONTEXT,
        )

    # ------------------------------------------------------------------
    # Shared helpers
    # ------------------------------------------------------------------

    def _keys(self, block_hash: bytes) -> list[str]:
        h = bytes(block_hash).hex()
        return [f"{self._identity}/{h}.{r}" for r in range(self._tp_size)]

    def _warn_once(self, what: str, message: str, *args: object) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(message, *args)

    def _unavailable(self, e: BackendUnavailable, what: str = "read") -> None:
        """Count a failed store operation; warn once until it works again."""
        self._stats.inc("store_errors")
        if what not in self._store_down:
            self._store_down.add(what)
            consequence = "skipping saves" if what == "write" else "running on misses"
            logger.warning(
                "StoreConnector: store %s failed, %s until it works again: %s",
                what,
                consequence,
                e,
            )

    def _available(self, what: str = "read") -> None:
        if what in self._store_down:
            self._store_down.discard(what)
            logger.info("StoreConnector: store %s works again", what)

    def _bad_chunk(self, key: str, error: ChunkError) -> None:
        self._stats.inc("corrupt_chunks")
        self._warn_once(
            key, "StoreConnector: chunk %s unusable (%s); treated as a miss", key, error
        )
        with contextlib.suppress(BackendUnavailable):
            self._backend.delete(key)

    def _release(self, lease_id: str, keys: Iterable[str], count: bool) -> None:
        keys = list(keys)
        try:
            self._backend.release(keys, lease_id)
        except BackendUnavailable as e:
            self._unavailable(e)  # The lease expires on its own.
        if count:
            self._stats.inc("leases_released")

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._stats.take()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return StoreConnectorStats(data=dict(data or {}))

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
        self._backend.close()

    # ------------------------------------------------------------------
    # Scheduler side
    # ------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def _max_blocks(self, request: Request) -> int:
        # The last prompt token is always computed (it yields the first
        # sampled token), so a hit never covers it.
        return min(
            len(request.block_hashes), (request.num_tokens - 1) // self._block_size
        )

    def _offer(self, request: Request, num_computed_tokens: int) -> Offer | None:
        """Lease the stored blocks after ``num_computed_tokens``; None if none."""
        self._requests.setdefault(request.request_id, request)
        if not self._config.scheduler_lookup:
            return None
        self._stats.inc("lookups")
        if num_computed_tokens % self._block_size:
            return None
        start = num_computed_tokens // self._block_size
        end = self._max_blocks(request)
        if start >= end:
            return None
        per_block = [self._keys(h) for h in request.block_hashes[start:end]]
        flat = [k for keys in per_block for k in keys]
        lease_id = new_lease_id()
        try:
            n = self._backend.lease(flat, lease_id, self._config.lease_ttl_s)
            self._available()
        except BackendUnavailable as e:
            self._unavailable(e)
            return None
        num_blocks = n // self._tp_size
        if self._config.verify_on_lookup:
            num_blocks = self._verified_prefix(per_block[:num_blocks])
        leased = flat[:n]
        if num_blocks == 0:
            if leased:
                self._release(lease_id, leased, count=False)
            return None
        kept = num_blocks * self._tp_size
        if kept < n:
            self._release(lease_id, leased[kept:], count=False)
        self._stats.inc("leases_taken")
        self._stats.inc("lookup_hit_tokens", num_blocks * self._block_size)
        return Offer(lease_id, start, per_block[:num_blocks])

    def _verified_prefix(self, per_block: Sequence[Sequence[str]]) -> int:
        """How many leading blocks have every rank's chunk whole and ours.

        Checks every block, past a bad one too: each corrupt chunk found is
        deleted now, so the request's own save (its blocks from the first bad
        one on are computed) writes it again.
        """
        good = len(per_block)
        for i, keys in enumerate(per_block):
            for key in keys:
                try:
                    data = self._backend.get(key)
                except BackendUnavailable as e:
                    self._unavailable(e)
                    return min(good, i)
                if data is None:
                    good = min(good, i)
                    continue
                try:
                    decode_chunk(data, self._identity, key)
                except ChunkError as e:
                    self._bad_chunk(key, e)
                    good = min(good, i)
        return good

    def _commit(
        self, request: Request, block_ids: Sequence[int], offer: Offer, accepted: int
    ) -> None:
        """The scheduler took ``accepted`` tokens of ``offer``: plan their
        load and release the rest of the lease."""
        num_blocks = min(offer.num_blocks, -(-accepted // self._block_size))
        rest = [k for keys in offer.keys[num_blocks:] for k in keys]
        if num_blocks == 0:
            self._release(offer.lease_id, rest, count=True)
            return
        if rest:
            self._release(offer.lease_id, rest, count=False)
        first = offer.start_block
        self._loads.append(
            LoadSpec(
                req_id=request.request_id,
                lease_id=offer.lease_id,
                block_ids=list(block_ids[first : first + num_blocks]),
                keys=offer.keys[:num_blocks],
            )
        )
        self._loaded_until[request.request_id] = first + num_blocks
        if self._lazy is not None:
            for block_hash in request.block_hashes[first : first + num_blocks]:
                self._lazy.mark_stored(bytes(block_hash))
        self._stats.inc("loaded_tokens", min(accepted, num_blocks * self._block_size))

    def _abort(self, offer: Offer) -> None:
        self._release(offer.lease_id, (k for ks in offer.keys for k in ks), count=True)

    # Legacy pair (vLLM without the explicit lifecycle).

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        stale = self._pending.pop(request.request_id, None)
        if stale is not None:
            # Offered at an earlier lookup and never taken.
            self._abort(stale)
        offer = self._offer(request, num_computed_tokens)
        if offer is None:
            return 0, False
        self._pending[request.request_id] = offer
        return offer.num_blocks * self._block_size, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        offer = self._pending.pop(request.request_id, None)
        if offer is not None:
            self._commit(request, blocks.get_block_ids()[0], offer, num_external_tokens)

    # Explicit lifecycle (stack entry 2), used by the scheduler when present.

    def prepare_external_match(self, request: Request, num_computed_tokens: int) -> Any:
        assert ExternalKVMatch is not None
        offer = self._offer(request, num_computed_tokens)
        if offer is None:
            return ExternalKVMatch(num_tokens=0)
        return ExternalKVMatch(
            num_tokens=offer.num_blocks * self._block_size, query_result=offer
        )

    def commit_external_match(
        self, request: Request, blocks: KVCacheBlocks, match: Any
    ) -> None:
        offer = match.query_result
        if isinstance(offer, Offer):
            self._commit(request, blocks.get_block_ids()[0], offer, match.num_tokens)

    def abort_external_match(self, request: Request, match: Any) -> None:
        offer = match.query_result
        if isinstance(offer, Offer):
            self._abort(offer)

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> KVConnectorMetadata:
        meta = StoreMetadata(loads=self._loads)
        self._loads = []
        loading = {spec.req_id for spec in meta.loads}
        bs = self._block_size
        steps: list[tuple[str, int, int, bool]] = [
            (r.req_id, r.num_computed_tokens, len(r.block_ids[0]), True)
            for r in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        steps += [
            (req_id, cached.num_computed_tokens[i], -1, False)
            for i, req_id in enumerate(cached.req_ids)
        ]
        for req_id, num_computed, _, is_new in steps:
            request = self._requests.get(req_id)
            if request is None:
                continue
            scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            prompt_blocks = min(
                len(request.block_hashes), request.num_prompt_tokens // bs
            )
            done = min(num_computed + scheduled, request.num_prompt_tokens) // bs
            done = min(done, prompt_blocks)
            saved = self._saved_until.get(req_id, 0)
            loaded = self._loaded_until.get(req_id, 0)
            block_ids: list[int] | None = None
            if done > saved and self._lazy is None:
                block_ids = self._block_ids(req_id)
                for i in range(max(saved, 0), min(done, len(block_ids))):
                    if i < loaded:
                        continue  # Read from the store: already there.
                    meta.saves.append(
                        SaveSpec(block_ids[i], self._keys(request.block_hashes[i]))
                    )
                self._saved_until[req_id] = done
            # Worker-side lookup: blocks of a new prompt not found (or not
            # looked up) when this step was scheduled.
            if (
                is_new
                and HAS_WORKER_HITS
                and req_id not in loading
                and num_computed % bs == 0
            ):
                start = num_computed // bs
                end = min(
                    self._max_blocks(request), (num_computed + scheduled - 1) // bs
                )
                if end > start:
                    if block_ids is None:
                        block_ids = self._block_ids(req_id)
                    meta.probes.append(
                        ProbeSpec(
                            req_id,
                            block_ids[start:end],
                            [self._keys(h) for h in request.block_hashes[start:end]],
                        )
                    )
        if self._lazy is not None:
            self._lazy.plan(
                lambda block_id, block_hash: meta.saves.append(
                    SaveSpec(block_id, self._keys(block_hash), pinned=True)
                )
            )
        return meta

    def bind_scheduler_context(self, scheduler_context: Any) -> None:
        """Stack entry 3: the scheduler's typed view of its KV cache."""
        if self._config.offload == "lazy":
            scheduler = self._vllm_config.scheduler_config
            window = self._config.offload_window_blocks or 2 * -(
                -scheduler.max_num_batched_tokens // self._block_size
            )
            self._lazy = LazyOffload(
                scheduler_context,
                window,
                known_stored=4 * self._kv_cache_config.num_blocks,
            )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        saved = connector_output.kv_connector_worker_meta
        if self._lazy is not None and isinstance(saved, SavedBlocks):
            self._lazy.on_saved(saved)

    def _block_ids(self, req_id: str) -> list[int]:
        manager = self._kv_cache_manager
        if manager is None:
            return []
        return list(manager.get_block_ids(req_id)[0])

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        stale = self._pending.pop(req_id, None)
        if stale is not None:
            self._abort(stale)
        self._requests.pop(req_id, None)
        self._loaded_until.pop(req_id, None)
        self._saved_until.pop(req_id, None)
        return False, None

    # ------------------------------------------------------------------
    # Worker side
    # ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self._rank = get_tensor_model_parallel_rank()
        num_blocks = self._kv_cache_config.num_blocks
        self._kv_caches = kv_caches
        self._layers = []
        for name in sorted(kv_caches):
            kv = kv_caches[name]
            if kv.dim() >= 2 and kv.shape[0] == 2 and kv.shape[1] % num_blocks == 0:
                dim = 1
            elif kv.shape[0] % num_blocks == 0:
                dim = 0
            else:
                raise ValueError(
                    f"StoreConnector: cannot find the block dimension of layer "
                    f"{name!r} (shape {tuple(kv.shape)}, {num_blocks} blocks)"
                )
            self._layers.append((kv, dim, kv.shape[dim] // num_blocks))

    def _block_views(self, block_id: int) -> list[torch.Tensor]:
        return [kv.narrow(dim, block_id * per, per) for kv, dim, per in self._layers]

    def _extract(self, block_id: int) -> bytes:
        parts = [
            v.contiguous().view(torch.uint8).reshape(-1)
            for v in self._block_views(block_id)
        ]
        return torch.cat(parts).cpu().numpy().tobytes()

    def _inject(self, block_id: int, payload: memoryview) -> bool:
        views = self._block_views(block_id)
        sizes = [v.numel() * v.element_size() for v in views]
        if sum(sizes) != len(payload):
            return False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer
            flat = torch.frombuffer(payload, dtype=torch.uint8)
        offset = 0
        for view, size in zip(views, sizes, strict=False):
            src = flat[offset : offset + size].view(view.dtype).view(view.shape)
            view.copy_(src, non_blocking=True)
            offset += size
        return True

    def _load_block(self, block_id: int, key: str) -> bool:
        try:
            data = self._backend.get(key)
        except BackendUnavailable as e:
            self._unavailable(e)
            return False
        if data is None:
            return False
        try:
            payload = decode_chunk(data, self._identity, key)
        except ChunkError as e:
            self._bad_chunk(key, e)
            return False
        if not self._inject(block_id, payload):
            self._bad_chunk(key, ChunkError("payload size does not fit this layout"))
            return False
        self._stats.inc("loaded_bytes", len(data))
        return True

    def before_update_states(self, scheduler_output: SchedulerOutput) -> dict[str, int]:
        meta = scheduler_output.kv_connector_metadata
        if not isinstance(meta, StoreMetadata) or not meta.probes:
            return {}
        hits: dict[str, int] = {}
        for probe in meta.probes:
            keys = [keys[self._rank] for keys in probe.keys]
            lease_id = new_lease_id()
            try:
                n = self._backend.lease(keys, lease_id, self._config.lease_ttl_s)
            except BackendUnavailable as e:
                self._unavailable(e)
                continue
            # A hit reported here cannot be taken back (a failed load fails
            # the request under vLLM's default kv_load_failure_policy), so
            # the chunks are read and checked now; the hit ends at the first
            # one that is missing or damaged.
            payloads = self._read_chunks(keys[:n])
            if len(payloads) < n:
                self._release(lease_id, keys[len(payloads) : n], count=False)
            if not payloads:
                continue
            n = len(payloads)
            self._worker_loads.append(
                WorkerLoad(lease_id, probe.block_ids[:n], keys[:n], payloads)
            )
            hits[probe.req_id] = n * self._block_size
        return hits

    def _read_chunks(self, keys: Sequence[str]) -> list[memoryview]:
        """The payloads of the leading ``keys`` that are stored and whole.

        Like ``_verified_prefix``, reads on past a damaged chunk: each one
        found is deleted now, so this request's save writes it again.
        """
        payloads: list[memoryview] = []
        damaged = False
        for key in keys:
            try:
                data = self._backend.get(key)
            except BackendUnavailable as e:
                self._unavailable(e)
                break
            if data is None:
                break
            try:
                payload = decode_chunk(data, self._identity, key)
            except ChunkError as e:
                self._bad_chunk(key, e)
                damaged = True
                continue
            if not damaged:
                payloads.append(payload)
                self._stats.inc("loaded_bytes", len(data))
        return payloads

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StoreMetadata)
        for spec in meta.loads:
            keys = [keys[self._rank] for keys in spec.keys]
            for block_id, key in zip(spec.block_ids, keys, strict=False):
                if not self._load_block(block_id, key):
                    self._load_errors.add(block_id)
                    self._stats.inc("load_errors")
            if spec.lease_id is not None:
                self._release(spec.lease_id, keys, count=self._rank == 0)
        worker_loads, self._worker_loads = self._worker_loads, []
        for load in worker_loads:
            loaded = 0
            for block_id, key, payload in zip(
                load.block_ids, load.keys, load.payloads, strict=True
            ):
                if self._inject(block_id, payload):
                    loaded += 1
                else:
                    self._bad_chunk(
                        key, ChunkError("payload size does not fit this layout")
                    )
                    self._load_errors.add(block_id)
                    self._stats.inc("load_errors")
            if self._rank == 0:
                self._stats.inc("worker_hit_tokens", loaded * self._block_size)
            self._release(load.lease_id, load.keys, count=False)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StoreMetadata)
        store_down = False
        for save in meta.saves:
            # After the store failed once, the step's other saves are skipped.
            store_down = store_down or not self._save_block(save)
            if save.pinned:
                self._saved.done.add(save.block_id)
                if store_down:
                    self._saved.failed.add(save.block_id)

    def _save_block(self, save: SaveSpec) -> bool:
        """Write one block; False if the store failed (unreachable, full,
        an I/O error): the save is skipped, the server goes on."""
        key = save.keys[self._rank]
        data = encode_chunk(self._identity, key, self._extract(save.block_id))
        try:
            evicted = self._backend.put(key, data)
            self._available("write")
        except BackendUnavailable as e:
            self._unavailable(e, "write")
            return False
        self._stats.inc("stored_bytes", len(data))
        self._stats.inc("stored_chunks")
        self._stats.inc("evictions", evicted)
        return True

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._saved.done:
            return None
        saved, self._saved = self._saved, SavedBlocks()
        return saved

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

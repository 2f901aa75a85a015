"""What the scheduler side and the worker side of the connector share: the
store, its identity and key scheme, counters, and how failures are told."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.logger import init_logger

from kvlc_store.backends import (
    Backend,
    BackendUnavailable,
    DirectoryBackend,
    RedisBackend,
)
from kvlc_store.chunk import FORMAT_VERSION, ChunkError
from kvlc_store.config import StoreConfig, redis_password
from kvlc_store.identity import config_content, model_identity
from kvlc_store.stats import StoreConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# Under vLLM's logger, so INFO lines get vLLM's handler and format; a logger
# outside it has no handler and Python prints only its warnings.
logger = init_logger(f"vllm.{__name__}")

# Bumped whenever what store_identity describes changes, so chunks keyed the
# old way are a miss (another identity), never a wrong hit.
IDENTITY_VERSION = 3

# After a store failure, its operations are skipped (a miss, a skipped save)
# for RETRY_FIRST_S (on Redis at least RETRY_TIMEOUTS times redis_timeout_s,
# what a retry may cost), then tried again; each further failure doubles the
# wait, up to RETRY_MAX_S. A hung store then costs one timeout per retry
# instead of several per request.
RETRY_FIRST_S = 5.0
RETRY_TIMEOUTS = 4
RETRY_MAX_S = 60.0

# Evictions are told when they start, then at most once per this many
# seconds, with what was evicted since: a store at its cap evicts on every
# save.
EVICTIONS_LOG_S = 60.0


def store_identity(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, model_id: str | None
) -> str:
    """A digest of everything that determines the bytes of stored KV: the
    chunk format, the model (``model_identity``: its files' content, KV
    scales of the checkpoint included, or ``model_id``; never the path it
    was given by), the content of its resolved config (``config_content``:
    ``--hf-config-path`` and ``--hf-overrides`` applied, its quantization
    config included), its dtype, quantization and KV cache dtype (fp8's
    e4m3 and e5m2 are both bytes in the cache spec), its KV cache layout
    (per group: layers, spec), the TP size, the block size and the block
    hash algorithm. Same on the scheduler and every worker of a server, and
    on every server with the same setup. Whatever vLLM adds to the config
    is in its content; a new setting of vLLM's own that changes the KV
    bytes must be added here."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    groups = [
        {"layers": list(g.layer_names), "spec": repr(g.kv_cache_spec)}
        for g in kv_cache_config.kv_cache_groups
    ]
    described = {
        # Chunks of another format live under other keys: never looked up.
        "format": FORMAT_VERSION,
        "identity": IDENTITY_VERSION,
        "model": model_identity(model.model, model.revision, model_id),
        "config": config_content(model.hf_config),
        "hf_overrides": _described(model.hf_overrides),
        "quantization": model.quantization,
        "dtype": str(model.dtype),
        "cache_dtype": str(cache.cache_dtype),
        "cache_dtype_skip_layers": list(cache.kv_cache_dtype_skip_layers),
        "block_size": cache.block_size,
        "hash_algo": cache.prefix_caching_hash_algo,
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "groups": groups,
    }
    blob = json.dumps(described, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def _described(value: object) -> object:
    """``value`` as the same text in every process: a function (vLLM's
    ``hf_overrides`` may be one) by its name, not its address."""
    if callable(value):
        return (
            f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
        )
    return value


def make_backend(config: StoreConfig) -> Backend:
    if config.backend == "redis":
        assert config.redis_url is not None
        return RedisBackend(
            config.redis_url,
            config.namespace,
            config.capacity_bytes,
            timeout_s=config.redis_timeout_s,
            password=redis_password(config),
        )
    assert config.path is not None
    return DirectoryBackend(
        config.path, config.capacity_bytes, group_access=config.group_access
    )


@dataclass
class _Outage:
    """A kind of store operation ("read" or "write") that failed."""

    wait_s: float
    logged: bool = False
    retry_at: float = 0.0


class StoreCore:
    """The store as both sides of the connector use it."""

    def __init__(
        self,
        config: StoreConfig,
        backend: Backend,
        identity: str,
        tp_size: int,
        stats: StoreConnectorStats | None = None,
        load_failure_policy: str = "fail",
        tells_read_outages: bool = True,
    ) -> None:
        self.config = config
        # vLLM's kv_load_failure_policy: what a block that fails to load does.
        self.load_failure_policy = load_failure_policy
        self.backend = backend
        self.identity = identity
        # Scheduler side: the workers' KV layout (``BlockLayout.digest``),
        # once their handshake metadata names it (``set_kv_layout``); a
        # worker checks chunks against its own.
        self.kv_layout: str | None = None
        # What every chunk key starts with (``keys``).
        self.key_prefix = identity
        self.tp_size = tp_size
        self.stats = stats if stats is not None else StoreConnectorStats()
        self._warned: set[str] = set()
        # Damaged chunks that could not be deleted (the store cannot be
        # written): never offered or read again by this process.
        self.bad_keys: set[str] = set()
        # "read" (lookups, loads, leases) and "write" (saves) fail apart: a
        # full disk stops saves while reads still hit.
        self._outages: dict[str, _Outage] = {}
        self._first_wait_s = RETRY_FIRST_S
        if config.backend == "redis":
            self._first_wait_s = max(
                RETRY_FIRST_S, RETRY_TIMEOUTS * config.redis_timeout_s
            )
        # False on the workers when the scheduler looks prompts up: it says
        # when reads fail, once for the server.
        self._tells_read_outages = tells_read_outages
        # Evictions not yet told, and when they were last told.
        self._evicted_untold = 0
        self._evictions_told_at: float | None = None

    def evicted(self, n: int) -> None:
        """A save evicted ``n`` chunks to keep the store under its cap:
        count them, and say so when it starts and then at most every
        ``EVICTIONS_LOG_S`` (the metrics line alone would leave a cap set too
        small unnoticed)."""
        if n <= 0:
            return
        self.stats.inc("evictions", n)
        self._evicted_untold += n
        now = time.monotonic()
        told = self._evictions_told_at
        if told is not None and now - told < EVICTIONS_LOG_S:
            return
        logger.info(
            "StoreConnector: the store reached its capacity (%.2f GiB): evicted "
            "%d least recently used chunks%s; raise capacity to keep more",
            self.config.capacity_bytes / 2**30,
            self._evicted_untold,
            "" if told is None else f" in the last {now - told:.0f} s",
        )
        self._evicted_untold = 0
        self._evictions_told_at = now

    def set_kv_layout(self, layout: str) -> None:
        """Key chunks by the workers' KV layout too (scheduler side): servers
        whose attention backends store a block in another byte order keep
        apart chunks, instead of refusing each other's at load."""
        self.kv_layout = layout
        self.key_prefix = f"{self.identity}-{layout}"

    def keys(self, block_hash: bytes) -> list[str]:
        """The chunk key of ``block_hash`` for each TP rank."""
        h = bytes(block_hash).hex()
        return [f"{self.key_prefix}/{h}.{r}" for r in range(self.tp_size)]

    def keys_of(self, block_hashes: Sequence[bytes]) -> list[list[str]]:
        """``keys`` of each of ``block_hashes``, in one pass: a lookup of a
        32k-token prompt builds 2,048 of them."""
        prefix = self.key_prefix
        if self.tp_size == 1:
            return [[f"{prefix}/{h.hex()}.0"] for h in block_hashes]
        ranks = range(self.tp_size)
        return [[f"{prefix}/{h.hex()}.{r}" for r in ranks] for h in block_hashes]

    def warn_once(self, what: str, message: str, *args: object) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(message, *args)

    def usable(self, what: str = "read") -> bool:
        """False while operations of kind ``what`` back off after a
        failure: the caller skips the store (a miss, a skipped save)."""
        outage = self._outages.get(what)
        return outage is None or time.monotonic() >= outage.retry_at

    def unavailable(
        self, e: BackendUnavailable, what: str = "read", op: str | None = None
    ) -> None:
        """Count a failed store operation of kind ``what`` (``op`` names it
        in the log: a lease is a read that writes); back off from the store
        (``usable``), longer after each failure; warn once per outage."""
        self.stats.inc("store_errors")
        outage = self._outages.setdefault(what, _Outage(self._first_wait_s))
        outage.retry_at = time.monotonic() + outage.wait_s
        outage.wait_s = min(2 * outage.wait_s, RETRY_MAX_S)
        if what == "read":
            # A store that cannot be read (unreachable, hung) cannot be
            # written either: skip saves as long (a full disk fails only
            # writes, so a failed write leaves reads alone).
            writes = self._outages.setdefault("write", _Outage(self._first_wait_s))
            writes.retry_at = max(writes.retry_at, outage.retry_at)
        if not outage.logged and (what == "write" or self._tells_read_outages):
            outage.logged = True
            consequence = "skipping saves" if what == "write" else "running on misses"
            logger.warning(
                "StoreConnector: store %s failed, %s until it works again "
                "(trying it again after %.0f s, then at doubling intervals up "
                "to %.0f s): %s",
                what if op is None else f"{what} ({op})",
                consequence,
                self._first_wait_s,
                RETRY_MAX_S,
                e,
            )

    def available(self, what: str = "read") -> None:
        """An operation of kind ``what`` did what failed before (a lease
        taken, a chunk written): the outage is over. Callers must not call
        it for one that had nothing to do (no chunk to lease, a chunk already
        stored), which a read-only or full store lets through."""
        outage = self._outages.pop(what, None)
        if outage is not None and outage.logged:
            logger.info("StoreConnector: store %s works again", what)

    def writable(self) -> bool:
        """Whether the store took writes when last tried."""
        return bool(getattr(self.backend, "writable", not self.backend.read_only))

    def usable_run(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are not known to be bad."""
        if not self.bad_keys:
            return len(keys)
        for i, key in enumerate(keys):
            if key in self.bad_keys:
                return i
        return len(keys)

    def bad_chunk(self, key: str, error: ChunkError, at_load: bool = False) -> None:
        """A chunk that must not be used: count, delete it (the request's own
        save then writes it again) or, if it cannot be deleted, remember it
        as bad; warn once. ``at_load``: found while loading a hit the
        scheduler took (a load error), not by a lookup (a miss)."""
        self.stats.inc("corrupt_chunks")
        if not self.usable():
            fate = "left in place while the store is backed off from"
        elif self._deleted(key):
            fate = "deleted"
        else:
            self.bad_keys.add(key)
            fate = (
                "kept, since the store cannot be written now; this server "
                "will not read it again"
            )
        self.warn_once(
            key,
            "StoreConnector: chunk %s unusable (%s), %s; %s",
            key,
            error,
            fate,
            self._load_failure(at_load),
        )

    def _load_failure(self, at_load: bool, blocks: str = "its block fails") -> str:
        """What a chunk found unusable does to its request: nothing found by
        a lookup (a miss); at load, what ``kv_load_failure_policy`` says."""
        if not at_load:
            return "treated as a miss"
        if self.load_failure_policy == "recompute":
            return (
                f"{blocks} to load and vLLM recomputes the request from "
                "there (kv_load_failure_policy 'recompute')"
            )
        return (
            f"{blocks} to load and vLLM fails the request "
            f"(kv_load_failure_policy {self.load_failure_policy!r}: the "
            'client gets an error); set "kv_load_failure_policy": '
            '"recompute" in --kv-transfer-config to recompute it instead'
        )

    def gone_at_load(self, keys: Sequence[str]) -> None:
        """Chunks a planned load did not find, though its lookup leased
        them: removed by hand (a server's own deletions start a new
        generation, which every lookup sees). Forgotten by every process of
        the store (``Backend.forget``), so the next lookup misses them and
        their blocks are saved again; said once per first key."""
        self.stats.inc("gone_chunks", len(keys))
        try:
            self.backend.forget(keys)
        except BackendUnavailable as e:
            self.unavailable(e)
        self.warn_once(
            f"gone:{keys[0]}",
            "StoreConnector: %d chunk(s) gone from the store at load (%s%s), "
            "removed by hand, not through a server; forgotten, so the next "
            "lookup of the prompt misses them; %s",
            len(keys),
            keys[0],
            ", ..." if len(keys) > 1 else "",
            self._load_failure(True, "their blocks fail"),
        )

    def _deleted(self, key: str) -> bool:
        """Delete ``key``; whether the store could (a store that cannot be
        written keeps it)."""
        if not self.writable():
            return False
        try:
            self.backend.delete(key)
        except BackendUnavailable:
            return False
        return True

    def release(self, lease_id: str, keys: Iterable[str], count: bool) -> None:
        keys = list(keys)
        # A lease not released expires on its own.
        if self.usable():
            try:
                self.backend.release(keys, lease_id)
            except BackendUnavailable as e:
                self.unavailable(e)
        if count:
            self.stats.inc("leases_released")

"""The connector's scheduler side: lookups, load plans, what to save.

A lookup leases the longest run of stored chunks after the locally computed
prefix and checks their headers (``verify_on_lookup``; payloads are checked
once, when a worker loads them); the accepted part becomes a load plan in
the step's metadata, the rest of the lease is released at once. A lease is
one record per request. The directory store keeps what any of its servers
saw stored and whose headers one checked or wrote, until a chunk leaves the
store (``backends/known_chunks.py``): a lookup of such chunks, even this
server's first, costs no file work per chunk before its load, which checks
every chunk again. The prompt's
last full block is offered too, for one token less than it holds: vLLM
computes the prompt's last token in any case, so a hit covers up to
``prompt length - 1`` tokens and the load fills that block whole.

With a prefetch buffer (``prefetch.py``), the requests still waiting after a
step have their stored chunks copied into it meanwhile, and a load reads the
blocks the buffer holds from there.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import chain
from typing import TYPE_CHECKING, Any, cast

from kvlc_store.backends import BackendUnavailable, new_lease_id
from kvlc_store.chunk import HEADER_BYTES, ChunkError, check_header
from kvlc_store.core import StoreCore
from kvlc_store.metadata import LoadSpec, Offer, ProbeSpec, SaveSpec, StoreMetadata
from kvlc_store.offload import LazyOffload
from kvlc_store.prefetch import Prefetcher

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class SchedulerSide:
    """Scheduler-side state of one connector.

    Args:
        core: the shared store.
        block_size: tokens per KV-cache block.
        worker_hits: whether the workers look up too (the stack's
            ``before_update_states``).
        manager: returns the scheduler's KV cache manager, once bound.
        known_blocks: how many block hashes to remember as saved or loaded
            by this server (``_known``).
    """

    def __init__(
        self,
        core: StoreCore,
        block_size: int,
        worker_hits: bool,
        manager: Any,
        known_blocks: int = 1 << 16,
    ) -> None:
        self._core = core
        self._block_size = block_size
        self._worker_hits = worker_hits
        self._manager = manager
        self.lazy: LazyOffload | None = None
        self.prefetcher: Prefetcher | None = None
        # The stack's SchedulerContext, once bound: skips blocks the prefix
        # cache holds when prefetching.
        self.context: Any = None
        self.requests: dict[str, Request] = {}
        self._pending: dict[str, Offer] = {}  # legacy path: offered, not taken
        self._loads: list[LoadSpec] = []
        self._loaded_until: dict[str, int] = {}  # blocks known to be stored
        self._saved_until: dict[str, int] = {}
        # Prefetch: arrived since the last step, not yet handed over.
        self._arrivals: dict[str, Request] = {}
        # Workers save off the forward's path (a KV cache on an accelerator):
        # a finished request's blocks stay until its saves are written.
        self.async_saves = False
        self._sending: set[str] = set()  # requests with such saves planned
        # Block hashes whose save this server planned, or which it loaded,
        # with their chunk keys, most recent last: a block vLLM's prefix
        # cache serves again is not saved again (a copy and a digest for a
        # chunk the store holds), and a repeated lookup takes its keys from
        # here instead of formatting 2,048 of them. Under the key prefix
        # ``_known_prefix``: chunks saved under another KV layout's keys are
        # not saved under the new ones.
        self._known: OrderedDict[bytes, list[str]] = OrderedDict()
        self._known_prefix = core.key_prefix
        self._known_blocks = known_blocks

    def arrived(self, request: Request) -> None:
        """vLLM added ``request`` to the scheduler's queue."""
        self.requests[request.request_id] = request
        if self.prefetcher is not None:
            self._arrivals[request.request_id] = request

    # -- lookups ----------------------------------------------------------

    def offer(self, request: Request, num_computed_tokens: int) -> Offer | None:
        """Lease the stored blocks after ``num_computed_tokens``; None if none."""
        core, bs = self._core, self._block_size
        self.requests.setdefault(request.request_id, request)
        if not core.config.scheduler_lookup:
            return None
        core.stats.inc("lookups")
        if not core.usable():
            return None
        if num_computed_tokens % bs:
            return None
        start = num_computed_tokens // bs
        # Full blocks only; the last prompt token is always computed (it
        # yields the first sampled token), so a hit ends one token short of
        # the prompt at most, even when its last block is loaded whole.
        end = min(len(request.block_hashes), request.num_tokens // bs)
        if min(end * bs, request.num_tokens - 1) <= num_computed_tokens:
            return None
        per_block = self._keys_of(request.block_hashes[start:end])
        flat = list(chain.from_iterable(per_block))
        usable = core.usable_run(flat) // core.tp_size
        per_block, flat = per_block[:usable], flat[: usable * core.tp_size]
        if not flat:
            return None
        lease_id = new_lease_id()
        try:
            n = core.backend.lease(flat, lease_id, core.config.lease_ttl_s)
        except BackendUnavailable as e:
            core.unavailable(e, op="lease write")
            return None
        if n:
            core.available()
        num_blocks = n // core.tp_size
        if core.config.verify_on_lookup:
            num_blocks = self._checked_prefix(
                per_block[:num_blocks], flat[: num_blocks * core.tp_size]
            )
        leased = flat[:n]
        if num_blocks == 0:
            if leased:
                core.release(lease_id, leased, count=False)
            return None
        kept = num_blocks * core.tp_size
        if kept < n:
            core.release(lease_id, leased[kept:], count=False)
        num_tokens = min((start + num_blocks) * bs, request.num_tokens - 1)
        num_tokens -= num_computed_tokens
        core.stats.inc("leases_taken")
        core.stats.inc("lookup_hit_tokens", num_tokens)
        return Offer(lease_id, start, per_block[:num_blocks], num_tokens)

    def _keys_of(self, block_hashes: Sequence[bytes]) -> list[list[str]]:
        """``StoreCore.keys_of``, taken from ``_known`` for the blocks this
        server saved or loaded (a repeated hit: no key formatted)."""
        known = self._known_now()
        found = list(map(known.get, block_hashes))
        if None not in found:
            return cast("list[list[str]]", found)
        built = iter(
            self._core.keys_of(
                [h for h, keys in zip(block_hashes, found, strict=True) if keys is None]
            )
        )
        return [keys if keys is not None else next(built) for keys in found]

    def _known_now(self) -> OrderedDict[bytes, list[str]]:
        """``_known``, forgotten if the chunk keys changed since
        (``StoreCore.set_kv_layout``)."""
        if self._known_prefix != self._core.key_prefix:
            self._known.clear()
            self._known_prefix = self._core.key_prefix
        return self._known

    def _checked_prefix(
        self,
        per_block: Sequence[Sequence[str]],
        flat: Sequence[str] | None = None,
    ) -> int:
        """How many leading blocks have every rank's chunk stored, whole
        (by its length) and ours (by its header): reads headers only, in
        one store round trip where the backend can.

        Checks every block, past a bad one too: each bad chunk found is
        deleted now, so the request's own save (its blocks from the first bad
        one on are computed) writes it again.
        """
        core = self._core
        if flat is None:
            flat = list(chain.from_iterable(per_block))
        # Headers the store's record vouches for (as of the lease just
        # taken): a chunk file is never rewritten, so a header found good
        # stays good until a chunk leaves the store.
        checked = core.backend.checked()
        layout = core.kv_layout
        if layout is None:
            todo = [i for i, key in enumerate(flat) if key not in checked]
        else:
            todo = [i for i, key in enumerate(flat) if checked.get(key) != layout]
        if not todo:
            return len(per_block)
        try:
            heads = core.backend.peek([flat[i] for i in todo], HEADER_BYTES)
        except BackendUnavailable as e:
            core.unavailable(e)
            return 0
        good = len(per_block)
        found: dict[str, str] = {}
        for i, head in zip(todo, heads, strict=True):
            key, block = flat[i], i // core.tp_size
            if head is None:
                good = min(good, block)
                continue
            try:
                header = check_header(
                    head[0], core.identity, key, head[1], core.kv_layout
                )
            except ChunkError as e:
                core.bad_chunk(key, e)
                good = min(good, block)
                continue
            found[key] = header.layout
        core.backend.vouch(found)
        return good

    def commit(
        self, request: Request, block_ids: Sequence[int], offer: Offer, accepted: int
    ) -> None:
        """The scheduler took ``accepted`` tokens of ``offer``: plan their
        load and release the rest of the lease."""
        core, bs = self._core, self._block_size
        num_blocks = min(offer.num_blocks, -(-accepted // bs))
        rest = [k for keys in offer.keys[num_blocks:] for k in keys]
        if num_blocks == 0:
            core.release(offer.lease_id, rest, count=True)
            return
        if rest:
            core.release(offer.lease_id, rest, count=False)
        first = offer.start_block
        keys = offer.keys[:num_blocks]
        buffered = 0
        if self.prefetcher is not None:
            buffered = self.prefetcher.take(request.request_id, keys)
        # Whole blocks, the last one too when the hit ends inside it: its
        # slots past the hit are the request's own next tokens (the block's
        # hash covers them), which the forward then writes again.
        self._loads.append(
            LoadSpec(
                req_id=request.request_id,
                lease_id=offer.lease_id,
                block_ids=list(block_ids[first : first + num_blocks]),
                keys=keys,
                num_buffered=buffered,
                load_async=core.config.load_async,
            )
        )
        self._loaded_until[request.request_id] = first + num_blocks
        loaded = request.block_hashes[first : first + num_blocks]
        self._remember(loaded, keys)
        if self.lazy is not None:
            for block_hash in loaded:
                self.lazy.mark_stored(bytes(block_hash))
        core.stats.inc("loaded_tokens", min(accepted, offer.num_tokens))

    def abort(self, offer: Offer) -> None:
        self._core.release(offer.lease_id, chain.from_iterable(offer.keys), count=True)

    # Legacy pair (vLLM without the explicit lifecycle).

    def offer_legacy(self, request: Request, num_computed_tokens: int) -> int:
        stale = self._pending.pop(request.request_id, None)
        if stale is not None:
            # Offered at an earlier lookup and never taken.
            self.abort(stale)
        offer = self.offer(request, num_computed_tokens)
        if offer is None:
            return 0
        self._pending[request.request_id] = offer
        return offer.num_tokens

    def commit_legacy(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        offer = self._pending.pop(request.request_id, None)
        if offer is not None:
            self.commit(request, block_ids, offer, num_external_tokens)

    # -- each step --------------------------------------------------------

    def build_meta(self, scheduler_output: SchedulerOutput) -> StoreMetadata:
        core, bs = self._core, self._block_size
        meta = StoreMetadata(
            loads=self._loads, sync_loads_first=scheduler_output.has_sync_kv_loads
        )
        self._loads = []
        loading = {spec.req_id for spec in meta.loads}
        if self.prefetcher is not None:
            meta.buffer_dir = str(self.prefetcher.dir)
            self._prefetch(scheduler_output, loading)
        steps: list[tuple[str, int, bool]] = [
            (r.req_id, r.num_computed_tokens, True)
            for r in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        steps += [
            (req_id, cached.num_computed_tokens[i], False)
            for i, req_id in enumerate(cached.req_ids)
        ]
        for req_id, num_computed, is_new in steps:
            request = self.requests.get(req_id)
            if request is None:
                continue
            scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            prompt_blocks = min(
                len(request.block_hashes), request.num_prompt_tokens // bs
            )
            done = min(num_computed + scheduled, request.num_prompt_tokens) // bs
            done = min(done, prompt_blocks)
            # Blocks vLLM's prefix cache served at the first step: saved
            # already if this server saved or loaded them (a block another
            # request computed while decoding was never saved: it is).
            served = num_computed // bs if is_new else 0
            saved = self._saved_until.get(req_id, 0)
            loaded = self._loaded_until.get(req_id, 0)
            block_ids: list[int] | None = None
            if done > saved and self.lazy is None and not core.backend.read_only:
                block_ids = self.block_ids(req_id)
                known = self._known_now()
                for i in range(max(saved, 0), min(done, len(block_ids))):
                    if i < loaded:
                        continue  # Read from the store: already there.
                    if i < served and request.block_hashes[i] in known:
                        known.move_to_end(request.block_hashes[i])
                        continue
                    keys = core.keys(request.block_hashes[i])
                    self._remember([request.block_hashes[i]], [keys])
                    meta.saves.append(
                        SaveSpec(
                            block_ids[i],
                            keys,
                            req_id=req_id if self.async_saves else None,
                        )
                    )
                    if self.async_saves:
                        self._sending.add(req_id)
                self._saved_until[req_id] = done
            # Worker-side lookup: blocks of a new prompt not found (or not
            # looked up) when this step was scheduled. Whole blocks before
            # the step's last token only: a hit the workers report must
            # leave that token to compute.
            if (
                is_new
                and self._worker_hits
                and req_id not in loading
                and num_computed % bs == 0
            ):
                start = num_computed // bs
                end = min(
                    len(request.block_hashes),
                    (request.num_tokens - 1) // bs,
                    (num_computed + scheduled - 1) // bs,
                )
                if end > start:
                    if block_ids is None:
                        block_ids = self.block_ids(req_id)
                    meta.probes.append(
                        ProbeSpec(
                            req_id,
                            block_ids[start:end],
                            core.keys_of(request.block_hashes[start:end]),
                        )
                    )
        if self._sending:
            preempted = set(scheduler_output.preempted_req_ids or ())
            meta.preempted = preempted & self._sending
        if self.lazy is not None:
            self.lazy.plan(
                lambda block_id, block_hash: meta.saves.append(
                    SaveSpec(block_id, core.keys(block_hash), pinned=True)
                )
            )
        return meta

    def _remember(
        self, block_hashes: Sequence[bytes], keys: Sequence[list[str]]
    ) -> None:
        """The blocks of ``block_hashes`` (chunk keys ``keys``) are saved
        (planned) or loaded by this server: the most recent now."""
        known = self._known_now()
        known.update(zip(block_hashes, keys, strict=True))
        # In C: a 32k-token hit remembers 2,048 blocks on the critical path.
        deque(map(known.move_to_end, block_hashes), maxlen=0)
        while len(known) > self._known_blocks:
            known.popitem(last=False)

    def _prefetch(self, scheduler_output: SchedulerOutput, loading: set[str]) -> None:
        """Hand the requests still waiting after this step to the prefetcher
        (oldest first); drop the prefetched chunks of those scheduled without
        a load (their prefix was found locally, or is no longer stored)."""
        prefetcher, bs = self.prefetcher, self._block_size
        assert prefetcher is not None
        prefetcher.step()
        for new in scheduler_output.scheduled_new_reqs:
            self._arrivals.pop(new.req_id, None)
            if new.req_id not in loading:
                prefetcher.release(new.req_id)
        arrivals, self._arrivals = self._arrivals, {}
        for req_id, request in arrivals.items():
            end = min(len(request.block_hashes), request.num_tokens // bs)
            start = 0
            if self.context is not None:
                while start < end and (
                    self.context.get_cached_block(request.block_hashes[start], 0)
                    is not None
                ):
                    start += 1
            prefetcher.want(req_id, self._core.keys_of(request.block_hashes[start:end]))

    def on_load_errors(self, invalid_block_ids: set[int]) -> None:
        """Blocks whose load failed (a chunk that failed its checksum, now
        deleted, or one removed by hand): vLLM recomputes them
        (``kv_load_failure_policy: recompute``), so they are saved again
        like computed ones, and not taken as stored any longer."""
        for req_id, loaded in list(self._loaded_until.items()):
            block_ids = self.block_ids(req_id)[:loaded]
            bad = [i for i, b in enumerate(block_ids) if b in invalid_block_ids]
            request = self.requests.get(req_id)
            if bad and request is not None and not self._core.writable():
                # The workers could not delete the damaged chunks either:
                # never offer them again (they would fail every load).
                for i in bad:
                    self._core.bad_keys.update(self._core.keys(request.block_hashes[i]))
            if bad:
                self._loaded_until[req_id] = bad[0]
                if req_id in self._saved_until:
                    self._saved_until[req_id] = min(self._saved_until[req_id], bad[0])
                if request is not None:
                    # Not stored after all (damaged, or gone): saved again
                    # when the prefix cache serves them to a later request.
                    for i in bad:
                        self._known.pop(request.block_hashes[i], None)

    def block_ids(self, req_id: str) -> list[int]:
        manager: KVCacheManager | None = self._manager()
        if manager is None:
            return []
        return list(manager.get_block_ids(req_id)[0])

    def finished(self, request: Request) -> bool:
        """``request`` finished; whether vLLM must keep its blocks until the
        workers report its saves written (``delay_free_blocks``)."""
        req_id = request.request_id
        stale = self._pending.pop(req_id, None)
        if stale is not None:
            self.abort(stale)
        self.requests.pop(req_id, None)
        self._arrivals.pop(req_id, None)
        if self.prefetcher is not None:
            self.prefetcher.release(req_id)
        self._loaded_until.pop(req_id, None)
        self._saved_until.pop(req_id, None)
        if req_id in self._sending:
            self._sending.discard(req_id)
            return True
        return False

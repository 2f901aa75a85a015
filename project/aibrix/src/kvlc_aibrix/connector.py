"""``AIBrixHookConnector``: AIBrix's KV offloading served through the stack's
``before_update_states`` hook, with no patch of vLLM.

What AIBrix's ``AIBrixOffloadingConnector`` (type 1) does after it
monkey-patches ``GPUModelRunner.execute_model`` and ``_update_states``, done
here through the hook:

* the scheduler side only tells the workers, every step, which prompt
  tokens each request computes and which blocks it holds (no lookup: the
  cache lives on the workers and is read when the step runs);
* each worker, in ``before_update_states``, pins the longest cached prefix of
  every request's scheduled prompt tokens in its own AIBrix cache and
  reports it; the runner takes the minimum over the TP ranks (where AIBrix
  needs its group-aware cache manager or its own all-reduce);
* ``start_load_kv`` copies the pinned blocks into the request's KV blocks and
  releases them; a pin whose load never ran (the step failed) is released by
  the next hook call or at shutdown;
* ``wait_for_save`` stores the prompt blocks the step completed, skipping the
  ones the cache holds, as AIBrix does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from aibrix_kvcache import (  # type: ignore[import-untyped]
    BaseKVCacheManager,
    TokenListView,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvlc_aibrix.blocks import BlockCopier
from kvlc_aibrix.cache import Lease, acquire_prefix, open_cache, release_all, store

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(f"vllm.{__name__}")


@dataclass
class StepRequest:
    """One scheduled request, as the workers need it this step."""

    req_id: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    # Set the first time the workers see the request.
    prompt_token_ids: list[int] | None = None
    # Block ids new this step; all of them when ``replace_blocks``.
    block_ids: list[int] = field(default_factory=list)
    replace_blocks: bool = False


@dataclass
class AIBrixStepMetadata(KVConnectorMetadata):
    step: int
    requests: list[StepRequest]
    finished: set[str]


@dataclass
class _Tracked:
    """What a worker keeps of a request between steps."""

    tokens: TokenListView
    prompt_len: int
    block_ids: list[int]


def _first_group(block_ids: tuple[list[int], ...] | None) -> list[int]:
    return list(block_ids[0]) if block_ids else []


class AIBrixHookConnector(KVConnectorBase_V1):
    """AIBrix KV offloading (L1 CPU cache, optional shared L2) for vLLM.

    ``kv_connector_extra_config``:

    * ``min_load_tokens`` (int, default one cache block): load nothing for a
      request whose cached prefix is shorter (AIBrix's own connector skips
      loads under 8 engine blocks).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        unknown = set(extra) - {"min_load_tokens"}
        if unknown:
            raise ValueError(
                f"AIBrixHookConnector: unknown kv_connector_extra_config keys "
                f"{sorted(unknown)}; the only key is 'min_load_tokens' (the cache "
                f"itself is configured by AIBrix's AIBRIX_KV_CACHE_OL_* variables)"
            )
        self._min_load_tokens = int(extra.get("min_load_tokens", 0))
        if self._min_load_tokens < 0:
            raise ValueError("AIBrixHookConnector: min_load_tokens must be >= 0")
        self._engine_block = vllm_config.cache_config.block_size
        # Scheduler side: prompt length of every request not yet finished.
        self._prompt_lens: dict[str, int] = {}
        self._step = 0
        # Worker side.
        self._vllm_config = vllm_config
        self._num_blocks = kv_cache_config.num_blocks
        self._cache: BaseKVCacheManager | None = None
        self._copier: BlockCopier | None = None
        self._tracked: dict[str, _Tracked] = {}
        self._applied_step = -1
        self._pending: list[Lease] = []
        self._load_errors: set[int] = set()

    # ------------------------------------------------------------------
    # Scheduler side: no lookup; the workers find their hits themselves.
    # ------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        return

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> KVConnectorMetadata:
        for req_id in scheduler_output.finished_req_ids:
            self._prompt_lens.pop(req_id, None)
        scheduled = scheduler_output.num_scheduled_tokens
        requests: list[StepRequest] = []
        for new in scheduler_output.scheduled_new_reqs:
            if new.prompt_token_ids is None:  # prompt embeddings: not cached
                continue
            self._prompt_lens[new.req_id] = len(new.prompt_token_ids)
            requests.append(
                StepRequest(
                    new.req_id,
                    new.num_computed_tokens,
                    scheduled[new.req_id],
                    prompt_token_ids=list(new.prompt_token_ids),
                    block_ids=_first_group(new.block_ids),
                    replace_blocks=True,
                )
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in self._prompt_lens:
                continue
            computed = cached.num_computed_tokens[i]
            resumed = req_id in cached.resumed_req_ids
            new_blocks = _first_group(cached.new_block_ids[i])
            if computed >= self._prompt_lens[req_id] and not resumed:
                if new_blocks:  # decode: keep the workers' block lists whole
                    requests.append(StepRequest(req_id, computed, 0, None, new_blocks))
                continue
            requests.append(
                StepRequest(
                    req_id,
                    computed,
                    scheduled[req_id],
                    block_ids=new_blocks,
                    replace_blocks=resumed,
                )
            )
        self._step += 1
        return AIBrixStepMetadata(
            self._step, requests, set(scheduler_output.finished_req_ids)
        )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._prompt_lens.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------
    # Worker side.
    # ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.utils.torch_utils import get_kv_cache_torch_dtype

        from vllm.distributed import get_tp_group

        config = self._vllm_config
        model = config.model_config
        parallel = config.parallel_config
        rank = get_tp_group().rank_in_group
        num_heads = model.get_num_kv_heads(parallel)
        dtype = get_kv_cache_torch_dtype(config.cache_config.cache_dtype, model.dtype)
        self._cache = open_cache(
            block_ntokens=self._engine_block,
            dtype=dtype,
            heads=list(range(num_heads * rank, num_heads * (rank + 1))),
            layers=list(range(*model.get_layers_start_end_indices(parallel))),
            head_size=model.get_head_size(),
            max_model_len=model.max_model_len,
            max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
        )
        # AIBrix's order of layers: the attention layers as the model
        # registered them (its op takes per-layer lists in this order).
        context = config.compilation_config.static_forward_context
        names = [name for name in context if name in kv_caches]
        self._copier = BlockCopier(
            [kv_caches[name] for name in names],
            self._num_blocks,
            self._engine_block,
            [context[name]._k_scale for name in names],
            [context[name]._v_scale for name in names],
        )
        torch_path = not self._copier.use_aibrix_op
        if torch_path and self._cache.block_size != self._engine_block:
            raise ValueError(
                f"AIBrixHookConnector: AIBrix's block size {self._cache.block_size} "
                f"differs from vLLM's {self._engine_block}; without AIBrix's "
                f"compiled op they must match (unset AIBRIX_KV_CACHE_OL_BLOCK_SIZE)"
            )
        self._copier.check_block_shape(self._cache.block_spec.block_shape, dtype)
        logger.info(
            "AIBrixHookConnector: rank %d, %d layers, copies with %s",
            rank,
            len(names),
            "AIBrix's op" if self._copier.use_aibrix_op else "torch",
        )

    def _apply(self, meta: KVConnectorMetadata | None) -> AIBrixStepMetadata:
        """Bring the tracked requests up to this step (once per step: the hook
        runs only in some steps, ``wait_for_save`` in all)."""
        assert isinstance(meta, AIBrixStepMetadata), type(meta)
        if meta.step == self._applied_step:
            return meta
        self._applied_step = meta.step
        for req_id in meta.finished:
            self._tracked.pop(req_id, None)
        for req in meta.requests:
            if req.prompt_token_ids is not None:
                tokens = req.prompt_token_ids
                self._tracked[req.req_id] = _Tracked(
                    TokenListView(tokens), len(tokens), list(req.block_ids)
                )
            elif req.req_id in self._tracked:
                tracked = self._tracked[req.req_id]
                if req.replace_blocks:
                    tracked.block_ids = list(req.block_ids)
                else:
                    tracked.block_ids += req.block_ids
        return meta

    def _prompt_span(self, req: StepRequest) -> tuple[_Tracked, int, int] | None:
        """The request's tracked state and the prompt tokens it computes this
        step, or None if it computes none."""
        tracked = self._tracked.get(req.req_id)
        if tracked is None:
            return None
        start = req.num_computed_tokens
        end = min(start + req.num_scheduled_tokens, tracked.prompt_len)
        return (tracked, start, end) if start < end else None

    def before_update_states(self, scheduler_output: SchedulerOutput) -> dict[str, int]:
        meta = self._apply(scheduler_output.kv_connector_metadata)
        # Pins of a step that failed before its load ran.
        release_all(self._pending)
        assert self._cache is not None, "register_kv_caches was not called"
        block = self._cache.block_size
        hits: dict[str, int] = {}
        try:
            for req in meta.requests:
                span = self._prompt_span(req)
                if span is None:
                    continue
                tracked, start, end = span
                aligned = start - start % block
                stop = end - end % block
                if stop - aligned < max(block, self._min_load_tokens):
                    continue
                leases = acquire_prefix(
                    self._cache, req.req_id, tracked.tokens, aligned, stop
                )
                self._pending += leases
                found = aligned + sum(lease.num_tokens for lease in leases) - start
                if found > 0:
                    hits[req.req_id] = found
        except BaseException:
            release_all(self._pending)
            raise
        return hits

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # Load every pinned block, also past the hit the ranks agreed on: the
        # runner computes those tokens and overwrites what was loaded.
        leases, self._pending = self._pending, []
        try:
            assert self._copier is not None
            for lease in leases:
                tracked = self._tracked[lease.req_id]
                try:
                    self._copier.load(
                        tracked.block_ids, lease.first_token, lease.tensors()
                    )
                except Exception:
                    logger.exception(
                        "AIBrixHookConnector: loading request %s failed; its "
                        "blocks are recomputed",
                        lease.req_id,
                    )
                    first = lease.first_token // self._engine_block
                    count = -(-lease.num_tokens // self._engine_block)
                    self._load_errors.update(tracked.block_ids[first : first + count])
        finally:
            release_all(leases)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: Any,
        **kwargs: Any,
    ) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._apply(self._get_connector_metadata())
        assert self._cache is not None and self._copier is not None
        copier = self._copier
        block = self._cache.block_size
        for req in meta.requests:
            span = self._prompt_span(req)
            if span is None:
                continue
            tracked, start, end = span
            aligned, stop = start - start % block, end - end % block
            if stop <= aligned:
                continue

            fill = partial(copier.save, tracked.block_ids)
            store(self._cache, tracked.tokens, aligned, stop, fill)

    def shutdown(self) -> None:
        release_all(self._pending)
        if self._cache is not None:
            self._cache.close()
            self._cache = None

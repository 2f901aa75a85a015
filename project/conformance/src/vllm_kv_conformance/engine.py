"""One vLLM engine in this process, with the connector under test, stepped by hand.

``runner.run_conformance`` builds a ``KitEngine`` per connector configuration
(and one per ``kv_load_failure_policy`` for the failed-load scenarios); the
scenarios submit token prompts, step the engine themselves (so they can abort
a request or break a step between two steps) and read the scheduler and its
connector through the in-process object chain:
``LLMEngine.engine_core`` (``InprocClient``) ``.engine_core`` (``EngineCore``)
``.scheduler``, whose ``connector`` is the scheduler-side instance; the
worker-side instance is vLLM's process-global KV transfer group.

Why in-process: with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and one rank, the
engine core and its worker run in the caller's process (vLLM's
``UniProcExecutor``), so the kit wraps the very connector objects vLLM calls,
and an engine costs one import of vLLM for all of them. Local prefix caching
is off, so every cached token comes from the connector, and the engine is
eager (no graph capture or compile: connector behaviour does not depend on
it). The pool is small (``num_gpu_blocks``) so three requests at once preempt.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_kv_conformance.machine import native_dtype

BLOCK_SIZE = 128
"""Tokens per KV block: the CPU backend's block size."""
MAX_MODEL_LEN = 4 * BLOCK_SIZE
NUM_GPU_BLOCKS = 10
"""The pool: nine usable blocks (one is vLLM's null block), so three requests
of three blocks each fill it and the first decode that needs a fourth block
preempts one of them."""


def engine_environment() -> None:
    """Set what the in-process engine needs, unless the caller set it already:
    the engine core in this process, a small CPU KV cache, no thread binding
    (the OS places threads; binding pins to core 0), no hub lookups."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")


@dataclass
class Completion:
    """What a finished request produced, as ``LLMEngine.step`` reported it."""

    token_ids: list[int]
    num_cached_tokens: int
    finish_reason: str | None


@dataclass
class StepLog:
    """What the engine did during a scenario's steps."""

    steps: int = 0
    preempted: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)


class KitEngine:
    """An ``LLMEngine`` on the tiny model with the given KV transfer config.

    Args:
        model_dir: the tiny model (``model.make_model``).
        kv_transfer_config: the connector's ``--kv-transfer-config`` as a
            dict, or None for an engine without a connector (a reference).
        build_hook: a context-manager factory entered around the engine's
            build (``checks.ContextTracker.tracking``: it sees the scheduler
            context vLLM binds to the connector then).
    """

    def __init__(
        self,
        model_dir: Path,
        kv_transfer_config: dict[str, Any] | None,
        build_hook: Callable[[], Any] | None = None,
    ) -> None:
        engine_environment()
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        args = EngineArgs(
            model=str(model_dir),
            dtype=native_dtype(),
            max_model_len=MAX_MODEL_LEN,
            block_size=BLOCK_SIZE,
            enable_prefix_caching=False,
            enforce_eager=True,
            seed=0,
            # On CPU the share of host memory the engine may reserve.
            gpu_memory_utilization=0.1,
            num_gpu_blocks_override=NUM_GPU_BLOCKS,
            max_num_seqs=4,
            kv_transfer_config=(
                KVTransferConfig(**kv_transfer_config)
                if kv_transfer_config is not None
                else None
            ),
        )
        try:
            with _tracking(build_hook):
                # Any: the kit reads RequestOutput fields vLLM types as optional.
                self.engine: Any = LLMEngine.from_engine_args(args)
        except BaseException:
            release_vllm_state()
            raise
        core = getattr(self.engine.engine_core, "engine_core", None)
        if core is None:
            self.close()
            raise RuntimeError(
                "the kit needs vLLM's engine core in its own process: set "
                "VLLM_ENABLE_V1_MULTIPROCESSING=0 before vLLM is imported"
            )
        self.scheduler: Any = core.scheduler
        self.connector: Any = self.scheduler.connector
        self.vocab_size: int = self.engine.model_config.get_vocab_size()
        self._outputs: dict[str, Completion] = {}
        self._internal: dict[str, str] = {}
        self._pending: set[str] = set()
        self.log = StepLog()
        self._step_hooks: list[Callable[[], None]] = []

    @property
    def worker_connector(self) -> Any:
        """The worker-side connector instance (this process's KV transfer
        group), or None without a connector."""
        from vllm.distributed.kv_transfer import kv_transfer_state

        if not kv_transfer_state.has_kv_transfer_group():
            return None
        return kv_transfer_state.get_kv_transfer_group()

    def on_step(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` after every step (the recorder's end-of-step check)."""
        self._step_hooks.append(hook)

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int = 8,
        recompute: bool = False,
    ) -> str:
        """Queue a greedy request; return the id the scheduler knows it by
        (vLLM appends a suffix to the caller's id). ``recompute``: it reads no
        cached prefix, so the connector supplies nothing and its tokens are
        what vLLM computes (``SamplingParams.skip_reading_prefix_cache``)."""
        from vllm import SamplingParams

        params = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            skip_reading_prefix_cache=True if recompute else None,
        )
        internal = self.engine.add_request(
            request_id, {"prompt_token_ids": list(prompt_token_ids)}, params
        )
        self._internal[request_id] = str(internal or request_id)
        self._pending.add(request_id)
        return self._internal[request_id]

    def internal_id(self, request_id: str) -> str:
        """The scheduler's id of the request submitted as ``request_id``."""
        return self._internal[request_id]

    def step(self) -> None:
        """One engine step; finished requests' outputs are kept for
        ``completion``. An exception is recorded in the log and re-raised."""
        try:
            outputs = self.engine.step()
        except Exception as e:
            self.log.errors.append(f"{type(e).__name__}: {e}")
            raise
        finally:
            self.log.steps += 1
            for hook in self._step_hooks:
                hook()
        for out in outputs:
            if out.finished:
                self._pending.discard(out.request_id)
                completion = out.outputs[0]
                self._outputs[out.request_id] = Completion(
                    token_ids=list(completion.token_ids),
                    num_cached_tokens=int(out.num_cached_tokens or 0),
                    finish_reason=completion.finish_reason,
                )

    def busy(self) -> bool:
        return bool(self.engine.has_unfinished_requests())

    def run_until_idle(self, timeout_s: float = 120.0) -> None:
        """Step until no request is left, then twice more with none, so a
        connector's between-step work (async loads and saves, deferred
        releases) can finish. A step with nothing running (requests waiting
        for an asynchronous load) is followed by a millisecond's sleep."""
        deadline = time.monotonic() + timeout_s
        while self.busy():
            if time.monotonic() > deadline:
                raise RuntimeError(f"requests still unfinished after {timeout_s:.0f} s")
            self.step()
            if not self.scheduler.running:
                time.sleep(0.001)
        for _ in range(2):
            self.step()

    def settle(self, done: Callable[[], bool], timeout_s: float = 2.0) -> bool:
        """Step an idle engine until ``done()`` (blocks freed, leases
        released: what a connector finishes between steps), at most
        ``timeout_s``; whether it came true."""
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                return False
            self.step()
            time.sleep(0.02)
        return True

    def run(
        self, requests: dict[str, list[int]], recompute: bool = False
    ) -> dict[str, Completion]:
        """Submit ``requests`` (id -> prompt) together, step until idle and
        return their completions."""
        for request_id, prompt in requests.items():
            self.submit(request_id, prompt, recompute=recompute)
        self.run_until_idle()
        return {rid: self.completion(rid) for rid in requests}

    def completion(self, request_id: str) -> Completion:
        try:
            return self._outputs[request_id]
        except KeyError:
            raise RuntimeError(f"request {request_id!r} produced no output") from None

    def abort(self, request_id: str) -> None:
        self._pending.discard(request_id)
        self.engine.abort_request([request_id])

    def abort_unfinished(self) -> list[str]:
        """Abort every request still in flight (after a scenario raised);
        return their ids."""
        pending = sorted(self._pending)
        for request_id in pending:
            self.abort(request_id)
        return pending

    def free_blocks(self) -> tuple[int, int]:
        """(free blocks, usable blocks) of the scheduler's pool."""
        pool = self.scheduler.kv_cache_manager.block_pool
        return pool.get_num_free_blocks(), pool.num_gpu_blocks - 1

    def close(self) -> None:
        """Shut the engine down and release vLLM's process-global state (the KV
        transfer group, the distributed environment), so the next
        ``KitEngine`` in this process starts clean."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.engine_core.shutdown()
            self.engine = None
        release_vllm_state()


def release_vllm_state() -> None:
    """Shut down vLLM's process-global KV transfer group and distributed
    environment (after an engine, or a build that failed half-way)."""
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        ensure_kv_transfer_shutdown,
    )
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    ensure_kv_transfer_shutdown()
    cleanup_dist_env_and_memory()
    gc.collect()


@contextmanager
def _tracking(hook: Callable[[], Any] | None) -> Iterator[None]:
    """Run ``hook`` (a context-manager factory) around the engine's build."""
    if hook is None:
        yield
        return
    with hook():
        yield

"""What the scheduler side hands the workers each step (``StoreMetadata``),
and the lookup answers it keeps meanwhile."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class Offer:
    """A lookup's answer: leased chunks for blocks ``start_block`` on, good
    for ``num_tokens`` tokens (the last block may be offered whole for one
    token less than it holds: the prompt's last token is always computed)."""

    lease_id: str
    start_block: int
    keys: list[list[str]]  # per block, one key per TP rank
    num_tokens: int

    @property
    def num_blocks(self) -> int:
        return len(self.keys)


@dataclass
class LoadSpec:
    """Blocks to fill from the store, then release: before the step's
    forward, or in the background with ``load_async``."""

    req_id: str
    lease_id: str | None
    block_ids: list[int]
    keys: list[list[str]]
    # Leading blocks whose chunks the prefetch buffer holds (prefetch.py).
    num_buffered: int = 0
    # Loaded beside the steps, reported through get_finished (async_load.py).
    load_async: bool = False


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
    # Saves off the forward's path (a KV cache on an accelerator): the
    # request whose blocks vLLM keeps, once it finishes, until the workers
    # report its saves written (get_finished).
    req_id: str | None = None


@dataclass
class StoreMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    probes: list[ProbeSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # The scheduler side's prefetch buffer, when prefetch is on.
    buffer_dir: str | None = None
    # Requests preempted by this step whose saves may be in flight: their
    # blocks are free, so the workers finish those saves first.
    preempted: set[str] = field(default_factory=set)
    # vLLM's SchedulerOutput.has_sync_kv_loads: the runner starts the loads
    # before the forward only when it is set.
    sync_loads_first: bool = False

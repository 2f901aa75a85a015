"""The optional introspection protocol a connector may implement for the kit,
and the kit's adapters for connectors that expose the same through their own
state.

A connector that leases, pins or reserves anything for a match lets the kit
see what is still held by implementing, on its scheduler-side instance (or
its worker-side one: both are asked)::

    def kv_conformance_open_leases(self) -> Collection[Hashable]:
        '''Ids of the leases, pins or reservations held right now.'''

and, to take part in the failed-load scenarios::

    def kv_conformance_break_hit(self, query_result: object) -> bool:
        '''Damage what the match whose query_result this is would load, so
        that the next load of the same tokens fails on the worker (as a
        load error, get_block_ids_with_load_errors). False: cannot.'''

``query_result`` is what the connector put in its ``ExternalKVMatch`` (None
for a legacy connector; such a connector gets its last hit's prompt instead
from the request it finds in its own state). Both are optional: without the
first, the lease checks say N/A; without the second, the failed-load
scenarios do.

The scenarios (``checks.settle``) call ``open_leases`` before and after each
scenario and fail it for leases opened during it that are still open once all
its requests are finished; ``break_hit`` is called by
``scenarios.failed_load``.

Adapters (a ``MultiConnector``'s connectors are asked too):
``SimpleCPUOffloadConnector`` pins the CPU blocks of a hit in its
CPU block pool (a reference each); the adapter lists the referenced ones.
``StoreConnector`` (the project's reference connector, package
``kvlc_store``) on its directory backend keeps a lease as a file
``leases/<lease id>`` in its store, removed when the lease is released (its
README and ``backends/directory.py``); its ``Offer`` (the ``query_result``)
names the chunk keys, whose files the adapter damages past their header (a
payload that fails its checksum at load: the store's own documented fault).
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Hashable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

OPEN_LEASES = "kv_conformance_open_leases"
BREAK_HIT = "kv_conformance_break_hit"


@runtime_checkable
class ExposesLeases(Protocol):
    def kv_conformance_open_leases(self) -> Collection[Hashable]: ...


@runtime_checkable
class BreaksHits(Protocol):
    def kv_conformance_break_hit(self, query_result: object) -> bool: ...


def open_leases(connectors: list[Any]) -> frozenset[Hashable] | None:
    """Leases held now by any of ``connectors`` (scheduler and worker side),
    from the protocol and the adapters together; None when none of them
    exposes any."""
    found: set[Hashable] | None = None
    for connector in _with_subconnectors(connectors):
        for source in (_protocol_leases, _store_connector_leases, _cpu_offload_pins):
            leases = source(connector)
            if leases is not None:
                found = (found or set()) | {
                    (type(connector).__name__, x) for x in leases
                }
    return None if found is None else frozenset(found)


def _with_subconnectors(connectors: list[Any]) -> list[Any]:
    """``connectors`` and, for a MultiConnector, the connectors it holds."""
    out: list[Any] = []
    for connector in connectors:
        if connector is not None:
            out.append(connector)
            out += _with_subconnectors(list(getattr(connector, "_connectors", [])))
    return out


def can_break_hits(connector: Any) -> bool:
    return (
        isinstance(connector, BreaksHits) or _store_backend_root(connector) is not None
    )


def break_hit(connector: Any, query_result: object) -> bool:
    """Damage what the match of ``query_result`` would load; whether done."""
    if isinstance(connector, BreaksHits):
        return bool(connector.kv_conformance_break_hit(query_result))
    return _store_connector_break(connector, query_result)


def _protocol_leases(connector: Any) -> Collection[Hashable] | None:
    if isinstance(connector, ExposesLeases):
        return list(connector.kv_conformance_open_leases())
    return None


# -- SimpleCPUOffloadConnector (vLLM, with the stack) --------------------------


def _cpu_offload_pins(connector: Any) -> Collection[Hashable] | None:
    """CPU blocks referenced in SimpleCPUOffloadConnector's CPU pool: a hit
    pins its CPU blocks from prepare until its load ends (the stack's
    ``simple_kv_offload/manager.py``); stored blocks are cached unreferenced."""
    manager = getattr(connector, "scheduler_manager", None)
    pool = getattr(manager, "cpu_block_pool", None)
    blocks = getattr(pool, "blocks", None)
    if blocks is None:
        return None
    return [
        f"cpu-block-{b.block_id}" for b in blocks if b.ref_cnt > 0 and not b.is_null
    ]


# -- StoreConnector (kvlc_store) on its directory backend ---------------------


def _store_backend(connector: Any) -> Any:
    if type(connector).__module__.split(".")[0] != "kvlc_store" and not any(
        c.__module__.startswith("kvlc_store") for c in type(connector).__mro__
    ):
        return None
    core = getattr(connector, "_core", None)
    return getattr(core, "backend", None)


def _store_backend_root(connector: Any) -> Path | None:
    backend = _store_backend(connector)
    root = getattr(backend, "root", None)
    leases = getattr(backend, "_leases", None)
    if isinstance(root, Path) and isinstance(leases, Path):
        return root
    return None


def _store_connector_leases(connector: Any) -> Collection[Hashable] | None:
    backend = _store_backend(connector)
    leases = getattr(backend, "_leases", None)
    if not isinstance(leases, Path):
        return None
    with contextlib.suppress(FileNotFoundError):
        return [p.name for p in leases.iterdir()]
    return []


def _store_connector_break(connector: Any, query_result: object) -> bool:
    backend = _store_backend(connector)
    keys = getattr(query_result, "keys", None)
    path_of = getattr(backend, "_path", None)
    if backend is None or not keys or path_of is None:
        return False
    broken = 0
    for block_keys in keys:
        for key in block_keys:
            path = Path(path_of(key))
            try:
                data = bytearray(path.read_bytes())
            except FileNotFoundError:
                continue
            # The last payload byte: the header still vouches for the chunk
            # (a lookup offers it), its checksum fails at load.
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))
            broken += 1
    return broken > 0

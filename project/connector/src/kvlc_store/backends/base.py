"""The storage interface the connector uses, and what both backends share."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Generator, Mapping, Sequence
from typing import Protocol

# A value to store: one bytes-like object, or parts to store concatenated.
Data = bytes | memoryview | Sequence[bytes | memoryview]
# What a read found of one key: its first bytes and its stored length.
Head = tuple[bytes, int]

LOW_WATERMARK = 0.9

# Under vLLM's logger when the connector runs in a server (see connector.py).
logger = logging.getLogger("vllm.kvlc_store.backends")


class BackendUnavailable(Exception):
    """The store cannot be reached right now."""


class Backend(Protocol):
    """The storage interface the connector uses."""

    # Serves reads only: ``put`` writes nothing, leases are not taken (the
    # store is taken not to change), nothing is deleted.
    read_only: bool

    def put(self, key: str, data: Data) -> int | None:
        """Store ``data`` (or its parts, concatenated) under ``key``
        (atomically: a reader sees all or nothing) unless the key is already
        stored; return the number of chunks evicted to stay under the cap,
        or None if nothing was written (the key was stored; a read-only
        store)."""
        ...

    def get(self, key: str) -> bytes | None:
        """The stored bytes of ``key`` (a use, for LRU), or None."""
        ...

    def peek(self, keys: Sequence[str], n: int) -> list[Head | None]:
        """For each key, its first ``n`` bytes and its stored length, or
        None if not stored. Not a use: a lookup checks headers with it."""
        ...

    def read_into(
        self,
        keys: Sequence[str],
        head_bytes: int,
        targets: Sequence[Sequence[memoryview]],
    ) -> Generator[Head | None, None, None]:
        """Read each key (a use): yield its first ``head_bytes`` bytes and
        its stored length, with the rest of its value written into its
        ``targets`` in order when the value is exactly ``head_bytes`` plus
        their size (else the targets are left alone), or None if not stored.

        Yields in key order as each key is done; a backend may fetch later
        keys meanwhile, so the caller's work on one key overlaps the fetch of
        the next ones."""
        ...

    def delete(self, key: str) -> None:
        """Remove ``key`` if stored (a corrupt chunk, found by a reader)."""
        ...

    def lease(self, keys: Sequence[str], lease_id: str, ttl_s: float) -> int:
        """Lease the longest leading run of ``keys`` that are stored; return
        its length. Leased keys are not evicted until released or expired."""
        ...

    def release(self, keys: Sequence[str], lease_id: str) -> None:
        """Drop the lease ``lease_id`` on ``keys`` (unknown ones are ignored)."""
        ...

    def num_bytes(self) -> int:
        """The store's current size in bytes (chunks only)."""
        ...

    def forget(self, keys: Sequence[str]) -> None:
        """``keys`` were leased but a load found them gone: if they are
        still gone, every process of the store forgets what it knew of its
        chunks (a backend that keeps no such memory does nothing)."""
        ...

    def checked(self) -> Mapping[str, str]:
        """Keys whose chunk headers are known good without a read, with the
        KV layout each header names: recorded through ``vouch`` by any
        process of the store, as of this process's last ``lease``. A lookup
        reads the headers of the others. Empty where no record is kept."""
        ...

    def vouch(self, headers: Mapping[str, str]) -> None:
        """Record that the stored chunks of ``headers`` (key -> KV layout)
        have good headers: read and checked by a lookup, or written by this
        server's save. Best effort and never raises; a record that cannot
        be kept is not (a Redis lookup reads every header in one round trip
        anyway)."""
        ...

    def close(self) -> None: ...


def new_lease_id() -> str:
    return uuid.uuid4().hex


def as_parts(data: Data) -> list[memoryview]:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return [memoryview(data).cast("B")]
    return [memoryview(p).cast("B") for p in data]

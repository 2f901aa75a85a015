"""Chunks in pinned host memory, in front of the store (``host_tier``).

A worker with a KV cache on a GPU moves its blocks through slots of pinned
host memory, one chunk's payload per slot, in payload order. A save copies
its blocks into slots and writes the chunks to the store from there; a load
reads its chunks from the store into slots, checks them there, and copies
them into its blocks. With ``host_tier`` set, a slot keeps its chunk after
that, under the chunk's key, until the least recently used slot is needed
again: a later load of the same key is one copy over the host link, with no
store read, as LMCache's local CPU backend and SGLang HiCache's host tier
serve theirs. A slot holds only what a save copied from the KV cache or a
load checked (header, length, digest), so a cached chunk is never wrong KV.

The store stays the source of truth for hits: the scheduler offers what its
lookup finds in the store, and the tier only saves the read. A chunk the
store lost is not offered even if a slot still holds it; a chunk whose store
write failed (or was skipped while the store is backed off from) is never
kept (``async_save.py`` publishes a slot only after its write): it could not
be offered, and during an outage it would push out chunks that can. Each
worker (TP rank) has its own tier: its keys are its own rank's.

Slots in use (being copied, read or written) are pinned and never reused.
Thread-safe: the save thread, the reading threads, the step and the
asynchronous load thread share it. ``reserve`` waits for a slot only for a
caller that holds none (two holders waiting for each other's slots would
wait forever), and no batch takes more than a quarter of the slots, so a
load and a save always both move.
"""

from __future__ import annotations

import collections
import operator
import threading
from collections import deque
from collections.abc import Sequence
from typing import cast

import torch

from kvlc_store.transfer import bytes_view


class HostTier:
    """``capacity_bytes`` of host memory as slots of one chunk's payload.

    Args:
        capacity_bytes: host memory for the slots (at least 8 slots).
        block_bytes: one chunk's payload, a block of every layer.
        pin: page-lock the memory (a KV cache on CUDA).
        cache: keep chunks in their slots after use (``host_tier`` set);
            without it the slots are only the transfers' staging.
    """

    def __init__(
        self, capacity_bytes: int, block_bytes: int, pin: bool, cache: bool
    ) -> None:
        self.block_bytes = block_bytes
        self.capacity = max(8, capacity_bytes // block_bytes)
        self.max_batch = self.capacity // 4
        self.cache = cache
        self.buffer = torch.empty(
            self.capacity * block_bytes, dtype=torch.uint8, pin_memory=pin
        )
        self._base = self.buffer.data_ptr()
        self._bytes = bytes_view(self.buffer)
        # key -> slot, least recently used first; and back.
        self._slots: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._keys: dict[int, str] = {}
        self._pins: collections.Counter[int] = collections.Counter()
        self._free = list(range(self.capacity - 1, -1, -1))
        self._cond = threading.Condition()

    @property
    def nbytes(self) -> int:
        return self.capacity * self.block_bytes

    def addr(self, slot: int) -> int:
        """The address of slot ``slot``'s first byte."""
        return self._base + slot * self.block_bytes

    def addrs(self, slots: Sequence[int]) -> list[int]:
        """``addr`` of each of ``slots``."""
        base, size = self._base, self.block_bytes
        return [base + slot * size for slot in slots]

    def view(self, slot: int) -> memoryview:
        """Slot ``slot``'s bytes, writable."""
        return self._bytes[slot * self.block_bytes : (slot + 1) * self.block_bytes]

    def __len__(self) -> int:
        """Chunks held."""
        with self._cond:
            return len(self._slots)

    def pin_cached(self, keys: Sequence[str]) -> list[int | None]:
        """The slot holding each of ``keys``, pinned and made the most
        recently used; None for a key not held."""
        slots = self._slots
        with self._cond:
            found = list(map(slots.get, keys))
            held: Sequence[str]
            if None in found:
                held = [
                    key
                    for key, slot in zip(keys, found, strict=True)
                    if slot is not None
                ]
                pinned = [slot for slot in found if slot is not None]
            else:
                held, pinned = keys, cast("list[int]", found)
            # In C: a hot 32k-token hit pins 2,048 slots before its copy.
            deque(map(slots.move_to_end, held), maxlen=0)
            self._pins.update(pinned)
        return found

    def reserve(self, want: int, wait: bool) -> list[int]:
        """Up to ``want`` (and ``max_batch``) slots for new chunks, pinned:
        free ones first, then the least recently used cached ones that are
        not pinned (their chunks dropped). Fewer if fewer are free; if none
        is, waits for one when ``wait`` (the caller holds no slot), else
        returns none."""
        want = min(want, self.max_batch)
        with self._cond:
            while True:
                slots = self._take(want)
                if slots or not wait or want <= 0:
                    return slots
                self._cond.wait()

    def _take(self, want: int) -> list[int]:
        slots: list[int] = []
        while self._free and len(slots) < want:
            slots.append(self._free.pop())
        victims: list[tuple[str, int]] = []
        if len(slots) < want:
            for key, slot in self._slots.items():
                if len(slots) + len(victims) == want:
                    break
                if not self._pins[slot]:
                    victims.append((key, slot))
        for key, slot in victims:
            del self._slots[key]
            del self._keys[slot]
            slots.append(slot)
        for slot in slots:
            self._pins[slot] += 1
        return slots

    def publish(self, key: str, slot: int) -> None:
        """Slot ``slot`` (pinned by the caller) holds ``key``'s chunk, copied
        from the KV cache or checked: a later ``pin_cached`` finds it there.
        Without ``cache``, nothing is kept."""
        if not self.cache:
            return
        with self._cond:
            old = self._slots.pop(key, None)
            if old is not None and old != slot:
                del self._keys[old]
                if not self._pins[old]:
                    self._free.append(old)
            self._slots[key] = slot
            self._keys[slot] = key

    def unpin(self, slots: Sequence[int]) -> None:
        """Slots the caller is done with; one not holding a chunk is free."""
        pins = self._pins
        # In C, no Python per slot: a hot 32k-token hit unpins 2,048 slots.
        # Zero counts stay (Counter's __delitem__ is Python code).
        unpins = collections.Counter(slots)
        with self._cond:
            left = map(operator.sub, map(pins.__getitem__, unpins), unpins.values())
            dict.update(pins, zip(unpins, left, strict=False))
            # A slot is free once unpinned and holding no chunk; a hot hit's
            # slots all hold one, so none is looked at one by one.
            for slot in unpins.keys() - self._keys.keys():
                if pins[slot] <= 0:
                    self._free.append(slot)
            self._cond.notify_all()

"""What a process knows of a directory store's chunks without looking at
them, and the record of checked chunk headers every process shares.

Both hold while no chunk leaves the store. Every deletion by a backend (an
eviction, a damaged chunk deleted, a chunk found missing, a layout
recreated) writes a new token to the store's ``generation`` file under the
store's lock; a process that reads another token than the one its knowledge
was gathered under forgets it.

The record (``checked/<boot id>-<generation>``) lists chunks whose headers a
server checked (a lookup that read them) or wrote itself (a save), with the
KV layout the header names, one ``<key> <layout>`` line each. A line is
appended under the lock, only for a chunk this process knows stored under
the current generation, so a chunk in the record is stored and whole with a
good header as long as the record's generation is the store's: a first
lookup of a 32k-token prompt (a restart, another server's chunks) reads one
file instead of 2,048 headers. A chunk file is written under a temporary
name, renamed into place and never rewritten, so its header changes only by
hand or by a crash of the machine: the record is per boot (a chunk renamed
into place before a power loss may be empty after it, the record not), and
a chunk edited or removed by hand is found at load (see the connector's
README).
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

from kvlc_store.backends.chunk_files import FileTrust

# Chunks a process remembers as stored before it starts over: ~100 bytes
# each, 2,048 per 32k-token prompt of TP 1.
KNOWN_CHUNKS = 1 << 19

# Where the shared record stops growing (about 120,000 chunks: 58 prompts of
# 32k tokens): the chunks past it are checked by each process once.
RECORD_BYTES = 16 << 20

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def _boot_id() -> str | None:
    """This boot of the machine (Linux); None where it is not told: no
    record is written or read then."""
    try:
        return _BOOT_ID.read_text().strip() or None
    except OSError:
        return None


class KnownChunks:
    """A process's knowledge of one directory store's chunks.

    Args:
        root: the store.
        create: opens a new file of the store with the store's mode.
        trust: who may have written the store's files (the record's
            owner is checked like a chunk's).
    """

    def __init__(
        self, root: Path, create: Callable[[Path, int], int], trust: FileTrust
    ) -> None:
        self._generation_path = root / "generation"
        self.record_dir = root / "checked"
        self._create = create
        self._trust = trust
        self._boot = _boot_id()
        # Chunks seen stored (written, leased, in the record) since the
        # store's generation was last ``_at``.
        self.stored: set[str] = set()
        # Of those, the ones whose headers are known good: key -> KV layout.
        self.checked: dict[str, str] = {}
        self._at: str | None = None
        # How far the record was read.
        self._record_read = 0

    def generation(self) -> str | None:
        """The store's generation token; None if it has none (yet)."""
        try:
            with open(self._generation_path, "rb") as f:
                return f.read(64).decode(errors="replace").strip() or None
        except FileNotFoundError:
            return None

    def new_generation(self) -> None:
        """A chunk left the store: every process forgets what it knew
        stored, and the record starts over. The caller holds the lock."""
        tmp = self._generation_path.with_suffix(f".{os.getpid()}")
        fd = self._create(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with os.fdopen(fd, "w") as f:
            f.write(uuid.uuid4().hex)
        os.replace(tmp, self._generation_path)
        self.remove_records()

    def remove_records(self, keep_this_boot: bool = False) -> None:
        """Remove the record files (of other boots only, with
        ``keep_this_boot``)."""
        with contextlib.suppress(FileNotFoundError):
            for path in self.record_dir.iterdir():
                if keep_this_boot and path.name.startswith(f"{self._boot}-"):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def current(self, learn: bool = True) -> bool:
        """Forget what is known if a chunk left the store since it was
        learnt, then (``learn``) learn what the record added since it was
        last read; whether chunks can be known now (the store has a
        generation)."""
        generation = self.generation()
        if (
            generation is None
            or generation != self._at
            or len(self.stored) > KNOWN_CHUNKS
        ):
            self.stored.clear()
            self.checked.clear()
            self._at = generation
            self._record_read = 0
        if generation is None:
            return False
        if learn:
            self._read_record()
        return True

    def _record(self) -> Path | None:
        if self._boot is None or self._at is None:
            return None
        return self.record_dir / f"{self._boot}-{self._at}"

    def _read_record(self) -> None:
        path = self._record()
        if path is None or self._record_read >= RECORD_BYTES:
            return
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            self._trust.trusted(path, os.lstat(path), "record of checked chunks")
            return
        try:
            st = os.fstat(fd)
            if st.st_size <= self._record_read or not self._trust.trusted(
                path, st, "record of checked chunks"
            ):
                return
            end = min(st.st_size, RECORD_BYTES)
            data = os.pread(fd, end - self._record_read, self._record_read)
        finally:
            os.close(fd)
        # A line is whole once its newline is there (an append may be torn
        # by a full disk: what follows the tear is a key nothing looks up).
        data = data[: data.rfind(b"\n") + 1]
        self._record_read += len(data)
        for line in data.decode(errors="replace").splitlines():
            key, _, layout = line.partition(" ")
            if key:
                self.stored.add(key)
                self.checked[key] = layout

    def vouch(self, headers: Mapping[str, str]) -> None:
        """Add the chunks of ``headers`` (key -> the KV layout its good
        header names) to the record, those this process knows stored under
        the current generation. The caller holds the lock."""
        # Not learning the record here: a worker never reads it.
        if not self.current(learn=False):
            return
        path = self._record()
        new = {
            key: layout
            for key, layout in headers.items()
            if key in self.stored and self.checked.get(key) != layout
        }
        if path is None or not new:
            return
        fd = self._create(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW)
        try:
            if os.fstat(fd).st_size >= RECORD_BYTES:
                return
            os.write(fd, "".join(f"{k} {v}\n" for k, v in new.items()).encode())
        finally:
            os.close(fd)
        self.checked.update(new)

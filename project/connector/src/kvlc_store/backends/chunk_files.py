"""How a directory store's files are read without trusting what is there:
chunk files opened without following links or blocking, and refused unless
a user this store trusts wrote them."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

from kvlc_store.backends.base import Head, logger

# Buffers per writev/preadv call (Linux's IOV_MAX is 1024).
IOV_MAX = 512

# What a chunk file that is not one is called in the log.
_FILE_KINDS = {
    stat.S_IFLNK: "symbolic link",
    stat.S_IFIFO: "FIFO",
    stat.S_IFSOCK: "socket",
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
    stat.S_IFDIR: "directory",
}

# How a chunk file is opened: never through a symbolic link (one to a chunk
# outside the store would be served; one to a FIFO would block the reader
# until something writes it), and without blocking (a FIFO planted under a
# chunk's name opens at once and is refused by its type).
_OPEN_CHUNK = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK

Trusted = Callable[[str | Path, os.stat_result], bool]


def open_chunk_file(
    path: str | Path, trusted: Trusted | None = None
) -> tuple[int, os.stat_result] | None:
    """Open the chunk file at ``path`` for reading: its descriptor and
    stat, or None if there is no such file, it is not a regular file (a
    symbolic link, a FIFO, a device: refused through ``trusted``, which
    tells why), or ``trusted`` refuses it (by its owner and mode). Other
    ``OSError`` as raised. The caller closes the descriptor."""
    try:
        fd = os.open(path, _OPEN_CHUNK)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        # O_NOFOLLOW met a symbolic link: refused by its own stat.
        if trusted is not None:
            trusted(path, os.lstat(path))
        return None
    try:
        st = os.fstat(fd)
        if (trusted is not None and not trusted(path, st)) or not stat.S_ISREG(
            st.st_mode
        ):
            os.close(fd)
            return None
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_chunk_file(
    path: str | Path,
    head_bytes: int,
    into: Sequence[memoryview],
    trusted: Trusted | None = None,
) -> Head | None:
    """Read the chunk file at ``path``: its first ``head_bytes`` bytes, and
    the rest straight into ``into`` when the lengths match (``read_into``'s
    contract). None if there is no such file, or it is refused
    (``open_chunk_file``); other ``OSError`` as raised.

    Chunk files are written to a temporary name and renamed into place,
    never rewritten, so a short read is a file system failing.
    """
    opened = open_chunk_file(path, trusted)
    if opened is None:
        return None
    fd, st = opened
    try:
        size = st.st_size
        head = os.pread(fd, head_bytes, 0)
        if size == head_bytes + sum(t.nbytes for t in into):
            offset = head_bytes
            for i in range(0, len(into), IOV_MAX):
                batch = into[i : i + IOV_MAX]
                n = os.preadv(fd, batch, offset)
                if n != sum(t.nbytes for t in batch):
                    raise OSError(f"short read of {path} ({n} bytes)")
                offset += n
    finally:
        os.close(fd)
    return head, size


class FileTrust:
    """Who may have written a store's files: this user; in a store this one
    only reads (one another user prebuilt), its owner; with
    ``group_access``, the store's group. Never the owner of a store this one
    writes: a user who made the directory a root server was pointed at could
    have put any KV in it (``parse_config`` refuses such a store; this keeps
    its files out if the check was skipped)."""

    def __init__(
        self, root_stat: os.stat_result, read_only: bool, group_access: bool
    ) -> None:
        self.group_access = group_access
        self.uids = {os.geteuid()}
        if read_only:
            self.uids.add(root_stat.st_uid)
        self._gid = root_stat.st_gid
        self._told: set[str] = set()

    def trusted(
        self, path: str | Path, st: os.stat_result, what: str = "chunk file"
    ) -> bool:
        """Whether the file ``path`` (``st``: its stat, or its lstat for a
        symbolic link) is one this store wrote: a regular file, owned by a
        trusted user and writable by no one else. Any other is refused with
        a warning, once per file: a user who could write there could have
        put any KV under the key."""
        if not stat.S_ISREG(st.st_mode):
            kind = _FILE_KINDS.get(stat.S_IFMT(st.st_mode), "special file")
            self._refuse(
                path,
                what,
                f"it is a {kind}, not a regular file this store wrote (chunks "
                "are read without following links)",
            )
            return False
        mine = st.st_uid in self.uids or (self.group_access and st.st_gid == self._gid)
        others = stat.S_IWOTH | (0 if self.group_access else stat.S_IWGRP)
        if mine and not st.st_mode & others:
            return True
        self._refuse(
            path,
            what,
            f"it belongs to uid {st.st_uid} (mode {stat.S_IMODE(st.st_mode):o}), "
            "not to this user"
            + (" or the store's group" if self.group_access else "")
            + ", or others may write it; another user may have written it",
        )
        return False

    def _refuse(self, path: str | Path, what: str, why: str) -> None:
        if str(path) in self._told:
            return
        self._told.add(str(path))
        logger.warning(
            "StoreConnector: %s %s is not served: %s. Remove it (a store "
            "shared by a group needs group_access: true)",
            what,
            path,
            why,
        )

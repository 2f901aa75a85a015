"""Whether a directory can hold a store this server may trust, checked by
``parse_config`` before the model loads: it can be created or written (or
holds a store to serve read-only) and holds nothing but a store, no other
user can write it or replace it (the path as given and as resolved: no
directory above it that others may write or own, no link another user
owns on the way), and no other user made it.

Each returns why not, as the fix to print, or None; none creates anything.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from kvlc_store.backends.directory import READ_ONLY_ERRNOS, is_store, is_store_entry


def check_directory(path: Path) -> str | None:
    """Why ``path`` cannot hold a store, or None. Creates nothing: an
    existing directory is probed with a temporary file (removed at once), a
    missing one through its nearest existing parent."""
    if path.exists() and not path.is_dir():
        return "exists and is not a directory; point it at a directory"
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory; point it at a directory"
    if probe == path:
        strangers = sorted(
            e.name for e in os.scandir(path) if not is_store_entry(e.name)
        )
        if strangers:
            shown = ", ".join(strangers[:3]) + (", ..." if len(strangers) > 3 else "")
            return (
                f"holds files that are not a store's ({shown}); point it at a new "
                "or empty directory, or at an existing store"
            )
    try:
        fd, name = tempfile.mkstemp(dir=probe, prefix=".kvlc-probe-")
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        if probe == path and e.errno in READ_ONLY_ERRNOS and is_store(path):
            return None  # A read-only store: served for hits, never written.
        return f"cannot create or write it ({e.strerror}); use a writable directory"
    return None


def check_private(path: Path, group_access: bool) -> str | None:
    """Why the store at ``path`` (its top directories, or the directories
    above it) lets other users write it, or None. A store others can write
    serves whatever they put there: KV of their choosing under a prompt's
    key. A directory above it that others can write (without the sticky
    bit, as /tmp has) lets them replace the store itself. Each entry is
    taken as it is (``lstat``): ``path`` may name links, and whoever may
    write the directory holding a link may point it elsewhere."""
    allowed = stat.S_IWOTH | (0 if group_access else stat.S_IWGRP)
    for probe in (path, *(path / d for d in ("chunks", "leases", "tmp", "checked"))):
        try:
            st = probe.lstat()
        except FileNotFoundError:
            continue
        except OSError:
            return None  # the writability check reports it
        if st.st_mode & allowed and not stat.S_ISLNK(st.st_mode):
            share = "others" if group_access else "its group or others"
            return (
                f"{probe} is writable by {share} (mode "
                f"{stat.S_IMODE(st.st_mode):o}), who could put any KV "
                f"there; chmod {'770' if group_access else '700'} it"
            )
    probe = path
    while probe.parent != probe:
        probe = probe.parent
        try:
            st = probe.lstat()
        except FileNotFoundError:
            continue
        except OSError:
            return None
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            if stat.S_ISLNK(st.st_mode):
                continue  # a link's own mode means nothing
            return (
                f"{probe}, above the store, is writable by every user (mode "
                f"{stat.S_IMODE(st.st_mode):o}), who could replace the store; "
                "chmod o-w it or put the store elsewhere"
            )
    return None


def check_path_owners(given: Path, path: Path) -> str | None:
    """Why a directory above the store, or a link on the way to it, belongs
    to another user who could swap the store, or None. ``given``: the path
    as configured (absolute, links kept); ``path``: it resolved.

    Every directory above the store must belong to root or this user (the
    owner of a store this user only reads too: its chunks are trusted
    anyway): whoever owns one may rename the store away and put theirs in
    its place. A link on the way that another user owns, in a directory
    others may write, is refused as the kernel's ``protected_symlinks``
    refuses it (the default is off, and a server started as root would
    follow it): that user chooses where the store is."""
    me = os.geteuid()
    allowed = {0, me}
    try:
        st = path.stat()
        if st.st_uid != me and not os.access(path, os.W_OK):
            allowed.add(st.st_uid)
    except OSError:
        pass
    probe = given
    while probe.parent != probe:
        try:
            st = probe.lstat()
            parent = probe.parent.stat()
        except OSError:
            probe = probe.parent
            continue
        if (
            stat.S_ISLNK(st.st_mode)
            and parent.st_mode & stat.S_IWOTH
            and st.st_uid not in (me, parent.st_uid)
        ):
            return (
                f"{probe} is a link of another user (uid {st.st_uid}) in a "
                "directory every user may write, who could point it anywhere; "
                f"give the store's own path ({path}) or a link of this user"
            )
        probe = probe.parent
    for probe in path.parents:
        try:
            owner = probe.stat().st_uid
        except OSError:
            continue
        if owner not in allowed:
            return (
                f"{probe}, above the store, belongs to another user (uid "
                f"{owner}), who could replace the store; put the store in a "
                "directory of this user or root"
            )
    return None


def check_owner(path: Path, group_access: bool) -> str | None:
    """Why the existing store at ``path`` belongs to someone this server
    must not take chunks from, or None. A store another user owns is served
    only if this user cannot write it (a store they prebuilt and share
    read-only; its owner's chunks are trusted then): a directory another
    user made where a server (root, say) was told to keep its store holds
    whatever they put there, checksums and all. With ``group_access`` the
    store's group must be one of this user's."""
    try:
        st = path.stat()
    except OSError:
        return None  # missing: created by this user
    if group_access:
        if st.st_gid in (os.getegid(), *os.getgroups()):
            return None
        return (
            f"its group (gid {st.st_gid}) is not one of this user's, and "
            "group_access trusts the chunks of that group; chgrp it to a "
            "group this user is in"
        )
    if st.st_uid == os.geteuid() or not os.access(path, os.W_OK):
        return None
    return (
        f"belongs to another user (uid {st.st_uid}), who could have put any "
        f"KV in it; a store of another user is served only read-only. Use a "
        f"directory of this user (uid {os.geteuid()}), or chown it if its "
        "content is trusted"
    )

"""Keep only the CUDA code one GPU architecture can run in a shared library.

A CUDA library built for many architectures carries, in its ``.nv_fatbin``
section, one fat binary per translation unit, each holding that unit's code
once per architecture: SASS (``elf``, runs only on its own major version)
and PTX (``ptx``, compiled by the driver for any newer GPU). vLLM's release
build targets sm_75 to sm_120, so a Hopper GPU (sm_90) uses about a quarter
of ``_C_stable_libtorch``'s 50 MB of device code.

:func:`keep_arch` rewrites each fat binary in place: the entries ``arch``
can run are kept, packed at its start, its size field shrunk to them, and
the bytes freed are zeroed (the file keeps its size and layout, so nothing
else in the ELF moves, and xz compresses the zeros away). What ``arch`` can
run, as the driver picks it: the SASS of ``arch`` itself (``sm_90`` and
``sm_90a`` both say 90); failing that, PTX of ``arch`` or older. A fat
binary with nothing ``arch`` can run is left as it is: its kernels fail on
that GPU either way, and a fat binary with no entries is a form no
toolchain writes.

The format (``fatbinary``'s, undocumented, as ``cuobjdump`` reads it): a
16-byte header (magic ``0xBA55ED50``, version, header size, size of the
entries), then entries, each a header (kind 1 PTX / 2 ELF at 0, header
size at 4, payload size at 8, arch at 28) and its payload.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from workbench.errors import WorkbenchError

FATBIN_MAGIC = 0xBA55ED50
SECTION = ".nv_fatbin"
PTX, ELF = 1, 2


@dataclass(frozen=True)
class Entry:
    offset: int
    kind: int
    arch: int
    size: int  # header and payload


@dataclass
class Pruned:
    """What :func:`keep_arch` did to one library, in bytes."""

    kept: int = 0
    zeroed: int = 0
    unusable: int = 0  # fat binaries with nothing the arch runs, left as they were


def section(data: bytes | bytearray, name: str) -> tuple[int, int] | None:
    """(file offset, size) of ELF64 section ``name``, or None."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise WorkbenchError("not a 64-bit ELF file")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def header(i: int) -> tuple[int, int, int]:
        base = shoff + i * shentsize
        (name_off,) = struct.unpack_from("<I", data, base)
        offset, size = struct.unpack_from("<QQ", data, base + 0x18)
        return name_off, offset, size

    _, strtab, _ = header(shstrndx)
    for i in range(shnum):
        name_off, offset, size = header(i)
        start = strtab + name_off
        if bytes(data[start : data.index(b"\0", start)]).decode() == name:
            return offset, size
    return None


def fat_binaries(data: bytes | bytearray) -> list[tuple[int, int, list[Entry]]]:
    """(offset, header size, entries) of every fat binary in ``.nv_fatbin``."""
    found = section(data, SECTION)
    if found is None:
        return []
    start, size = found
    out = []
    pos = start
    magic = struct.pack("<I", FATBIN_MAGIC)
    while (pos := data.find(magic, pos, start + size)) != -1:
        # Found between fat binaries (padding), never inside one: each is
        # stepped over whole by its sizes.
        _magic, _version, header_size, entries_size = struct.unpack_from(
            "<IHHQ", data, pos
        )
        entries = []
        e = pos + header_size
        end = e + entries_size
        while e < end:
            kind, _, ehead, payload = struct.unpack_from("<HHIQ", data, e)
            (arch,) = struct.unpack_from("<I", data, e + 28)
            entries.append(Entry(e, kind, arch, ehead + payload))
            e += ehead + payload
        if e != end:
            raise WorkbenchError(f"a fat binary at {pos:#x} overruns its size")
        out.append((pos, header_size, entries))
        pos = end
    return out


def runnable(entries: list[Entry], arch: int) -> list[Entry]:
    """The entries a GPU of ``arch`` can run, as the driver would pick them."""
    sass = [e for e in entries if e.kind == ELF and e.arch == arch]
    if sass:
        return sass
    return [e for e in entries if e.kind == PTX and e.arch <= arch]


def keep_arch(path: Path, arch: int) -> Pruned:
    """Rewrite the library at ``path`` to hold only what ``arch`` runs."""
    data = bytearray(path.read_bytes())
    result = Pruned()
    for pos, header_size, entries in fat_binaries(data):
        total = sum(e.size for e in entries)
        keep = runnable(entries, arch)
        if not keep:
            result.unusable += total
            continue
        blob = b"".join(bytes(data[e.offset : e.offset + e.size]) for e in keep)
        start = pos + header_size
        data[start : start + total] = blob + bytes(total - len(blob))
        struct.pack_into("<Q", data, pos + 8, len(blob))
        result.kept += len(blob)
        result.zeroed += total - len(blob)
    path.write_bytes(data)
    return result

"""The stored form of one chunk: a fixed-size header, then the payload.

A chunk holds the KV of one KV-cache block (``block_size`` tokens) for every
layer of one tensor-parallel rank, as raw bytes. Layout (format 4)::

    MAGIC (8 bytes) | header (JSON, space-padded to HEADER_BYTES) | payload

The header names the format version, the store identity (model and KV
cache spec, see ``store_identity``), the worker's KV layout (the byte order
of a block in its KV tensors, ``BlockLayout.digest``), the chunk's key, the
payload length and the payload's XXH3-64 digest.

The KV layout is in the header because the scheduler cannot compute it: it
depends on the attention backend a worker picked (its kernel block size and
the order of heads and tokens in a block). Two servers with the same model
and cache spec but another backend write the same tokens in another byte
order, which the digest cannot catch; a worker refuses such a chunk like a
damaged one, and the scheduler keys chunks by the layout its workers report
(``StoreCore.set_kv_layout``), so such servers do not even meet.

The header has a fixed size so that a reader can take it alone (a lookup
checks headers and lengths, never payloads) and read the payload straight
into the KV cache at a known offset (a load checks the digest once, there).

Why XXH3-64 (the ``xxhash`` package): the digest guards against corruption
and truncation, not against someone who can write the store, so it need not
be cryptographic; it must keep up with memory, since a hit digests every byte
it loads (48 MB for a 4k-token prompt of a 0.5B model). XXH3 runs at tens of
GB/s on one core (CRC-32 in zlib ran at 1-2 GB/s; CRC-32C runs at several
GB/s only where the CPU has a CRC instruction), and ``xxhash`` is a small,
maintained binding with wheels for every platform vLLM runs on.

Format 3 (no layout) and format 2 and older (``KVLCCHK1``: a length-prefixed
JSON header and CRC-32) are refused as a plain miss; they also live under
other keys (the store identity includes the format), so a server never even
looks them up.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import xxhash

MAGIC = b"KVLCCHK3"
FORMAT_VERSION = 4
# Magic plus the padded JSON header: the payload's offset in every chunk.
HEADER_BYTES = 512
_OLD_MAGICS = (b"KVLCCHK1",)


class ChunkError(Exception):
    """A stored chunk that must not be used (corrupt, truncated or foreign)."""


@dataclass(frozen=True)
class ChunkHeader:
    identity: str
    layout: str
    key: str
    payload_bytes: int
    digest: int


def checksum(parts: Iterable[Any]) -> int:
    """XXH3-64 of the concatenation of ``parts`` (bytes-like objects)."""
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return int(h.intdigest())


def encode_header(
    identity: str, key: str, payload_bytes: int, digest: int, layout: str = ""
) -> bytes:
    """The first ``HEADER_BYTES`` of the chunk ``key``, written by a worker
    of KV layout ``layout``."""
    body = json.dumps(
        {
            "version": FORMAT_VERSION,
            "identity": identity,
            "layout": layout,
            "key": key,
            "payload_bytes": payload_bytes,
            "xxh3_64": digest,
        },
        sort_keys=True,
    ).encode()
    room = HEADER_BYTES - len(MAGIC)
    if len(body) > room:
        raise ValueError(f"chunk header for key {key!r} exceeds {room} bytes")
    return MAGIC + body.ljust(room)


def parse_header(data: bytes | memoryview) -> ChunkHeader:
    """The header at the start of ``data`` (at least ``HEADER_BYTES``)."""
    view = memoryview(data)
    magic = bytes(view[: len(MAGIC)])
    if magic in _OLD_MAGICS:
        raise ChunkError(
            f"old chunk format ({magic.decode()}); format {FORMAT_VERSION} is read"
        )
    if magic != MAGIC:
        raise ChunkError("not a chunk (bad magic or truncated header)")
    if len(view) < HEADER_BYTES:
        raise ChunkError("truncated header")
    try:
        header = json.loads(bytes(view[len(MAGIC) : HEADER_BYTES]))
    except ValueError as e:
        raise ChunkError(f"unreadable header ({e})") from e
    if not isinstance(header, dict):
        raise ChunkError("unreadable header (not an object)")
    if header.get("version") != FORMAT_VERSION:
        raise ChunkError(f"unknown format version {header.get('version')!r}")
    try:
        return ChunkHeader(
            identity=str(header["identity"]),
            layout=str(header["layout"]),
            key=str(header["key"]),
            payload_bytes=int(header["payload_bytes"]),
            digest=int(header["xxh3_64"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ChunkError(f"unreadable header ({e!r})") from e


def check_header(
    data: bytes | memoryview,
    identity: str,
    key: str,
    chunk_bytes: int,
    layout: str | None = None,
) -> ChunkHeader:
    """The header of the chunk ``key`` whose first bytes are ``data`` and
    whose stored length is ``chunk_bytes``, if it is a chunk of store
    identity ``identity`` and whole, written under KV layout ``layout``
    (None: any); else ChunkError naming the first mismatch. The payload
    itself is not read (see ``check_payload``)."""
    header = parse_header(data)
    if header.identity != identity:
        raise ChunkError(
            f"foreign chunk (identity {header.identity!r}, expected {identity!r})"
        )
    if header.key != key:
        raise ChunkError(f"chunk holds key {header.key!r}, expected {key!r}")
    if header.payload_bytes != chunk_bytes - HEADER_BYTES:
        raise ChunkError(
            f"truncated payload ({chunk_bytes - HEADER_BYTES} bytes, header "
            f"says {header.payload_bytes})"
        )
    if layout is not None and header.layout != layout:
        raise ChunkError(
            f"written under KV layout {header.layout!r}, this worker's is "
            f"{layout!r}: another attention backend or kernel block size"
        )
    return header


def check_payload(header: ChunkHeader, parts: Iterable[Any]) -> None:
    """ChunkError unless ``parts``, concatenated, are the payload ``header``
    describes."""
    if checksum(parts) != header.digest:
        raise ChunkError("checksum mismatch")


def encode_chunk(
    identity: str, key: str, payload: bytes | memoryview, layout: str = ""
) -> bytes:
    """The whole chunk ``key`` holding ``payload``, as one bytes object."""
    header = encode_header(identity, key, len(payload), checksum([payload]), layout)
    return header + bytes(payload)


def decode_chunk(
    data: bytes | memoryview, identity: str, key: str, layout: str | None = None
) -> memoryview:
    """The payload of the whole chunk ``data``, checked like a load checks it
    (header, length, layout, digest); ChunkError naming the first mismatch."""
    header = check_header(data, identity, key, len(data), layout)
    payload = memoryview(data)[HEADER_BYTES:]
    check_payload(header, [payload])
    return payload


def read_header(data: bytes | memoryview) -> tuple[dict[str, object], int]:
    """The header of ``data`` as a dict, and the payload's offset."""
    header = parse_header(data)
    return {
        "version": FORMAT_VERSION,
        "identity": header.identity,
        "layout": header.layout,
        "key": header.key,
        "payload_bytes": header.payload_bytes,
        "xxh3_64": header.digest,
    }, HEADER_BYTES

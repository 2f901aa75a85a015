"""Where chunks live: one small interface (``base.py``), two implementations
(``directory.py``, with ``chunk_files.py`` and ``known_chunks.py``;
``redis.py``).

Keys are ``<identity>/<block hash hex>.<rank>`` strings made by the
connector; values are encoded chunks (see ``chunk.py``), opaque here.

Every backend is shared by several processes (the scheduler and the workers
of one server, and any number of servers pointed at the same store), so all
state that matters lives in the store itself:

* a size cap with LRU eviction: ``get`` counts as a use, ``put`` evicts the
  least recently used chunks that no open lease protects until the store is
  below ``LOW_WATERMARK`` of its cap;
* leases: ``lease`` takes, in one atomic step, a lease on the longest leading
  run of the given keys that exist, so eviction cannot remove them until
  ``release``; a lease expires on its own after its TTL (a server that died
  holding it cannot pin chunks forever).

A store that cannot be reached, or fails (a full disk, an I/O error, a
directory deleted or made read-only), raises ``BackendUnavailable`` and never
anything else; callers treat it as a miss (lookups, loads) or a skipped save.
"""

from kvlc_store.backends.base import (
    LOW_WATERMARK,
    Backend,
    BackendUnavailable,
    Data,
    Head,
    logger,
    new_lease_id,
)
from kvlc_store.backends.chunk_files import read_chunk_file
from kvlc_store.backends.directory import DirectoryBackend
from kvlc_store.backends.redis import RedisBackend

__all__ = [
    "LOW_WATERMARK",
    "Backend",
    "BackendUnavailable",
    "Data",
    "DirectoryBackend",
    "Head",
    "RedisBackend",
    "logger",
    "new_lease_id",
    "read_chunk_file",
]

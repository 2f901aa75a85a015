"""Which model a store's chunks belong to, independent of where it lives.

Two servers share chunks when their KV would be the same. For the model,
that is its content, not the path a server was given: one model directory
mounted at two paths, or named relative and absolute, is one model; two
checkpoints with the same architecture and different weights are two.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import xxhash
from vllm.logger import init_logger

logger = init_logger(f"vllm.{__name__}")

_READ_BYTES = 16 * 1024 * 1024

# Digests computed by this process, by the directory's files' stat: the
# scheduler side and the worker side of one process ask for the same model.
_DIGESTS: dict[tuple[object, ...], str] = {}


def model_identity(model: str, revision: str | None, model_id: str | None) -> str:
    """What names ``model`` (vLLM's ``--model``) in a store's identity:
    ``model_id`` when the user set one; for a local directory, a digest of
    its files (``directory_digest``); otherwise the hub id and revision."""
    if model_id is not None:
        return f"id:{model_id}"
    path = Path(model).expanduser()
    if path.is_dir():
        return f"files:{directory_digest(path)}"
    return f"hub:{model}@{revision or 'default'}"


def directory_digest(root: Path) -> str:
    """XXH3-128 over every file under ``root`` (symlinks followed, as the
    Hugging Face cache's snapshots need; hidden files and folders skipped:
    ``.cache``, ``.git``): its relative path, size and content, in path
    order. Reads the whole model once per process (the weights are in the
    page cache right after vLLM loaded them); ``model_id`` avoids it."""
    files = sorted((path.relative_to(root).as_posix(), path) for path in _files(root))
    stats = tuple((name, *_stat_key(path)) for name, path in files)
    cached = _DIGESTS.get(stats)
    if cached is not None:
        return cached
    start = time.monotonic()
    digest = xxhash.xxh3_128()
    total = 0
    for name, path in files:
        digest.update(f"{name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            while chunk := f.read(_READ_BYTES):
                digest.update(chunk)
                total += len(chunk)
    result = digest.hexdigest()
    _DIGESTS[stats] = result
    seconds = time.monotonic() - start
    if seconds > 5:
        logger.info(
            "StoreConnector: digested the model's %d files (%.1f GB) for the "
            "store's identity in %.0f s; set kv_connector_extra_config"
            "['model_id'] to name the model instead",
            len(files),
            total / 1e9,
            seconds,
        )
    return result


def _stat_key(path: Path) -> tuple[int, int, int, int]:
    st = path.stat()
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _files(root: Path) -> list[Path]:
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found += [
            Path(dirpath) / name
            for name in filenames
            if not name.startswith(".") and (Path(dirpath) / name).is_file()
        ]
    return found

"""The connector's settings, from ``kv_connector_extra_config``, validated once.

``parse_config`` checks every key and value (and that the store is usable: the
directory readable and writable or creatable, or a read-only store to serve
hits from; Redis answering) and raises one ``ValueError`` listing each
problem with the key it concerns and how to fix it. The check creates
nothing (the backend creates the directory when the connector starts), and
``check_vllm_config`` checks the settings that depend on the rest of vLLM's
configuration before any model loads.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import stat
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlc_store.store_checks import (
    check_directory,
    check_owner,
    check_path_owners,
    check_private,
)

PREFIX = "kv_connector_extra_config"

DEFAULT_CAPACITY = 8 * 1024**3
DEFAULT_LEASE_TTL_S = 60.0
DEFAULT_NAMESPACE = "kvlc"
DEFAULT_REDIS_TIMEOUT_S = 2.0
# Ranges of the numeric settings: a lease or a timeout past these is a
# mistake (and ``inf`` overflows the store's integer milliseconds); a store
# under MIN_CAPACITY cannot hold one chunk of any model.
MAX_LEASE_TTL_S = 86400.0
MAX_REDIS_TIMEOUT_S = 3600.0
MIN_CAPACITY = 64 * 1024
# Host memory for batched transfers of a KV cache on an accelerator: 64
# blocks of an 8B model's 2 MiB per batch, two batches in flight.
DEFAULT_PINNED_BUFFER = 256 * 1024**2
# The host tier of a GPU worker: a 32k-token prompt of an 8B model is 4 GiB
# of KV; LMCache keeps 5 GB of local CPU memory per worker by default.
DEFAULT_HOST_TIER = 4 * 1024**3

_KEYS = {
    "backend": "'directory' (default) or 'redis'",
    "path": "the store directory (directory backend; created if missing)",
    "redis_url": "redis://host:port/db (redis backend; no password in it: "
    "vLLM prints its arguments)",
    "redis_password_env": "the name of an environment variable holding the "
    "Redis password (redis backend)",
    "redis_password_file": "a file holding the Redis password on its first "
    "line (redis backend; readable by its owner only)",
    "group_access": "let the store directory's group read and write the store "
    "(true/false; default false: only this user)",
    "namespace": "prefix of every Redis key (redis backend)",
    "capacity": "store size cap, bytes or a size like '8GiB'",
    "lease_ttl_s": "seconds a lease lives if never released",
    "verify_on_lookup": "check chunk headers when offering them (true/false)",
    "redis_timeout_s": "Redis connect/read timeout in seconds",
    "scheduler_lookup": "look up prompts when scheduling (true/false; false "
    "leaves every hit to the workers' before_update_states)",
    "offload": "'eager' (default) or 'lazy' (needs bind_scheduler_context and "
    "prefix caching)",
    "offload_window_blocks": "lazy offload: how many blocks at the eviction end "
    "of the free queue to keep stored ('auto' or a number)",
    "prefetch_buffer": "shared memory for the chunks of waiting requests, "
    "fetched before they are scheduled (bytes or a size like '1GiB'; 0, the "
    "default, is off)",
    "load_async": "load hits beside the steps of other requests, as vLLM's "
    "asynchronous KV loads (true/false; default false)",
    "pinned_buffer": "pinned host memory for the batched transfers of a KV "
    "cache on a GPU (bytes or a size like '1GiB'; default 256MiB)",
    "host_tier": "pinned host memory per GPU worker that keeps recently saved "
    "and loaded chunks in front of the store (bytes or a size like '8GiB'; "
    "default 4GiB; 0 turns it off)",
    "model_id": "a name for the model in the store's identity, instead of a "
    "digest of the model directory's files (servers with the same name, "
    "dtype and KV layout share chunks)",
}

# Keys of kv_connector_extra_config that vLLM itself reads: allowed, ignored.
VLLM_KEYS = frozenset({"check_external_match_lifecycle"})

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


@dataclass(frozen=True)
class StoreConfig:
    backend: str
    path: Path | None
    redis_url: str | None
    namespace: str
    capacity_bytes: int
    lease_ttl_s: float
    verify_on_lookup: bool
    redis_timeout_s: float
    scheduler_lookup: bool
    offload: str
    # None: the blocks one step may allocate (see StoreConnector).
    offload_window_blocks: int | None
    prefetch_buffer_bytes: int = 0
    load_async: bool = False
    pinned_buffer_bytes: int = DEFAULT_PINNED_BUFFER
    host_tier_bytes: int = DEFAULT_HOST_TIER
    model_id: str | None = None
    redis_password_env: str | None = None
    redis_password_file: Path | None = None
    group_access: bool = False


class SecretInConfig(argparse.ArgumentTypeError):
    """A refused configuration that holds a secret (a password in
    ``redis_url``). Not a ``ValueError``: pydantic, which builds vLLM's
    ``KVTransferConfig``, would wrap one with the whole input in its message
    (password included); argparse prints this one's message alone."""


def redact_url(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***``."""
    try:
        parts = urllib.parse.urlsplit(url)
        password = parts.password
    except ValueError:
        return "<a URL that does not parse>"
    if not password:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def redis_password(config: StoreConfig) -> str | None:
    """The Redis password the configuration names, read now (an environment
    variable, or the first line of a file); None if it names none. Raises
    ``ValueError`` naming the setting if it cannot be read."""
    if config.redis_password_env is not None:
        value = os.environ.get(config.redis_password_env)
        if not value:
            raise ValueError(
                f"{PREFIX}['redis_password_env'] = "
                f"{config.redis_password_env!r}: that environment variable is "
                "not set or empty; export it in the server's environment"
            )
        return value
    if config.redis_password_file is not None:
        name = f"{PREFIX}['redis_password_file'] = {str(config.redis_password_file)!r}"
        try:
            with open(config.redis_password_file, "rb") as f:
                mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
                lines = f.read().decode().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(
                f"{name}: cannot read it ({e}); point it at a readable file"
            ) from None
        if mode & 0o077:
            # Another local user could read the password (and query the
            # store's Redis), or write one of their own.
            raise ValueError(
                f"{name}: other users may read or write it (mode {mode:o}); "
                "chmod 600 it"
            )
        if not lines or not lines[0].strip():
            raise ValueError(
                f"{name}: its first line is empty; write the password there"
            )
        return lines[0].strip()
    return None


def parse_size(value: object) -> int | None:
    """Bytes from an int or a string like '512MiB'; None if not a size."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m:
            unit = (m.group(2) or "b").lower()
            return int(float(m.group(1)) * _UNITS[unit])
    return None


def _positive_size(value: object) -> int | None:
    size = parse_size(value)
    return size if size is not None and size > 0 else None


def _size(value: object) -> int | None:
    size = parse_size(value)
    return size if size is not None and size >= 0 else None


def _one_of(*choices: str) -> Callable[[object], str | None]:
    def parse(value: object) -> str | None:
        return value if isinstance(value, str) and value in choices else None

    return parse


def _window(value: object) -> int | str | None:
    if value == "auto":
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def _bool(value: object) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return None


def _positive_float(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        f = float(value)
    except ValueError:
        return None
    return f if math.isfinite(f) and f > 0 else None


def _seconds(limit: float) -> Callable[[object], float | None]:
    def parse(value: object) -> float | None:
        f = _positive_float(value)
        return f if f is not None and f <= limit else None

    return parse


def _capacity(value: object) -> int | None:
    size = parse_size(value)
    return size if size is not None and size >= MIN_CAPACITY else None


def parse_config(extra: Mapping[str, Any], *, check_store: bool = True) -> StoreConfig:
    """Validate ``extra`` (the connector's ``kv_connector_extra_config``).

    With ``check_store`` the store itself is checked too: the directory can be
    created and written, Redis answers a PING.
    """
    problems: list[str] = []

    def bad(key: str, value: object, fix: str) -> None:
        problems.append(f"{PREFIX}[{key!r}] = {value!r}: {fix}")

    for key in extra:
        if key not in _KEYS and key not in VLLM_KEYS:
            close = difflib.get_close_matches(str(key), list(_KEYS), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            bad(
                str(key),
                extra[key],
                f"unknown key; {hint}known keys: {', '.join(sorted(_KEYS))}",
            )

    backend = extra.get("backend", "directory")
    if backend not in ("directory", "redis"):
        bad("backend", backend, "set it to 'directory' or 'redis'")

    def setting(
        key: str, default: Any, parse: Callable[[object], Any], fix: str
    ) -> Any:
        value = parse(extra.get(key, default))
        if value is None:
            bad(key, extra.get(key), fix)
            return default
        return value

    def seconds(limit: float) -> str:
        return f"set a positive number of seconds, at most {limit:g}"

    capacity = setting(
        "capacity",
        DEFAULT_CAPACITY,
        _capacity,
        "set a positive size in bytes or like '8GiB', at least 64KiB (a "
        "smaller store holds no chunk)",
    )
    ttl = setting(
        "lease_ttl_s",
        DEFAULT_LEASE_TTL_S,
        _seconds(MAX_LEASE_TTL_S),
        seconds(MAX_LEASE_TTL_S),
    )
    timeout = setting(
        "redis_timeout_s",
        DEFAULT_REDIS_TIMEOUT_S,
        _seconds(MAX_REDIS_TIMEOUT_S),
        seconds(MAX_REDIS_TIMEOUT_S),
    )
    group_access = setting("group_access", False, _bool, "set true or false")
    verify = setting("verify_on_lookup", True, _bool, "set true or false")
    scheduler_lookup = setting("scheduler_lookup", True, _bool, "set true or false")
    offload = setting(
        "offload",
        "eager",
        _one_of("eager", "lazy"),
        "set 'eager' (store every prompt block once computed) or 'lazy' (store "
        "cached blocks as they near eviction)",
    )
    window = setting(
        "offload_window_blocks",
        "auto",
        _window,
        "set a positive number of blocks, or 'auto'",
    )
    prefetch_buffer = setting(
        "prefetch_buffer",
        0,
        _size,
        "set a size in bytes or like '1GiB' (0 turns prefetch off)",
    )

    load_async = setting("load_async", False, _bool, "set true or false")
    pinned_buffer = setting(
        "pinned_buffer",
        DEFAULT_PINNED_BUFFER,
        _positive_size,
        "set a positive size in bytes or like '1GiB' (at least one KV-cache "
        "block: smaller is raised to one)",
    )

    host_tier = setting(
        "host_tier",
        DEFAULT_HOST_TIER,
        _size,
        "set a size in bytes or like '8GiB' (0 turns the host tier off)",
    )

    if load_async and not scheduler_lookup:
        bad(
            "load_async",
            extra.get("load_async"),
            "asynchronous loads are the scheduler's lookups, which "
            "scheduler_lookup = false turns off; set it to false or "
            "scheduler_lookup to true",
        )
    if load_async and prefetch_buffer:
        bad(
            "load_async",
            extra.get("load_async"),
            "a waiting request loads into its own blocks then, so the prefetch "
            "buffer would only copy it twice; set prefetch_buffer to 0 or "
            "load_async to false",
        )
    if prefetch_buffer and not scheduler_lookup:
        bad(
            "prefetch_buffer",
            extra.get("prefetch_buffer"),
            "prefetch serves the scheduler's lookups, which scheduler_lookup "
            "= false turns off; set it to 0 or scheduler_lookup to true",
        )

    model_id = extra.get("model_id")
    if model_id is not None and (not isinstance(model_id, str) or not model_id):
        bad("model_id", model_id, "set a non-empty name, or remove it")
        model_id = None

    namespace = extra.get("namespace", DEFAULT_NAMESPACE)
    if not isinstance(namespace, str) or not re.fullmatch(
        r"[A-Za-z0-9_.-]+", namespace
    ):
        bad("namespace", namespace, "use letters, digits, '_', '.', '-' only")
        namespace = DEFAULT_NAMESPACE

    path: Path | None = None
    redis_url: str | None = None
    secret = False
    password_env = extra.get("redis_password_env")
    password_file = extra.get("redis_password_file")
    for key, value in (
        ("redis_password_env", password_env),
        ("redis_password_file", password_file),
    ):
        if value is not None and (not isinstance(value, str) or not value):
            bad(key, value, "set a non-empty name, or remove it")
        elif value is not None and backend != "redis":
            bad(key, value, "remove it, or set backend 'redis'")
    if isinstance(password_env, str) and isinstance(password_file, str):
        bad(
            "redis_password_file",
            password_file,
            "set redis_password_env or redis_password_file, not both",
        )
    if backend == "directory":
        if "redis_url" in extra:
            raw_url = extra["redis_url"]
            if isinstance(raw_url, str) and redact_url(raw_url) != raw_url:
                secret = True
                raw_url = redact_url(raw_url)
            bad("redis_url", raw_url, "remove it, or set backend 'redis'")
        raw = extra.get("path")
        if not isinstance(raw, str) or not raw:
            bad("path", raw, "set the directory the store keeps its chunks in")
        else:
            given = Path(os.path.abspath(Path(raw).expanduser()))
            path = given.resolve()
            if check_store and not problems:
                problem = check_directory(path)
                if problem:
                    bad("path", raw, problem)
    elif backend == "redis":
        if "path" in extra:
            bad("path", extra["path"], "remove it, or set backend 'directory'")
        raw = extra.get("redis_url")
        if not isinstance(raw, str) or not raw.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            if isinstance(raw, str) and redact_url(raw) != raw:
                secret, raw = True, redact_url(raw)
            bad("redis_url", raw, "set a URL like 'redis://127.0.0.1:6379/0'")
        elif redact_url(raw) != raw:
            secret = True
            bad(
                "redis_url",
                redact_url(raw),
                "holds a password, which vLLM prints with its arguments and "
                "ps shows; remove it from the URL and name where to read it: "
                "redis_password_env (an environment variable) or "
                "redis_password_file (a file)",
            )
        else:
            redis_url = raw
    if backend == "directory" and path is not None and check_store and not problems:
        # The path as given and as resolved: a link on the way is replaced
        # by whoever may write the directory holding it.
        problem = (
            check_private(given, bool(group_access))
            or check_private(path, bool(group_access))
            or check_path_owners(given, path)
            or check_owner(path, bool(group_access))
        )
        if problem:
            bad("path", extra["path"], problem)

    config = StoreConfig(
        backend=str(backend),
        path=path,
        redis_url=redis_url,
        namespace=namespace,
        capacity_bytes=capacity,
        lease_ttl_s=ttl,
        verify_on_lookup=verify,
        redis_timeout_s=timeout,
        scheduler_lookup=scheduler_lookup,
        offload=offload,
        offload_window_blocks=None if window == "auto" else window,
        prefetch_buffer_bytes=prefetch_buffer,
        load_async=load_async,
        pinned_buffer_bytes=pinned_buffer,
        host_tier_bytes=host_tier,
        model_id=model_id,
        redis_password_env=password_env if isinstance(password_env, str) else None,
        redis_password_file=(
            Path(password_file).expanduser() if isinstance(password_file, str) else None
        ),
        group_access=bool(group_access),
    )
    if backend == "redis" and redis_url is not None and check_store and not problems:
        try:
            problem = _check_redis(config)
        except ValueError as e:  # the password cannot be read
            problems.append(str(e))
        else:
            if problem:
                bad("redis_url", redis_url, problem)
    if problems:
        message = "StoreConnector: invalid configuration:\n  " + "\n  ".join(problems)
        if secret:
            raise SecretInConfig(message)
        raise ValueError(message)
    return config


def check_vllm_config(config: StoreConfig, enable_prefix_caching: bool) -> None:
    """The settings that depend on the rest of vLLM's configuration; raises
    ``ValueError`` naming the setting and its fix. Called by the plugin once
    vLLM has built its whole configuration (before the engine starts) and by
    the connector."""
    if config.offload == "lazy" and not enable_prefix_caching:
        raise ValueError(
            f"StoreConnector: {PREFIX}['offload'] = 'lazy' stores blocks the "
            "prefix cache is about to evict, and prefix caching is off; drop "
            "--no-enable-prefix-caching or set it to 'eager'"
        )


# How long the startup check waits for Redis's PING, at least.
STARTUP_PING_TIMEOUT_S = 5.0


def _check_redis(config: StoreConfig) -> str | None:
    """Why the store's Redis cannot be used, or None: it must answer a PING,
    and accept us (the password; not in protected mode)."""
    try:
        import redis  # noqa: F401
    except ImportError:
        return "the 'redis' Python package is missing; pip install redis"
    from kvlc_store.backends import BackendUnavailable, RedisBackend

    assert config.redis_url is not None
    backend = RedisBackend(
        config.redis_url,
        config.namespace,
        1,
        # A Redis slow to answer once (a loaded host) is not a wrong URL; a
        # request still gives up after redis_timeout_s.
        timeout_s=max(config.redis_timeout_s, STARTUP_PING_TIMEOUT_S),
        password=redis_password(config),
    )
    try:
        backend.ping()
    except BackendUnavailable as e:
        if not backend.refused(e):
            return f"Redis does not answer ({e}); start redis-server or fix the URL"
        if "DENIED" in str(e):
            fix = (
                "Redis is in protected mode (no password, reached from another "
                "host); set a password on it (requirepass) and name it here with "
                "redis_password_env or redis_password_file"
            )
        elif isinstance(
            e.__cause__, redis.exceptions.AuthenticationError
        ) or "NOAUTH" in str(e):
            fix = (
                "check the password (redis_password_env or redis_password_file) "
                "and the user in the URL against Redis's requirepass or ACL"
            )
        else:
            fix = "fix the Redis server or the URL"
        return f"Redis refuses this connector ({e}); {fix}"
    finally:
        backend.close()
    return None

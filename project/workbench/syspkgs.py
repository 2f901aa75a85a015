"""The system packages a workbench command's peers need, checked first.

``project/ci/system-packages`` installs what is missing when it can, else it
stops with one line naming what to install. Every command that starts a peer
needing one runs it before it builds any environment: a missing library must
cost seconds, not the quarter of an hour the environments take (a fresh
machine's ``./wb bench --ttft`` once died at the Mooncake peer after that).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

SCRIPT = "project/ci/system-packages"

# What the peer a ``./wb bench --ttft`` system starts beside vLLM needs:
# Redis's server, and the Mooncake master links libibverbs.so.1. Its other
# systems (store-dir, lmcache) need no system package.
TTFT_SYSTEMS = {"store-redis": ("redis-server",), "mooncake": ("libibverbs1",)}
# Connectors whose own modules link a system library: the Mooncake store's
# Python bindings link libibverbs.so.1 too.
CONNECTORS = {
    "MooncakeStoreConnector": ("libibverbs1",),
    "MooncakeConnector": ("libibverbs1",),
}
_HELP = {"-h", "--help"}


def ensure(root: Path, who: str | None = None, packages: Sequence[str] = ()) -> bool:
    """Run the script for ``packages`` that ``who`` needs (neither: what the
    end-to-end tests need). True when they are all there, after installing
    what was missing; False when the script stopped, after its one line.
    """
    if who is not None and not packages:
        return True
    cmd = [str(root / SCRIPT)]
    if who is not None:
        cmd += ["--for", who, *packages]
    return subprocess.call(cmd) == 0


def for_ttft(argv: Sequence[str]) -> list[str]:
    """The packages ``./wb bench --ttft`` with ``argv`` needs: those of the
    systems it measures (``--systems``, by default every one of them)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--systems", nargs="+")
    p.add_argument("--from-json")
    args, _ = p.parse_known_args(argv)
    if _HELP & set(argv) or args.from_json:
        return []  # serves nothing
    packages: list[str] = []
    for system in args.systems or TTFT_SYSTEMS:
        packages += [p for p in TTFT_SYSTEMS.get(system, ()) if p not in packages]
    return packages


def for_demo(argv: Sequence[str]) -> list[str]:
    """The packages ``./wb demo`` with ``argv`` needs: its connector's. The
    demo starts no peer (a Redis store is the user's, named by its URL)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--kv-transfer-config")
    args, _ = p.parse_known_args(argv)
    if _HELP & set(argv) or not args.kv_transfer_config:
        return []
    try:
        config = json.loads(args.kv_transfer_config)
    except json.JSONDecodeError:
        return []  # the demo's own parser says what is wrong with it
    name = config.get("kv_connector") if isinstance(config, dict) else None
    return list(CONNECTORS.get(name, ())) if isinstance(name, str) else []

"""A new user's mistakes in the connector's settings, against ``vllm serve``:
each stops the server before any model loads, within seconds, with last
lines that name the setting and its fix, and creates no store directory.

The connector is named by name only (its plugin entry point registers it).
Nothing here starts an engine: the check runs while vLLM parses
``--kv-transfer-config`` in the API server process, so each run is forked from
one process that imported vLLM's CLI (``forked_cli.py``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO
from forked_cli import ForkedCli
from redis_server import free_port

sys.path.insert(0, str(REPO / "project" / "demo"))
import serve_demo  # noqa: E402
from make_model import make_model  # noqa: E402

# Far below an engine start (a minute or more on two cores), above a loaded
# machine's vLLM import.
FAIL_WITHIN_S = 300
LAST_LINES = 6


def serve(
    cli: ForkedCli, tmp_path: Path, kv: dict[str, Any], model: Path | None = None
) -> tuple[int, str, float]:
    """Run ``vllm serve`` (by default on a model directory that does not
    exist: the check must come first) and return its exit status, output
    and time."""
    model = model or tmp_path / "model"
    command = serve_demo.server_command(model, free_port(), kv)
    assert Path(command[0]).name == "vllm", command
    start = time.monotonic()
    status, output = cli.run(command[1:], serve_demo.server_env(), FAIL_WITHIN_S)
    return status, output, time.monotonic() - start


def kv_config(extra: dict[str, Any], name: str = "StoreConnector") -> dict[str, Any]:
    return {
        "kv_connector": name,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def unwritable(tmp_path: Path) -> str:
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        return str(locked / "store")
    # root writes through any mode bits; sysfs refuses everyone.
    return "/sys/kvlc-store"


CASES = {
    "missing path": (
        lambda store, tmp: {},
        "kv_connector_extra_config['path'] = None: set the directory",
    ),
    "path is a file": (
        lambda store, tmp: {"path": str(tmp / "a-file")},
        "exists and is not a directory; point it at a directory",
    ),
    "unwritable directory": (
        lambda store, tmp: {"path": unwritable(tmp)},
        "cannot create or write it (",
    ),
    "unknown key": (
        lambda store, tmp: {"path": store, "capasity": "1GiB"},
        "'capasity'] = '1GiB': unknown key; did you mean 'capacity'?",
    ),
    "bad size": (
        lambda store, tmp: {"path": store, "capacity": "lots"},
        "'capacity'] = 'lots': set a positive size in bytes or like '8GiB'",
    ),
    "bad seconds": (
        lambda store, tmp: {"path": store, "lease_ttl_s": -1},
        "'lease_ttl_s'] = -1: set a positive number of seconds",
    ),
    "redis where nothing listens": (
        lambda store, tmp: {
            "backend": "redis",
            "redis_url": f"redis://127.0.0.1:{free_port()}/0",
            "redis_timeout_s": 0.5,
        },
        "Redis does not answer (",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_setting_stops_the_server_at_once(
    forked_cli: ForkedCli, tmp_path: Path, case: str
):
    extra_of, expected = CASES[case]
    (tmp_path / "a-file").write_text("not a directory")
    store = tmp_path / "store"
    status, output, seconds = serve(
        forked_cli, tmp_path, kv_config(extra_of(str(store), tmp_path))
    )
    last = "\n".join(output.strip().splitlines()[-LAST_LINES:])
    assert status != 0
    assert expected in last, output[-3000:]
    assert "Traceback" not in output
    assert "Starting to load model" not in output
    assert not store.exists()
    print(f"{case}: exit {status} after {seconds:.1f} s; last lines:\n{last}")


def test_misspelled_class_names_the_package(forked_cli: ForkedCli, tmp_path: Path):
    kv = kv_config({"path": str(tmp_path / "store")}, name="StoreConector")
    status, output, _ = serve(forked_cli, tmp_path, kv)
    last = "\n".join(output.strip().splitlines()[-LAST_LINES:])
    assert status != 0
    assert (
        "'StoreConector' is not a connector of kvlc-store-connector "
        "(package kvlc_store); did you mean 'StoreConnector'?"
    ) in last, output[-3000:]
    assert not (tmp_path / "store").exists()


def test_setting_that_needs_another_engine_argument_stops_before_the_model(
    forked_cli: ForkedCli, tmp_path: Path
):
    """``offload: lazy`` needs prefix caching, which the served command
    turns off (``--no-enable-prefix-caching``): the check needs vLLM's whole
    configuration, so it runs on a real model, when vLLM assembles that
    configuration, and still stops the server before the model loads."""
    model = make_model(tmp_path / "real-model")
    store = tmp_path / "store"
    kv = kv_config({"path": str(store), "offload": "lazy"})
    status, output, seconds = serve(forked_cli, tmp_path, kv, model)
    last = "\n".join(output.strip().splitlines()[-LAST_LINES:])
    assert status != 0
    assert (
        "['offload'] = 'lazy' stores blocks the prefix cache is about to evict, "
        "and prefix caching is off; drop --no-enable-prefix-caching"
    ) in last, output[-3000:]
    assert "Starting to load model" not in output
    assert not store.exists()
    print(f"exit {status} after {seconds:.1f} s; last lines:\n{last}")

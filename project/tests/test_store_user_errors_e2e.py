"""A new user's mistakes in the connector's settings, against ``vllm serve``:
each stops the server before any model loads, within seconds, with last
lines that name the setting and its fix, and creates no store directory.

The connector is named by name only (its plugin entry point registers it).
Nothing here starts an engine: the check runs while vLLM parses
``--kv-transfer-config`` in the API server process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO
from redis_server import free_port

sys.path.insert(0, str(REPO / "project" / "demo"))
import serve_demo  # noqa: E402
from make_model import make_model  # noqa: E402

# Far below an engine start (a minute or more on two cores), above a loaded
# machine's vLLM import.
FAIL_WITHIN_S = 300
LAST_LINES = 6


def serve(
    tmp_path: Path, kv: dict[str, Any], model: Path | None = None
) -> tuple[int, str, float]:
    """Run ``vllm serve`` (by default on a model directory that does not
    exist: the check must come first) and return its exit status, output
    and time."""
    model = model or tmp_path / "model"
    command = serve_demo.server_command(model, free_port(), kv)
    start = time.monotonic()
    done = subprocess.run(
        command,
        env=serve_demo.server_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=FAIL_WITHIN_S,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr, time.monotonic() - start


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
    case: str, refused: dict[str, tuple[Path, Future[tuple[int, str, float]]]]
):
    extra_of, expected = CASES[case]
    tmp_path, served = refused[case]
    store = tmp_path / "store"
    status, output, seconds = served.result()
    last = "\n".join(output.strip().splitlines()[-LAST_LINES:])
    assert status != 0
    assert expected in last, output[-3000:]
    assert "Traceback" not in output
    assert "Starting to load model" not in output
    assert not store.exists()
    print(f"{case}: exit {status} after {seconds:.1f} s; last lines:\n{last}")


def test_misspelled_class_names_the_package(tmp_path: Path):
    kv = kv_config({"path": str(tmp_path / "store")}, name="StoreConector")
    status, output, _ = serve(tmp_path, kv)
    last = "\n".join(output.strip().splitlines()[-LAST_LINES:])
    assert status != 0
    assert (
        "'StoreConector' is not a connector of kvlc-store-connector "
        "(package kvlc_store); did you mean 'StoreConnector'?"
    ) in last, output[-3000:]
    assert not (tmp_path / "store").exists()


def test_setting_that_needs_another_engine_argument_stops_before_the_model(
    tmp_path: Path,
):
    """``offload: lazy`` needs prefix caching, which the served command
    turns off (``--no-enable-prefix-caching``): the check needs vLLM's whole
    configuration, so it runs on a real model, when vLLM assembles that
    configuration, and still stops the server before the model loads."""
    model = make_model(tmp_path / "real-model")
    store = tmp_path / "store"
    kv = kv_config({"path": str(store), "offload": "lazy"})
    status, output, seconds = serve(tmp_path, kv, model)
    last = "\n".join(output.strip().splitlines()[-LAST_LINES:])
    assert status != 0
    assert (
        "['offload'] = 'lazy' stores blocks the prefix cache is about to evict, "
        "and prefix caching is off; drop --no-enable-prefix-caching"
    ) in last, output[-3000:]
    assert "Starting to load model" not in output
    assert not store.exists()
    print(f"exit {status} after {seconds:.1f} s; last lines:\n{last}")


@pytest.fixture(scope="module")
def refused(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, tuple[Path, Future[tuple[int, str, float]]]]]:
    """Every case of ``CASES`` served, two at a time (each is mostly a vLLM
    import on one core): its own directory and its run."""
    runs = {}
    with ThreadPoolExecutor(2) as pool:
        for case, (extra_of, _) in CASES.items():
            tmp_path = tmp_path_factory.mktemp("bad-setting")
            (tmp_path / "a-file").write_text("not a directory")
            kv = kv_config(extra_of(str(tmp_path / "store"), tmp_path))
            runs[case] = (tmp_path, pool.submit(serve, tmp_path, kv))
        yield runs

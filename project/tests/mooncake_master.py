"""A throwaway ``mooncake_master`` (with its HTTP metadata server) on free
loopback ports, and the ``MOONCAKE_CONFIG_PATH`` file that points
``MooncakeStoreConnector`` at it: for the Mooncake end-to-end test and the
TTFT bench."""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

from redis_server import free_port, wait_port


@contextlib.contextmanager
def mooncake_master(master: Path | str, workdir: Path) -> Iterator[Path]:
    """Run the ``master`` binary until the block ends (its log in
    ``workdir``); yield the config file for ``MOONCAKE_CONFIG_PATH``."""
    workdir.mkdir(parents=True, exist_ok=True)
    http_port, rpc_port, metrics_port = (free_port() for _ in range(3))
    with (workdir / "mooncake_master.log").open("wb") as log:
        proc = subprocess.Popen(
            [
                str(master),
                "-enable_http_metadata_server=true",
                f"-http_metadata_server_port={http_port}",
                "-http_metadata_server_host=127.0.0.1",
                f"-rpc_port={rpc_port}",
                f"-metrics_port={metrics_port}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_port(rpc_port, proc, "mooncake_master", 30)
            wait_port(http_port, proc, "mooncake_master's metadata server", 30)
            config = workdir / "mooncake.json"
            config.write_text(
                json.dumps(
                    {
                        "metadata_server": f"http://127.0.0.1:{http_port}/metadata",
                        "master_server_address": f"127.0.0.1:{rpc_port}",
                        "protocol": "tcp",
                        "device_name": "",
                        "global_segment_size": "512MB",
                        "local_buffer_size": "128MB",
                    }
                )
            )
            yield config
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

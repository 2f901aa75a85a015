"""``vllm serve`` runs that stop before an engine starts, each forked from one
process that imported vLLM's command line once.

A run that a setting stops in the API server process is mostly the import of
vLLM (16 s of one core here; minutes on a loaded CI machine); eighteen such
runs were most of two test files' time. The child runs what the ``vllm``
console script runs, ``vllm.entrypoints.cli.main.main()``, with the case's
arguments and environment, its output going to a file as a subprocess's
would; its exit status is the script's. Runs that start an engine do not
belong here: vLLM's CPU platform spawns the engine's processes, which import
vLLM afresh anyway.

The parent runs this file as a script and talks JSON lines on its pipes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any


class ForkedCli:
    """A process that imported vLLM's CLI and forks a ``vllm`` run on request."""

    def __init__(self, env: dict[str, str]):
        self._process = subprocess.Popen(
            [sys.executable, __file__],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._process.stdout is not None
        ready = self._process.stdout.readline()
        if ready.strip() != "ready":
            self.close()
            raise RuntimeError(f"vLLM's CLI did not import: {ready!r}")

    def run(
        self, argv: list[str], env: dict[str, str], timeout: float
    ) -> tuple[int, str]:
        """Run ``vllm *argv`` under ``env``; its exit status and output
        (stdout and stderr together). A run past ``timeout`` is killed and
        reported as exit status -9."""
        assert self._process.stdin is not None and self._process.stdout is not None
        with tempfile.NamedTemporaryFile("r", prefix="kvlc-cli-") as output:
            request = {
                "argv": argv,
                "env": env,
                "timeout": timeout,
                "output": output.name,
            }
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
            answer = self._process.stdout.readline()
            if not answer:
                raise RuntimeError("the forking process ended")
            status: int = json.loads(answer)["status"]
            return status, output.read()

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def _child(request: dict[str, Any]) -> None:
    """In the forked child: become ``vllm *argv`` writing to the output file."""
    from vllm.entrypoints.cli.main import main

    fd = os.open(request["output"], os.O_WRONLY | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["vllm", *request["argv"]]
    status = 1
    try:
        result = main()
        status = 0 if result is None else int(result)
    except SystemExit as e:
        # As the interpreter reports sys.exit(): None is 0, a non-integer
        # is printed and is 1.
        if e.code is None:
            status = 0
        elif isinstance(e.code, int):
            status = e.code
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _wait(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -signal.SIGKILL
        time.sleep(0.05)


def _serve_requests() -> None:
    # What the console script's main() imports before it parses anything.
    import vllm.entrypoints.cli.main  # noqa: F401
    import vllm.entrypoints.cli.serve  # noqa: F401

    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        status = _wait(pid, request["timeout"])
        print(json.dumps({"status": status}), flush=True)


if __name__ == "__main__":
    # The script's folder holds test modules, not what `vllm` would import.
    del sys.path[0]
    _serve_requests()

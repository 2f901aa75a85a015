"""``vllm`` runs forked from one process that imported vLLM's command line
and API server once.

A ``vllm serve`` process is mostly the import of vLLM before it does
anything (16 s of one core here; minutes on a loaded CI machine). Runs that a
setting stops in the API server were most of two test files' time, and every
served engine paid it once more on top of its engine core's and worker's.
A forked child runs what the ``vllm`` console script runs,
``vllm.entrypoints.cli.main.main()``, with the case's arguments and
environment, in a session of its own (as ``start_new_session``), its output
going to a file as a subprocess's would; its exit status is the script's.
What the child does from there is what the script does: vLLM's CPU platform
spawns the engine core and the workers, which import vLLM afresh.

What differs from the script: ``/proc/<pid>/cmdline`` shows this file, not the
case's arguments (a test that reads it starts its server with ``Popen``), and
modules the parent imported were imported under the parent's environment
(``serve_demo.server_env()``); the case's ``PYTHONPATH`` is put in front of
``sys.path``, which the spawned processes inherit.

The parent runs this file as a script and talks JSON lines on its pipes; it
answers at once, so a server's ``poll()`` never waits behind another's run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


class ForkedProcess:
    """A forked ``vllm`` run, as much of ``subprocess.Popen`` as the tests
    and ``serve_demo.Server`` use."""

    def __init__(self, cli: ForkedCli, pid: int, args: list[str]):
        self._cli = cli
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._cli._ask({"op": "poll", "pid": self.pid})["status"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (status := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.05)
        return status

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkedCli:
    """A process that imported vLLM's CLI and forks ``vllm`` runs on request.
    Safe to use from several threads."""

    def __init__(self, env: dict[str, str]):
        self._lock = threading.Lock()
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

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self._process.stdin is not None and self._process.stdout is not None
        with self._lock:
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
            answer = self._process.stdout.readline()
        if not answer:
            raise RuntimeError("the forking process ended")
        reply: dict[str, Any] = json.loads(answer)
        return reply

    def start(
        self, argv: list[str], env: dict[str, str], output: Path
    ) -> ForkedProcess:
        """Start ``vllm *argv`` under ``env``, its stdout and stderr appended
        to ``output``."""
        request = {"op": "start", "argv": argv, "env": env, "output": str(output)}
        return ForkedProcess(self, self._ask(request)["pid"], ["vllm", *argv])

    def starter(
        self, command: list[str]
    ) -> Callable[[list[str], dict[str, str], Path], ForkedProcess] | None:
        """What ``serve_demo.Server`` starts ``command`` with: a fork if it is
        this environment's ``vllm serve`` with no wrapper (a namespace,
        another interpreter) in front, else None (a subprocess)."""
        script = str(Path(sys.executable).parent / "vllm")
        if command[:2] != [script, "serve"]:
            return None
        return lambda command, env, output: self.start(command[1:], env, output)

    def run(
        self, argv: list[str], env: dict[str, str], timeout: float
    ) -> tuple[int, str]:
        """Run ``vllm *argv`` under ``env``; its exit status and output
        (stdout and stderr together). A run past ``timeout`` is killed and
        reported as exit status -9."""
        with tempfile.NamedTemporaryFile("r", prefix="kvlc-cli-") as output:
            process = self.start(argv, env, Path(output.name))
            try:
                status = process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                status = process.wait()
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
    os.setsid()
    status = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        fd = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        extra = request["env"].get("PYTHONPATH", "").split(os.pathsep)
        sys.path[:0] = [p for p in extra if p and p not in sys.path]
        sys.argv = ["vllm", *request["argv"]]
        from vllm.entrypoints.cli.main import main

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


def _serve_requests() -> None:
    # What the console script's main() imports before it parses anything,
    # and what `vllm serve` imports next.
    import vllm.entrypoints.cli.main  # noqa: F401
    import vllm.entrypoints.cli.serve  # noqa: F401
    import vllm.entrypoints.openai.api_server  # noqa: F401

    ended: dict[int, int] = {}
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "start":
            pid = os.fork()
            if pid == 0:
                _child(request)
            answer: dict[str, Any] = {"pid": pid}
        else:
            pid = request["pid"]
            if pid not in ended:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    ended[pid] = os.waitstatus_to_exitcode(status)
            answer = {"status": ended.get(pid)}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    # The script's folder holds test modules, not what `vllm` would import.
    del sys.path[0]
    _serve_requests()

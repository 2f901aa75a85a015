"""``./wb conformance``: project/docs/conformance.md, the conformance kit's
table of every KV connector this CPU build runs, in one command.

The kit (project/conformance, ``vllm_kv_conformance``) runs in each
environment the workbench makes: ``.venv`` (the patched vLLM, the reference
connector, kvlc-aibrix, Mooncake), ``build/venv-unpatched`` (vLLM 0.32.0 as
released) and ``build/venv-lmcache`` (the patched vLLM with the real
``lmcache``), once per environment with all of that environment's connectors
(one import of vLLM each). The kit is not installed into the side
environments: it and the connector sources run from the checkout through
``PYTHONPATH``. Before each run this module starts what the configurations
need (a redis-server, a Mooncake master, on free loopback ports) and stops it
after, whatever happened. Each run writes JSON (the kit's ``--json``); the
kit's ``--merge`` makes the one Markdown file of all of them.

A connector that cannot run in an environment (a module missing there, a
server that did not start, a run that crashed) is still a row, with why, and
the command goes on. Every path written is relative to the repository root.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from workbench import devenv

OUT = Path("project/docs/conformance.md")
SCRATCH = Path("build/conformance")
KIT_SRC = "project/conformance/src"
STORE_SRC = "project/connector/src"
# Fixed prompts make the table comparable from run to run; the scratch stores
# and servers are new every run, so no earlier run can answer a miss.
SEED = 20261129
# One environment's run: an import of vLLM and some twenty engines.
RUN_TIMEOUT_S = 900
SERVER_TIMEOUT_S = 30
REDIS = "redis"
MOONCAKE = "mooncake"

SIMPLE_CPU_NA = (
    "SimpleCPUOffloadConnector turns itself off without local prefix caching "
    '("CPU offload requires prefix caching"), and the kit keeps local prefix '
    "caching off so that every hit it checks is the connector's: its scenarios "
    "would test nothing (its lifecycle is tested by upstream's "
    "tests/v1/simple_kv_offload, as the stack's entry simple-cpu-offload-lifecycle "
    "edits them)"
)
AIBRIX_UNPATCHED_NA = (
    "kvlc-aibrix serves AIBrix's cache on the stack's before_update_states "
    "hook, which vLLM 0.32.0 does not have"
)


@dataclass(frozen=True)
class Connector:
    """One row of the table: a kv-transfer-config and what it needs.

    ``config`` may hold the placeholders ``{scratch}`` (this environment's
    scratch directory) and ``{redis_url}``; ``env`` (the kit process's
    environment) may hold ``{scratch}`` and ``{mooncake_config}``.
    """

    label: str
    config: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    needs: frozenset[str] = frozenset()
    """Servers: ``REDIS``, ``MOONCAKE``."""
    modules: tuple[str, ...] = ()
    """Modules the environment must import (checked before the run)."""
    not_applicable: str | None = None
    """Why the connector is not run here (an N/A row), or None."""


@dataclass(frozen=True)
class Environment:
    """A Python environment and the connectors the kit runs in it."""

    key: str
    title: str
    make: Callable[[Path], Path]
    """Returns the environment's python (made if needed): devenv's ensure*."""
    pythonpath: tuple[str, ...]
    connectors: tuple[Connector, ...]
    connector_deps: bool = False
    """Whether the reference connector's dependencies are installed, where
    the environment lacks them, into a folder of the scratch directory put on
    ``PYTHONPATH`` (the unpatched vLLM's environment has vLLM's alone)."""
    tp2: tuple[str, ...] = ()
    """The labels of the connectors also served on two ranks (the kit's
    ``--tp2``: a minute of two cores each)."""


def _store(path: str, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "StoreConnector",
        "kv_connector_module_path": "kvlc_store",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"path": path, **extra},
    }


def _example(path: str) -> dict[str, Any]:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": path},
    }


def common_connectors(patched: bool) -> tuple[Connector, ...]:
    """The connectors of ``.venv`` (``patched``) and of the unpatched vLLM."""
    redis = _store("{scratch}/store-redis")
    redis["kv_connector_extra_config"] = {
        "backend": "redis",
        "redis_url": "{redis_url}",
    }
    multi = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [
                _store("{scratch}/multi-store"),
                _example("{scratch}/multi-example"),
            ]
        },
    }
    aibrix_env = {
        # As project/tests/test_aibrix_e2e.py: L1 on, every block to the SHFS
        # L2 synchronously, L2 read from one block on (these prompts are short).
        "AIBRIX_KV_CACHE_OL_L1_CACHE_ENABLED": "1",
        "AIBRIX_KV_CACHE_OL_L1_CACHE_CAPACITY_GB": "0.05",
        "AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND": "SHFS",
        "AIBRIX_KV_CACHE_OL_L2_CACHE_INGESTION_TYPE": "ALL",
        "AIBRIX_KV_CACHE_OL_DOUBLE_GET_THRESHOLD": "1",
        "AIBRIX_KV_CACHE_OL_SHFS_ROOT": "{scratch}/aibrix-l2",
    }
    return (
        Connector("StoreConnector (directory)", _store("{scratch}/store")),
        Connector(
            "StoreConnector (directory, load_async)",
            _store("{scratch}/store-async", load_async=True),
        ),
        Connector(
            "StoreConnector (Redis)",
            redis,
            needs=frozenset({REDIS}),
            modules=("redis",),
        ),
        Connector("ExampleConnector (legacy pair)", _example("{scratch}/example")),
        Connector("MultiConnector (StoreConnector, ExampleConnector)", multi),
        Connector(
            "SimpleCPUOffloadConnector",
            {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both"},
            not_applicable=SIMPLE_CPU_NA,
        ),
        Connector(
            "kvlc-aibrix (AIBrixHookConnector)",
            {
                "kv_connector": "AIBrixHookConnector",
                "kv_connector_module_path": "kvlc_aibrix",
                "kv_role": "kv_both",
            },
            env=aibrix_env,
            modules=("kvlc_aibrix", "aibrix_kvcache"),
            not_applicable=None if patched else AIBRIX_UNPATCHED_NA,
        ),
        Connector(
            "MooncakeStoreConnector",
            {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"},
            env={"MOONCAKE_CONFIG_PATH": "{mooncake_config}"},
            needs=frozenset({MOONCAKE}),
            modules=("mooncake.store",),
        ),
    )


LMCACHE = Connector(
    "LMCacheConnectorV1 (lmcache 0.5.6)",
    {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
    # As project/tests/lmcache_hma_driver.py: LMCache's local CPU backend, one
    # chunk per block of the kit's engine (128 tokens).
    env={
        "LMCACHE_LOCAL_CPU": "True",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "1",
        "LMCACHE_CHUNK_SIZE": "128",
        "LMCACHE_TRACK_USAGE": "false",
    },
    modules=("lmcache",),
)


def environments() -> tuple[Environment, ...]:
    """What ``./wb conformance`` runs, in the order of the document."""
    return (
        Environment(
            "patched",
            "Patched vLLM (.venv)",
            devenv.ensure,
            (KIT_SRC,),
            common_connectors(patched=True),
            # One scheduler-side connector, one whose hits the ranks agree on.
            tp2=("StoreConnector (directory)", "kvlc-aibrix (AIBrixHookConnector)"),
        ),
        Environment(
            "unpatched",
            "vLLM 0.32.0 as released (build/venv-unpatched)",
            devenv.ensure_unpatched,
            (KIT_SRC, STORE_SRC),
            common_connectors(patched=False),
            connector_deps=True,
        ),
        Environment(
            "lmcache",
            "Patched vLLM with lmcache (build/venv-lmcache)",
            devenv.ensure_lmcache,
            (KIT_SRC,),
            (LMCACHE,),
        ),
    )


# --- servers ---------------------------------------------------------------


class Process(Protocol):
    """What this module uses of ``subprocess.Popen`` (fakes in the tests)."""

    def poll(self) -> int | None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


Launch = Callable[[list[str], Path], Process]
Listening = Callable[[int], bool]


def _launch(argv: list[str], log: Path) -> Process:
    with log.open("ab") as out:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def stop(proc: Process) -> None:
    """Terminate ``proc``, kill it if it lingers, reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_server(
    argv: list[str],
    ports: list[int],
    log: Path,
    what: str,
    launch: Launch = _launch,
    listening: Listening = _listening,
    timeout: float = SERVER_TIMEOUT_S,
) -> Process:
    """Start ``argv`` and wait until it listens on every port of ``ports``;
    on any failure stop it and raise ``RuntimeError`` naming ``what``."""
    proc = launch(argv, log)
    deadline = time.monotonic() + timeout
    try:
        for port in ports:
            while not listening(port):
                if proc.poll() is not None:
                    raise RuntimeError(f"{what} exited with {proc.poll()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{what} did not listen on {port} in {timeout:g} s"
                    )
                time.sleep(0.1)
    except BaseException:
        stop(proc)
        raise
    return proc


@dataclass
class Services:
    """What the servers started for one environment offer its connectors:
    the placeholders' values, and why a server is missing."""

    values: dict[str, str] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    """Server (``REDIS``, ``MOONCAKE``) -> why it is not there."""


def mooncake_config(http_port: int, rpc_port: int) -> dict[str, str]:
    """``MOONCAKE_CONFIG_PATH``'s content for a master on loopback (as
    project/tests/mooncake_master.py writes it)."""
    return {
        "metadata_server": f"http://127.0.0.1:{http_port}/metadata",
        "master_server_address": f"127.0.0.1:{rpc_port}",
        "protocol": "tcp",
        "device_name": "",
        "global_segment_size": "512MB",
        "local_buffer_size": "128MB",
    }


@contextlib.contextmanager
def services(
    needs: set[str],
    workdir: Path,
    executables: dict[str, str | None],
    launch: Launch = _launch,
    listening: Listening = _listening,
    ports: Callable[[], int] = free_port,
) -> Iterator[Services]:
    """Start the servers of ``needs`` (``executables``: ``REDIS`` and
    ``MOONCAKE`` to their binaries, None where absent) for the block, stop
    every one started when it ends, however it ends. A server that cannot
    start is put in ``missing`` and the block still runs."""
    found = Services()
    started: list[Process] = []
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        if REDIS in needs:
            exe, port = executables.get(REDIS), ports()
            try:
                if exe is None:
                    raise RuntimeError(
                        "redis-server not found (apt-get install redis-server)"
                    )
                # Persistence off: a throwaway store.
                argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
                argv += ["--appendonly", "no", "--dir", str(workdir)]
                started.append(
                    start_server(
                        argv,
                        [port],
                        workdir / "redis.log",
                        "redis-server",
                        launch,
                        listening,
                    )  # fmt: skip
                )
                found.values["redis_url"] = f"redis://127.0.0.1:{port}/0"
            except (OSError, RuntimeError) as e:
                found.missing[REDIS] = str(e)
        if MOONCAKE in needs:
            exe = executables.get(MOONCAKE)
            http_port, rpc_port, metrics_port = ports(), ports(), ports()
            try:
                if exe is None:
                    raise RuntimeError("mooncake_master not found")
                argv = [
                    exe,
                    "-enable_http_metadata_server=true",
                    f"-http_metadata_server_port={http_port}",
                    "-http_metadata_server_host=127.0.0.1",
                    f"-rpc_port={rpc_port}",
                    f"-metrics_port={metrics_port}",
                ]
                started.append(
                    start_server(
                        argv,
                        [rpc_port, http_port],
                        workdir / "mooncake_master.log",
                        "mooncake_master",
                        launch,
                        listening,
                    )  # fmt: skip
                )
                config = workdir / "mooncake.json"
                config.write_text(json.dumps(mooncake_config(http_port, rpc_port)))
                found.values["mooncake_config"] = str(config)
            except (OSError, RuntimeError) as e:
                found.missing[MOONCAKE] = str(e)
        yield found
    finally:
        for proc in reversed(started):
            stop(proc)


def executables(root: Path, python: Path) -> dict[str, str | None]:
    """The servers' binaries: Mooncake's master beside the environment's
    python (the pip package installs it there) or ``.venv``'s or on PATH."""
    master = None
    venv_master = root / ".venv" / "bin" / "mooncake_master"
    for candidate in (python.parent / "mooncake_master", venv_master):
        if candidate.exists():
            master = str(candidate)
            break
    return {
        REDIS: shutil.which("redis-server"),
        MOONCAKE: master or shutil.which("mooncake_master"),
    }


# --- one environment's run -------------------------------------------------


def fill(value: Any, values: dict[str, str]) -> Any:
    """``value`` with every ``{name}`` of ``values`` replaced, in nested
    dicts, lists and strings."""
    if isinstance(value, str):
        for name, text in values.items():
            value = value.replace("{" + name + "}", text)
        return value
    if isinstance(value, dict):
        return {k: fill(v, values) for k, v in value.items()}
    if isinstance(value, list):
        return [fill(v, values) for v in value]
    return value


def not_run(connector: Connector, status: str, reason: str) -> dict[str, Any]:
    """An entry of a run (``report.run_record``) for a connector not run."""
    return {
        "label": connector.label,
        "config": connector.config,
        "not_run": {"status": status, "reason": reason},
    }


@dataclass
class Plan:
    """One environment's run: the connectors to give the kit, their process
    environment, and the entries of those that will not run."""

    run: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, dict[str, Any]] = field(default_factory=dict)


def plan(
    environment: Environment,
    importable: set[str],
    found: Services,
    scratch: Path,
    where: str,
) -> Plan:
    """Which connectors of ``environment`` run (and with what configuration)
    given the modules ``importable`` there and the servers ``found``;
    ``where`` names the environment in the reasons."""
    out = Plan()
    values = {"scratch": str(scratch), **found.values}
    for c in environment.connectors:
        missing = [m for m in c.modules if m not in importable]
        down = sorted(n for n in c.needs if n in found.missing)
        if c.not_applicable:
            out.skipped[c.label] = not_run(c, "N/A", c.not_applicable)
        elif missing:
            why = f"{', '.join(missing)} is not installed in {where}"
            out.skipped[c.label] = not_run(c, "N/A", why)
        elif down:
            why = "; ".join(found.missing[n] for n in down)
            out.skipped[c.label] = not_run(c, "FAIL", f"not run: {why}")
        else:
            out.run.append((c.label, fill(c.config, values)))
            out.env.update(fill(c.env, values))
    return out


def kit_argv(python: str, connectors: list[tuple[str, dict[str, Any]]],
             title: str, json_out: Path,
             tp2: tuple[str, ...] = ()) -> list[str]:  # fmt: skip
    """The kit's command line for one environment."""
    argv = [python, "-m", "vllm_kv_conformance.cli", "--seed", str(SEED)]
    argv += ["--title", title, "--json", str(json_out)]
    for label, config in connectors:
        argv += ["--label", label, "--kv-transfer-config", json.dumps(config)]
        if label in tp2:
            argv += ["--tp2", label]
    return argv


def shown(argv: list[str], env: dict[str, str]) -> str:
    """``env`` and ``argv`` as a shell command, a line per variable and
    per option."""
    line = "".join(f"{k}={shlex.quote(v)} \\\n" for k, v in sorted(env.items()))
    line += shlex.quote(argv[0])
    for arg in argv[1:]:
        if arg.startswith("--"):
            line += " \\\n    " + shlex.quote(arg)
        else:
            line += " " + shlex.quote(arg)
    return line


def merge_entries(
    environment: Environment, ran: list[dict[str, Any]], skipped: dict[str, Any]
) -> list[dict[str, Any]]:
    """The run's entries in ``environment``'s order of connectors: those the
    kit ran (``ran``) and those it did not (``skipped``)."""
    by_label = {e["label"]: e for e in ran} | skipped
    return [by_label[c.label] for c in environment.connectors if c.label in by_label]


def scrub(text: str, root: Path, home: Path) -> str:
    """``text`` with the checkout's and the home's absolute paths made
    relative (the table is committed: no machine's paths in it)."""
    return text.replace(f"{root}/", "").replace(str(root), ".").replace(str(home), "~")


def _stream(argv: list[str], env: dict[str, str], cwd: Path, log: Path,
            timeout: float) -> int:  # fmt: skip
    """Run ``argv``, its output to the terminal and ``log``; kill it after
    ``timeout`` seconds (then return 124)."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, text=True, start_new_session=True,
        )  # fmt: skip
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                print(line, end="", flush=True)
                out.write(line)
            rc = proc.wait()
        finally:
            timer.cancel()
            stop(proc)
    return 124 if rc == -9 else rc


def connector_requirements(root: Path) -> dict[str, str]:
    """Module -> requirement of the reference connector's dependencies, as
    its pyproject.toml pins them (``name==version``, the module's name)."""
    project = tomllib.loads((root / "project/connector/pyproject.toml").read_text())
    pins = project["project"]["dependencies"]
    return {pin.split("==")[0].strip(): pin for pin in pins}


def install_deps(python: Path, missing: list[str], target: Path) -> str | None:
    """Install ``missing`` (requirements) into ``target`` for ``PYTHONPATH``,
    not into the environment; None, or pip's last line when it failed."""
    res = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-deps",
         "--target", str(target), *missing],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if res.returncode == 0:
        return None
    return _last_line_of(res.stdout + res.stderr)


def _importable(python: Path, modules: set[str], root: Path) -> set[str]:
    """Which of ``modules`` the environment finds (without importing them:
    finding a submodule imports its package, no more)."""
    code = (
        "import importlib.util, json, sys\n"
        "ok = []\n"
        "for m in sys.argv[1:]:\n"
        "    try:\n"
        "        ok += [m] if importlib.util.find_spec(m) else []\n"
        "    except Exception:\n"
        "        pass\n"
        "print(json.dumps(ok))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([KIT_SRC, STORE_SRC]))
    res = subprocess.run(
        [str(python), "-c", code, *sorted(modules)],
        cwd=root, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    try:
        return set(json.loads(res.stdout.strip().splitlines()[-1]))
    except (IndexError, json.JSONDecodeError):
        return set()


def run_environment(root: Path, environment: Environment, make: bool) -> dict[str, Any]:
    """Run the kit in ``environment`` and return its run record (the kit's
    ``--json``, or one made here when the environment or the kit failed)."""
    from_kit: dict[str, Any] | None = None
    scratch = SCRATCH / environment.key
    shutil.rmtree(root / scratch, ignore_errors=True)
    (root / scratch).mkdir(parents=True)
    reason = ""
    try:
        python = environment.make(root) if make else _existing(root, environment)
    except Exception as e:  # noqa: BLE001 - reported as the environment's rows
        python, reason = None, f"environment not made: {type(e).__name__}: {e}"
    rel_python = str(python.relative_to(root)) if python else "?"
    title = environment.title
    if python is None:
        entries = [not_run(c, "FAIL", reason) for c in environment.connectors]
        return _record(root, title, "(not run)", entries)
    modules = {m for c in environment.connectors for m in c.modules}
    pythonpath = list(environment.pythonpath)
    if environment.connector_deps:
        wanted = connector_requirements(root)
        have = _importable(python, set(wanted), root)
        missing = [pin for module, pin in wanted.items() if module not in have]
        deps = scratch / "deps"
        failed = missing and install_deps(python, missing, root / deps)
        if failed:
            print(f"{environment.title}: {', '.join(missing)}: {failed}", flush=True)
        elif missing:
            pythonpath.append(str(deps))
    importable = _importable(python, modules, root)
    needs = {n for c in environment.connectors for n in c.needs}
    servers = root / scratch / "servers"
    with services(needs, servers, executables(root, python)) as found:
        p = plan(environment, importable, found, scratch, rel_python)
        json_out = scratch / "run.json"
        argv = kit_argv(rel_python, p.run, title, json_out, environment.tp2)
        kit_env = {"PYTHONPATH": os.pathsep.join(pythonpath), **p.env}
        command = shown(argv, kit_env)
        if p.run:
            print(f"== {title}\n$ {command}", flush=True)
            rc = _stream(argv, dict(os.environ, **kit_env), root,
                         root / scratch / "kit.log", RUN_TIMEOUT_S)  # fmt: skip
            if (root / json_out).is_file():
                from_kit = json.loads((root / json_out).read_text())
            else:
                reason = _last_line(root / scratch / "kit.log")
                reason = f"the kit exited with {rc} before writing its run: {reason}"
    ran = from_kit["entries"] if from_kit else []
    if p.run and from_kit is None:
        ran = [not_run(c, "FAIL", reason) for c in environment.connectors
               if c.label in dict(p.run)]  # fmt: skip
    record = from_kit or _record(root, title, command, [])
    record["command"] = command
    record["entries"] = merge_entries(environment, ran, p.skipped)
    return record


def _record(
    root: Path, title: str, command: str, entries: list[dict[str, Any]]
) -> dict[str, Any]:
    """A run record made here (the kit's ``report.run_record`` without
    importing the kit into the workbench)."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short=12", "HEAD"],
        cwd=root, capture_output=True, text=True, check=False,
    ).stdout.strip() or "unknown"  # fmt: skip
    return {
        "format": 1,
        "title": title,
        "command": command,
        "machine": "(not run)",
        "commit": commit,
        "entries": entries,
    }


def _last_line(log: Path) -> str:
    return _last_line_of(log.read_text())


def _last_line_of(text: str) -> str:
    lines = [s.strip() for s in text.splitlines() if s.strip()]
    return lines[-1] if lines else "no output"


def _existing(root: Path, environment: Environment) -> Path:
    """``--no-venv``: the environment's python as it is, made or not."""
    python = {
        "patched": root / ".venv" / "bin" / "python",
        "unpatched": root / "build" / devenv.UNPATCHED / "bin" / "python",
        "lmcache": root / "build" / devenv.LMCACHE_ENV / "bin" / "python",
    }[environment.key]
    if not python.exists():
        raise FileNotFoundError(f"{python.relative_to(root)} (./wb venv makes it)")
    return python


NOTES = (
    "Made by `./wb conformance` (project/workbench/conformance.py): the kit run "
    "once in each environment below with all of that environment's connectors, "
    "a redis-server and a mooncake_master started on loopback for the run and "
    "stopped after. Each scenario, what it checks and the contract text it comes "
    "from: project/conformance/README.md. A FAIL in a connector that is not this "
    "project's is a finding for that project, reported here, not hidden.",
    "Whose failures, as of this table: ExampleConnector's resumed-request load "
    "(after a preemption) reads a file named after the prompt and the generated "
    "tokens, which it never wrote (upstream's ExampleConnector). "
    "LMCacheConnectorV1 does not build in the kit's one process: vLLM 0.32.0's "
    "CPU platform rebinds its Triton kernels by walking every loaded module and "
    "takes each object's `__dict__` for a dict, which one of lmcache's objects "
    "is not (vLLM's bug, met only with lmcache imported in the engine's process; "
    "project/tests/test_lmcache_hma_real.py serves it with the worker in its own "
    "process, where LMCache 0.5.6 then finds no CPU connector and reports no hit).",
)
NO_VENV_NOTE = (
    "Run with `--no-venv`: .venv, build/venv-unpatched and build/venv-lmcache "
    "as they were (`./wb conformance` alone makes or updates them first)."
)


def main(root: Path, make: bool = True, out: Path = OUT) -> int:
    """``./wb conformance``: run every environment, write ``out``; 1 when a
    scenario failed or a connector could not run, as the kit exits."""
    started = time.monotonic()
    runs = []
    for environment in environments():
        record = run_environment(root, environment, make)
        text = scrub(json.dumps(record, indent=1), root, Path.home())
        path = root / SCRATCH / environment.key / "run-scrubbed.json"
        path.write_text(text + "\n")
        runs.append(path)
    command = "./wb conformance" + ("" if make else " --no-venv")
    argv = [sys.executable, "-m", "vllm_kv_conformance.cli", "--command", command]
    argv += ["--markdown", str(out)]
    for note in NOTES if make else (*NOTES, NO_VENV_NOTE):
        argv += ["--note", note]
    for path in runs:
        argv += ["--merge", str(path.relative_to(root))]
    env = dict(os.environ, PYTHONPATH=KIT_SRC)
    rc = subprocess.call(argv, cwd=root, env=env)
    text = (root / out).read_text()
    for marker in ("/work/", "/tmp/", "/root/", "/home/"):
        if marker in text:
            print(f"warning: {out} names an absolute path ({marker})", file=sys.stderr)
    print(f"./wb conformance: {time.monotonic() - started:.0f} s")
    return rc

"""The workbench's tool environments: pinned pre-commit and wheel (and the
benchmark's plotting library), one venv each per machine, in the cache.

They are made on first use, which can be inside pip's isolated build of
``pip install .`` (``build.py`` may need ``wheel``). pip's build environment
exports ``PYTHONPATH`` (a ``sitecustomize`` that puts the build environment's
packages on every child interpreter's path), ``PYTHONNOUSERSITE`` and its own
``PIP_*`` state: a child ``pip`` that inherits them sees the build
environment's packages as installed in the new venv and skips them (a fresh
machine once got a tools venv without ``packaging``). So the venv is made and
filled with a clean environment, and checked by importing what it must hold
(every time it is used, not trusted from a marker); a broken one is made
again. A file lock lets two processes make it at once.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from workbench import upstream
from workbench.errors import WorkbenchError

# Requirement -> the modules that must import from the venv. packaging is
# named because pre-commit's virtualenv imports it: without it pre-commit
# cannot make any hook environment.
TOOLS: Mapping[str, tuple[str, ...]] = {
    "pre-commit==4.7.0": ("pre_commit", "virtualenv"),
    "packaging==26.3": ("packaging",),
    "wheel==0.45.1": ("wheel.cli",),
}
# ./wb bench's driver only plots; the workloads run in the vLLM environments.
BENCH_TOOLS: Mapping[str, tuple[str, ...]] = {"matplotlib==3.11.2": ("matplotlib",)}

# What a build frontend exports to its backend and that must not reach a
# child interpreter or pip: pip's build environment and build tracker,
# pyproject-hooks' backend selection, and a foreign interpreter's home.
_FRONTEND_VARIABLES = (
    "PYTHONPATH",
    "PYTHONNOUSERSITE",
    "PYTHONHOME",
    "PYTHONSTARTUP",
    "PIP_BUILD_TRACKER",
    "PIP_REQ_TRACKER",
    "PIP_TARGET",
    "PIP_PREFIX",
    "PIP_ROOT",
    "PIP_USER",
    "PIP_NO_BUILD_ISOLATION",
    "_PYPROJECT_HOOKS_BUILD_BACKEND",
    "PEP517_BUILD_BACKEND",
    "VIRTUAL_ENV",
)


def clean_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) without the build frontend's
    variables, and ``PATH`` without pip's build environment's script folders.
    The user's own pip settings (index, proxy, certificates) stay.
    """
    env = dict(os.environ if environ is None else environ)
    for name in _FRONTEND_VARIABLES:
        env.pop(name, None)
    if "PATH" in env:
        env["PATH"] = os.pathsep.join(
            p for p in env["PATH"].split(os.pathsep) if "pip-build-env-" not in p
        )
    return env


def _base_python() -> str:
    """An interpreter to make venvs with: the one this venv was made from."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    return base if Path(base).exists() else sys.executable


def _missing(python: Path, packages: Mapping[str, tuple[str, ...]]) -> str | None:
    """None when ``python`` exists, runs and imports every module of
    ``packages`` at its pinned version; else what is wrong, in one line.
    """
    if not python.exists():
        return f"{python} does not exist"
    pins = {
        spec.split("==")[0]: spec.split("==")[1] for spec in packages if "==" in spec
    }
    modules = [m for mods in packages.values() for m in mods]
    probe = (
        "import importlib, importlib.metadata as md, sys\n"
        f"pins, modules = {pins!r}, {modules!r}\n"
        "for dist, want in pins.items():\n"
        "    have = md.version(dist)\n"
        "    if have != want:\n"
        "        sys.exit(f'{dist} is {have}, not {want}')\n"
        "for m in modules:\n"
        "    importlib.import_module(m)\n"
    )
    proc = subprocess.run(
        [str(python), "-c", probe],
        env=clean_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode == 0:
        return None
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit status {proc.returncode}"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if need be)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process to finish {path.stem}", flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(
        cmd, env=clean_env(), capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise WorkbenchError(
            f"{what} failed: {' '.join(cmd)}\n{(proc.stdout + proc.stderr)[-3000:]}"
        )


def tools_python(
    name: str = "tools", packages: Mapping[str, tuple[str, ...]] = TOOLS
) -> Path:
    """The python of the venv ``<cache>/<name>-venv`` holding ``packages``
    (requirement -> modules it provides), made or repaired on demand.

    Safe to call from a PEP 517 backend and from two processes at once.
    Raises ``WorkbenchError`` when the venv cannot be made to import them.
    """
    env_dir = upstream.cache_dir() / f"{name}-venv"
    python = env_dir / "bin" / "python"
    with _locked(upstream.cache_dir() / f"{name}-venv.lock"):
        problem = _missing(python, packages)
        if problem is None:
            return python
        if env_dir.exists():
            print(f"repairing {env_dir} ({problem})", flush=True)
            shutil.rmtree(env_dir)
        print(f"creating {env_dir} with {', '.join(packages)}", flush=True)
        _run([_base_python(), "-m", "venv", str(env_dir)], f"creating {env_dir}")
        _run(
            [str(python), "-m", "pip", "install", "--quiet", *packages],
            f"installing {', '.join(packages)} into {env_dir}",
        )
        problem = _missing(python, packages)
        if problem is not None:
            raise WorkbenchError(f"{env_dir} is still broken after install: {problem}")
    return python

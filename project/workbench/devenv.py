"""The project environment: ``.venv`` with the patched vLLM, from ``pip install .``.

``./wb demo`` and ``./wb test`` both start here. The install is redone only
when the stack or the build code changed since the last one, so running the
tests twice does not rebuild the wheel twice.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import queue
import shutil
import subprocess
import threading
import time
import venv
from collections.abc import Mapping
from pathlib import Path

from workbench import upstream
from workbench.errors import WorkbenchError

TEST_REQUIREMENTS = "project/requirements-test.txt"
# The Mooncake store the scheduler-context end-to-end test serves with.
MOONCAKE_REQUIREMENTS = "project/requirements-mooncake.txt"
# The reference connector, installed editable so its tests see edits at once.
CONNECTOR = "project/connector"
# AIBrix's offloading on the stack's hook, editable like the connector above;
# aibrix-kvcache itself goes in with --no-deps (its pins fight the project's).
AIBRIX = "project/aibrix"
AIBRIX_REQUIREMENTS = "project/aibrix/requirements-aibrix.txt"
# The conformance kit (its `vllm-kv-conformance` command), editable.
CONFORMANCE = "project/conformance"
# The workbench modules `pip install .` runs: a change to one rebuilds.
BUILD_MODULES = ("backend", "build", "gitutil", "stack", "tools", "upstream")


def _stack_digest(root: Path) -> str:
    """A digest of everything that goes into the patched wheel."""
    digest = hashlib.sha256()
    inputs = [root / "pyproject.toml", root / TEST_REQUIREMENTS]
    inputs += [root / MOONCAKE_REQUIREMENTS, root / CONNECTOR / "pyproject.toml"]
    inputs += [root / AIBRIX / "pyproject.toml", root / AIBRIX_REQUIREMENTS]
    inputs += [root / CONFORMANCE / "pyproject.toml"]
    inputs += [root / "project" / "workbench" / f"{m}.py" for m in BUILD_MODULES]
    for top in ("patches", "vllm"):
        inputs += sorted(
            p
            for p in (root / top).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        )
    for path in inputs:
        if path.exists():
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _run(cmd: list[str], what: str) -> None:
    print(f"$ {' '.join(cmd)}", flush=True)
    if subprocess.call(cmd) != 0:
        raise WorkbenchError(f"{what} failed (command above)")


# pip lines that say where an install is; the rest goes to the log only.
_PIP_PROGRESS = (
    "Collecting ",
    "Installing build dependencies",
    "Preparing metadata",
    "Building wheel",
    "Installing collected",
    "Successfully",
    "ERROR",
)
HEARTBEAT_S = 10
# Widest progress line shown; longer ones end at a word, with " ...".
LINE_CHARS = 160


def clip(text: str, limit: int = LINE_CHARS) -> str:
    """``text`` on one line of at most ``limit`` characters, cut at a space
    (never mid-word) with `` ...`` when it was longer."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit - 3)
    return (text[:cut] if cut > 0 else text[: limit - 4]) + " ..."


def pip_install(
    python: Path,
    args: list[str],
    what: str,
    log: Path,
    env: Mapping[str, str] | None = None,
) -> None:
    """``pip install args`` with its progress shown and its full output in
    ``log``: what it collects, builds and installs, and every ``HEARTBEAT_S``
    seconds without a progress line, a line with the time so far and pip's
    latest line if it is new (the patched build, which downloads and repacks
    the release wheel, is minutes of silence in pip).
    """
    # Python compiles a module's bytecode when a process first imports it;
    # pip would compile every file it installs, most never imported (21,780
    # in .venv, about 5 ms each here: 110 s of one core at every clean clone).
    cmd = [str(python), "-m", "pip", "install", "--progress-bar", "off"]
    cmd += ["--no-compile", *args]
    print(f"$ {' '.join(cmd)}", flush=True)
    print(f"  {what}; full pip output: {log}", flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    last_said = started
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=None if env is None else {**os.environ, **env},
        )
        assert proc.stdout is not None
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        latest = ""
        said = ""  # the latest line, as last shown
        while True:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                line = ""
            if line is None:
                break
            now = time.monotonic()
            if line:
                out.write(line)
                latest = line.strip() or latest
                if line.lstrip().startswith(_PIP_PROGRESS):
                    print(f"  {clip(line)}", flush=True)
                    last_said = now
                    said = latest
            if now - last_said >= HEARTBEAT_S:
                print(f"  {heartbeat(now - started, latest, said)}", flush=True)
                last_said = now
                said = latest
        status = proc.wait()
    if status != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise WorkbenchError(f"{what} failed (full output: {log}):\n{tail}")
    print(f"  done in {time.monotonic() - started:.0f} s", flush=True)


def share_files(env_dir: Path, root: Path) -> None:
    """Replace ``env_dir``'s files that ``.venv`` also holds, byte for byte,
    by hard links to ``.venv``'s, when util-linux's ``hardlink`` is there and
    both are on one file system. Called by whoever just installed into
    ``env_dir``. Each environment carries its own torch, triton and vLLM
    (3-4 GB); linked, the side environments and the release's add about
    1 GB each, which is what a CI runner's disk has room for.
    """
    main = root / ".venv"
    hardlink = shutil.which("hardlink")
    if hardlink is None or not main.is_dir():
        return
    # pip stamps the install time on every file, so times differ; ``.py``
    # files stay apart because a link would give them the other copy's
    # time, and Python would then recompile the environment's bytecode.
    cmd = [hardlink, "--ignore-time", "--respect-name", "--keep-oldest"]
    cmd += ["--exclude", r"\.py$", str(main), str(env_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    saved = [line for line in proc.stdout.splitlines() if line.startswith("Saved")]
    if proc.returncode != 0:
        # Only disk is at stake: say so and go on with the copies.
        why = clip(proc.stderr.strip() or f"exit {proc.returncode}")
        print(f"  {env_dir}: files not shared with {main} ({why})", flush=True)
    elif saved:
        detail = " ".join(saved[0].split()[1:])
        print(f"  {env_dir}: files identical to {main}'s linked, {detail} saved")


def heartbeat(seconds: float, latest: str, said: str) -> str:
    """The line saying pip is still at work after ``seconds``: with its
    ``latest`` line if that is not what was shown last (``said``)."""
    line = f"... {seconds:.0f} s, pip still working"
    if latest and latest != said:
        return line + ": " + clip(latest, LINE_CHARS - len(line) - 2)
    return line + " (no new output)"


def is_current(root: Path) -> bool:
    """Whether ``.venv`` holds what ``ensure(root)`` would install now."""
    marker = root / ".venv" / "kvlc-installed"
    return marker.exists() and marker.read_text() == _stack_digest(root)


def ensure(root: Path, demo_only: bool = False) -> Path:
    """Return ``.venv``'s python with the patched vLLM and the reference
    connector installed, and, unless ``demo_only`` (what ``./wb demo``
    serves), the test tools: the test requirements, the Mooncake store and
    kvlc-aibrix. A later full ``ensure`` adds those to a demo's ``.venv``.
    """
    env_dir = root / ".venv"
    python = env_dir / "bin" / "python"
    marker = env_dir / "kvlc-installed"
    digest = _stack_digest(root)
    demo_state = f"demo {digest}"
    enough = {digest, demo_state} if demo_only else {digest}
    if marker.exists() and marker.read_text() in enough:
        print(f"{env_dir}: patched vLLM is up to date")
        return python
    if not python.exists():
        print(f"creating {env_dir}")
        venv.create(env_dir, with_pip=True)
    # The redis extra: hiredis, redis-py's fast reply parser.
    connector = ["-e", f"{root / CONNECTOR}[redis]"]
    if demo_only:
        pip_install(
            python,
            [str(root), *connector],
            "installing the patched vLLM (built from the release and patches/) "
            "and the reference connector",
            env_dir / "kvlc-pip-install.log",
        )
    else:
        pip_install(
            python,
            [
                str(root),
                "-r",
                str(root / TEST_REQUIREMENTS),
                "-r",
                str(root / MOONCAKE_REQUIREMENTS),
                *connector,
                "-e",
                str(root / AIBRIX),
                "-e",
                str(root / CONFORMANCE),
            ],
            "installing the patched vLLM (built from the release and patches/), "
            "the test requirements, the reference connector, kvlc-aibrix and "
            "the conformance kit",
            env_dir / "kvlc-pip-install.log",
        )
        pip_install(
            python,
            ["--no-deps", "-r", str(root / AIBRIX_REQUIREMENTS)],
            "installing aibrix-kvcache without its declared dependencies",
            env_dir / "kvlc-pip-install-aibrix.log",
        )
    version = subprocess.run(
        [str(env_dir / "bin" / "vllm"), "--version"],
        capture_output=True,
        text=True,
        check=False,
    )
    print(f"vllm --version: {version.stdout.strip() or version.stderr.strip()[-500:]}")
    if "+kvlc" not in version.stdout:
        raise WorkbenchError("the installed vLLM is not the patched build")
    marker.write_text(demo_state if demo_only else digest)
    return python


# CUDA-linked on the package index; beside CPU torch they break `import vllm`.
_CUDA_ONLY_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def _side_env(
    root: Path,
    name: str,
    state: str,
    packages: list[str],
    what: str,
    patched_vllm: bool = False,
) -> Path:
    """Return the python of the side environment ``name`` holding
    ``packages``, made afresh unless it was last made for the same ``state``.

    It lives in the cache folder, so every clone on the machine shares it and
    a clean clone's ``./wb test`` does not make it again while ``state`` (its
    inputs) is unchanged; ``build/<name>`` links to it. Its making is locked:
    two makers wait for each other instead of clearing each other's.

    With ``patched_vllm`` (``packages`` then include ``root``), a change of
    the stack alone reinstalls the patched vLLM over the environment, without
    its dependencies: they are the release wheel's, pinned by its hash, so
    ``state`` must name that hash.
    """
    env_dir = upstream.cache_dir() / name
    env_dir.parent.mkdir(parents=True, exist_ok=True)
    link = root / "build" / name
    with (env_dir.parent / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _link(link, env_dir)
        python = env_dir / "bin" / "python"
        stack = _stack_digest(root) if patched_vllm else None
        if _side_env_ready(env_dir, state, stack):
            print(f"{link}: {what} is up to date")
            return link / "bin" / "python"
        if _side_env_ready(env_dir, state):
            assert stack is not None
            print(f"{env_dir}: the stack changed; reinstalling the patched vLLM")
            pip_install(
                python,
                ["--no-deps", "--force-reinstall", str(root)],
                "installing the patched vLLM alone",
                env_dir / "kvlc-pip-vllm.log",
            )
        else:
            print(f"creating {env_dir} with {what}")
            venv.create(env_dir, with_pip=True, clear=True)
            pip = [str(python), "-m", "pip"]
            pip_install(
                python, packages, f"installing {what}", env_dir / "kvlc-pip.log"
            )
            _run(
                [*pip, "uninstall", "--quiet", "-y", *_CUDA_ONLY_EXTRAS], "uninstalling"
            )
        _run([str(python), "-c", "import vllm"], f"importing vllm with {what}")
        share_files(env_dir, root)
        (env_dir / "kvlc-state").write_text(state)
        if stack is not None:
            (env_dir / "kvlc-stack").write_text(stack)
    return link / "bin" / "python"


def _side_env_ready(env_dir: Path, state: str, stack: str | None = None) -> bool:
    """Whether the environment was made for ``state`` and, when ``stack`` is
    given, holds the patched vLLM of that stack digest."""
    marker, stamp = env_dir / "kvlc-state", env_dir / "kvlc-stack"
    if not (marker.is_file() and marker.read_text() == state):
        return False
    return stack is None or (stamp.is_file() and stamp.read_text() == stack)


def _link(link: Path, target: Path) -> None:
    """Make ``link`` a link to ``target``, replacing what was there (an
    environment made in the clone before side environments were shared)."""
    if link.is_symlink() and link.readlink() == target:
        return
    if link.is_symlink() or link.is_file():
        link.unlink()
    elif link.is_dir():
        shutil.rmtree(link)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target, target_is_directory=True)


UNPATCHED = "venv-unpatched"
LMCACHE_ENV = "venv-lmcache"


def _unpatched_state(root: Path) -> str:
    return f"{upstream.CPU_WHEEL.sha256}\n{(root / TEST_REQUIREMENTS).read_text()}"


def ensure_unpatched(root: Path) -> Path:
    """Return the python of ``build/venv-unpatched``: the release's own CPU
    wheel (hash-verified) and the test requirements, for baselines and A/B
    benchmarks against the patched build.
    """
    wheel = upstream.fetch(upstream.CPU_WHEEL)
    return _side_env(
        root,
        UNPATCHED,
        _unpatched_state(root),
        [str(wheel), "-r", str(root / TEST_REQUIREMENTS)],
        f"the unpatched vLLM {upstream.RELEASE}",
    )


LMCACHE = "lmcache==0.5.6"
LMCACHE_CONSTRAINTS = "project/constraints-lmcache.txt"


def _lmcache_state(root: Path) -> str:
    constraints = (root / LMCACHE_CONSTRAINTS).read_text()
    return f"{LMCACHE}\n{constraints}\n{upstream.CPU_WHEEL.sha256}"


def ensure_lmcache(root: Path) -> Path:
    """Return the python of ``build/venv-lmcache``: the patched vLLM and the
    real ``lmcache``, apart from ``.venv`` because ``lmcache`` downgrades
    numpy, protobuf, opentelemetry and grpcio. Made again when the
    constraints changed; a change of the stack reinstalls vLLM alone.
    """
    return _side_env(
        root,
        LMCACHE_ENV,
        _lmcache_state(root),
        [str(root), LMCACHE, "-c", str(root / LMCACHE_CONSTRAINTS)],
        f"the patched vLLM and {LMCACHE}",
        patched_vllm=True,
    )


def side_envs_ready(root: Path) -> bool:
    """Whether the unpatched and LMCache environments are made for today's
    inputs (``./wb test`` plans its lanes by it)."""
    cache = upstream.cache_dir()
    return _side_env_ready(cache / UNPATCHED, _unpatched_state(root)) and (
        _side_env_ready(cache / LMCACHE_ENV, _lmcache_state(root), _stack_digest(root))
    )

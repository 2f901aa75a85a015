"""``.venv``'s install marker: what makes ``./wb test`` reinstall."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import REPO
from workbench import devenv


@pytest.mark.parametrize(
    "changed", [f"{devenv.AIBRIX}/pyproject.toml", devenv.AIBRIX_REQUIREMENTS]
)
def test_kvlc_aibrix_install_inputs_change_the_digest(tmp_path: Path, changed: str):
    for rel in (f"{devenv.AIBRIX}/pyproject.toml", devenv.AIBRIX_REQUIREMENTS):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("a\n")
    before = devenv._stack_digest(tmp_path)
    (tmp_path / changed).write_text("b\n")
    assert devenv._stack_digest(tmp_path) != before


def test_aibrix_kvcache_is_pinned_and_installed_apart():
    """aibrix-kvcache is not a dependency of kvlc-aibrix (pip would then
    install its redis==6.0.0 pin over the project's redis): it is pinned in
    its own requirements file, which ensure() installs with --no-deps."""
    pyproject = (REPO / devenv.AIBRIX / "pyproject.toml").read_text()
    dependencies = pyproject.split("dependencies = [", 1)[1].split("]")[0]
    assert "aibrix-kvcache" not in dependencies
    lines = (REPO / devenv.AIBRIX_REQUIREMENTS).read_text().splitlines()
    pinned = [ln for ln in lines if ln and not ln.startswith("#")]
    assert pinned == ["aibrix-kvcache==0.8.0"]


def test_demo_installs_what_it_serves_and_the_tests_add_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """``./wb demo`` installs the patched vLLM and the connector only; a
    later ``./wb test`` installs the test tools on top, and a demo after
    that installs nothing."""
    installs: list[list[str]] = []
    monkeypatch.setattr(
        devenv,
        "pip_install",
        lambda python, args, what, log, env=None: installs.append(args),
    )
    monkeypatch.setattr(devenv.venv, "create", lambda *a, **k: None)
    monkeypatch.setattr(devenv, "_stack_digest", lambda root: "d1")

    class Version:
        stdout = "0.32.0+kvlc.cpu"
        stderr = ""

    monkeypatch.setattr(devenv.subprocess, "run", lambda *a, **k: Version())
    (tmp_path / ".venv").mkdir()
    devenv.ensure(tmp_path, demo_only=True)
    assert installs == [[str(tmp_path), "-e", f"{tmp_path / devenv.CONNECTOR}[redis]"]]
    devenv.ensure(tmp_path, demo_only=True)
    assert len(installs) == 1
    devenv.ensure(tmp_path)
    full = " ".join(installs[1])
    assert devenv.TEST_REQUIREMENTS in full and devenv.MOONCAKE_REQUIREMENTS in full
    assert devenv.AIBRIX in full and len(installs) == 3
    devenv.ensure(tmp_path, demo_only=True)
    devenv.ensure(tmp_path)
    assert len(installs) == 3


def test_progress_lines_end_at_a_word_and_heartbeats_repeat_nothing_stale():
    line = "Building wheel for vllm (pyproject.toml): started " + "word " * 60
    shown = devenv.clip(line)
    assert len(shown) <= devenv.LINE_CHARS and shown.endswith(" ...")
    assert line.startswith(shown[: -len(" ...")] + " ")  # cut at a space
    first = devenv.heartbeat(20, "Copying vllm/foo.py", "")
    assert first.endswith(": Copying vllm/foo.py")
    again = devenv.heartbeat(30, "Copying vllm/foo.py", "Copying vllm/foo.py")
    assert again == "... 30 s, pip still working (no new output)"
    assert devenv.HEARTBEAT_S <= 10


@pytest.mark.skipif(shutil.which("hardlink") is None, reason="no util-linux hardlink")
def test_a_side_environment_links_the_files_dot_venv_holds_byte_for_byte(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    """Shared: a library both hold; kept apart: ``.py`` files (their time
    decides whether Python's bytecode is stale), a file that differs, and a
    file whose name differs."""
    main, side = tmp_path / ".venv", tmp_path / "build" / "venv-side"
    files = {
        "lib/libtorch_cpu.so": (b"\x7fELF" * 4096, b"\x7fELF" * 4096),
        "torch/__init__.py": (b"import os\n" * 500, b"import os\n" * 500),
        "vllm/_C.so": (b"patched" * 2000, b"release" * 2000),
        "lib/libgomp.so": (b"gomp" * 4096, None),
        "lib/libgomp-renamed.so": (None, b"gomp" * 4096),
    }
    for rel, (in_main, in_side) in files.items():
        for where, data in ((main, in_main), (side, in_side)):
            if data is not None:
                (where / rel).parent.mkdir(parents=True, exist_ok=True)
                (where / rel).write_bytes(data)

    devenv.share_files(side, tmp_path)

    def same(rel: str, other: str | None = None) -> bool:
        return (main / rel).stat().st_ino == (side / (other or rel)).stat().st_ino

    assert same("lib/libtorch_cpu.so")
    assert (main / "lib/libtorch_cpu.so").stat().st_nlink == 2
    assert not same("torch/__init__.py")
    assert not same("vllm/_C.so")
    assert (side / "vllm/_C.so").read_bytes() == b"release" * 2000
    assert not same("lib/libgomp.so", "lib/libgomp-renamed.so")
    assert "linked" in capsys.readouterr().out


def test_a_side_environment_is_made_once_per_inputs_and_shared_by_clones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Made in the cache folder and linked from each clone's ``build/``
    (an environment a clone made itself is replaced by the link); a second
    clean clone with the same inputs makes nothing; new inputs remake it."""
    made: list[list[str]] = []

    def pip_install(python, packages, what, log, env=None):
        made.append(packages)
        (python.parent.parent / "installed").write_text(" ".join(packages))

    monkeypatch.setenv("KVLC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(devenv, "pip_install", pip_install)
    monkeypatch.setattr(devenv, "_run", lambda cmd, what: None)

    def create(env_dir: Path, **kwargs: object) -> None:
        assert kwargs["clear"]  # what the last inputs left goes
        shutil.rmtree(env_dir, ignore_errors=True)
        env_dir.mkdir(parents=True)

    monkeypatch.setattr(devenv.venv, "create", create)
    first, second = tmp_path / "clone-1", tmp_path / "clone-2"
    (first / "build" / "venv-side" / "bin").mkdir(parents=True)

    python = devenv._side_env(first, "venv-side", "inputs 1", ["pkg==1"], "pkg")
    env = tmp_path / "cache" / "venv-side"
    assert python == first / "build" / "venv-side" / "bin" / "python"
    assert (first / "build" / "venv-side").readlink() == env
    assert (env / "installed").read_text() == "pkg==1"
    devenv._side_env(second, "venv-side", "inputs 1", ["pkg==1"], "pkg")
    assert made == [["pkg==1"]]
    assert (second / "build" / "venv-side").readlink() == env

    devenv._side_env(second, "venv-side", "inputs 2", ["pkg==2"], "pkg")
    assert made == [["pkg==1"], ["pkg==2"]]
    assert (first / "build" / "venv-side" / "installed").read_text() == "pkg==2"


def test_a_stack_change_reinstalls_the_patched_vllm_alone_in_lmcaches_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """LMCache's environment holds the patched vLLM: a new stack reinstalls
    vLLM over it without dependencies (the release wheel's, pinned by hash);
    new inputs of the environment itself (the constraints) make it again."""
    calls: list[str] = []
    stack = ["stack 1"]

    def pip_install(python, packages, what, log, env=None):
        calls.append("pip " + " ".join(packages))

    def create(env_dir: Path, **kwargs: object) -> None:
        calls.append("create")
        shutil.rmtree(env_dir, ignore_errors=True)
        (env_dir / "bin").mkdir(parents=True)

    monkeypatch.setenv("KVLC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(devenv, "pip_install", pip_install)
    monkeypatch.setattr(devenv, "_run", lambda cmd, what: None)
    monkeypatch.setattr(devenv, "share_files", lambda env_dir, root: None)
    monkeypatch.setattr(devenv.venv, "create", create)
    monkeypatch.setattr(devenv, "_stack_digest", lambda root: stack[0])
    root = tmp_path / "clone"
    (root / devenv.LMCACHE_CONSTRAINTS).parent.mkdir(parents=True)
    (root / devenv.LMCACHE_CONSTRAINTS).write_text("numpy<2\n")

    env = tmp_path / "cache" / devenv.LMCACHE_ENV

    def ready() -> bool:
        return devenv._side_env_ready(env, devenv._lmcache_state(root), stack[0])

    devenv.ensure_lmcache(root)
    assert calls[0] == "create" and devenv.LMCACHE in calls[1]
    assert ready()
    calls.clear()
    devenv.ensure_lmcache(root)
    assert calls == []

    stack[0] = "stack 2"
    assert not ready()
    devenv.ensure_lmcache(root)
    assert calls == [f"pip --no-deps --force-reinstall {root}"]
    calls.clear()
    devenv.ensure_lmcache(root)
    assert calls == []

    (root / devenv.LMCACHE_CONSTRAINTS).write_text("numpy<2\nprotobuf<5\n")
    devenv.ensure_lmcache(root)
    assert calls[0] == "create" and devenv.LMCACHE in calls[1]

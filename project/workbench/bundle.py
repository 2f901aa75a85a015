"""``./wb bundle``: what a CUDA host without a package index needs to run the
stack, in pieces small enough to send one at a time.

An air-gapped GPU server (or a lent one that reaches no index and takes a
few tens of MiB per transfer) cannot ``pip install`` the stack. The bundle
holds, as wheels:

- the patched CUDA build (``build.HOPPER``): the pinned release wheel with
  the stack applied, less the kernels dense models on Hopper do not use
  (FlashAttention 2, MoE, MLA, DeepGEMM, Blackwell), stored uncompressed in
  its zip so the archive's xz compresses the kernels themselves; its torch
  requirement is ``torch>=2.11`` instead of the release's ``torch==2.13.0``
  (see ``HOPPER``);
- the dependencies a stock CUDA image with torch lacks, pinned
  (``data/offline-pure.txt``: pure-Python wheels; ``data/offline-compiled.txt``:
  compiled ones, for the host's Python, ``--python-version``);
- the reference connector (``kvlc-store-connector``), built from this tree.

They go into one xz-compressed tar, split into pieces of at most
``--piece-mib`` MiB (``kvlc-bundle.tar.xz.000``, ...), beside ``install.sh``
and ``SHA256SUMS``. On the host, with every piece in one folder:
``bash install.sh DEST`` checks the pieces, unpacks them, creates the
virtual environment ``DEST`` on top of the host's packages
(``--system-site-packages``: its torch, its CUDA libraries) and installs
every wheel with ``pip install --no-index --no-deps --find-links``, then
imports what the bundle names. ``--no-deps``: the host's packages are taken
as they are (the release pins torch 2.13.0 and CUDA libraries the host may
hold in other versions); the import check is what tells a gap.

``--pure`` builds the pure-Python part alone (the connector and
``offline-pure.txt``): what CI installs offline into a fresh virtual
environment, without the 326 MB CUDA release wheel.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from workbench import build
from workbench.errors import WorkbenchError
from workbench.stack import Stack

MIB = 1 << 20
# The most one transfer to a lent GPU machine takes, the working tree
# included: a piece leaves room for the tree that travels with it.
MAX_PIECE_MIB = 64
PIECE_MIB = 60
# The Python of the CUDA images the stack is run on (compiled wheels).
PYTHON_VERSION = "3.12"
MANYLINUX = (5, 12, 17, 24, 27, 28, 31, 34, 35)
DATA = Path(__file__).resolve().parent / "data"
PURE_REQUIREMENTS = DATA / "offline-pure.txt"
COMPILED_REQUIREMENTS = DATA / "offline-compiled.txt"
ARCHIVE = "kvlc-bundle.tar.xz"
MANIFEST = "bundle.json"
# What the full bundle's install imports to call itself done.
CUDA_IMPORTS = ("torch", "vllm", "vllm._C_stable_libtorch", "kvlc_store.connector")


def platform_args(python_version: str) -> list[str]:
    """``pip download`` options for wheels of CPython ``python_version`` on
    x86-64 Linux (any manylinux a CUDA image's glibc runs) and pure ones."""
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


def download(requirements: Path, into: Path, python_version: str) -> list[Path]:
    """The wheels of ``requirements`` (pinned, no dependencies followed)."""
    before = set(into.glob("*.whl"))
    _pip(
        ["download", "--no-deps", "-d", str(into), "-r", str(requirements)]
        + platform_args(python_version),
        f"downloading the wheels of {requirements.name}",
    )
    return sorted(set(into.glob("*.whl")) - before)


def _pure(wheel: Path) -> bool:
    return wheel.name.endswith("-none-any.whl")


def connector_wheel(root: Path, into: Path) -> Path:
    """The reference connector, built from a copy of ``root``'s tree (a
    setuptools build writes ``build/`` and ``*.egg-info`` beside its
    sources)."""
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


def stored(wheel: Path) -> None:
    """Rewrite ``wheel`` with its members uncompressed: the archive's xz then
    compresses the kernels themselves, far better than their deflate."""
    tmp = wheel.with_suffix(".stored")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w") as dst:
        for info in src.infolist():
            stored_info = copy.copy(info)
            stored_info.compress_type = zipfile.ZIP_STORED
            with src.open(info) as member, dst.open(stored_info, "w") as out:
                shutil.copyfileobj(member, out, 16 * MIB)
    tmp.replace(wheel)


def split(archive: Path, out: Path, piece_bytes: int) -> list[Path]:
    """``archive`` as consecutive pieces ``<name>.000``, ... in ``out``."""
    pieces: list[Path] = []
    with archive.open("rb") as f:
        while chunk := f.read(piece_bytes):
            piece = out / f"{archive.name}.{len(pieces):03d}"
            piece.write_bytes(chunk)
            pieces.append(piece)
    return pieces


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(MIB):
            digest.update(block)
    return digest.hexdigest()


def make_bundle(
    stack: Stack,
    root: Path,
    out: Path,
    piece_mib: int = PIECE_MIB,
    python_version: str = PYTHON_VERSION,
    pure: bool = False,
) -> list[Path]:
    """Build the bundle into ``out`` (emptied first); return its files:
    the pieces, ``install.sh`` and ``SHA256SUMS``."""
    if not 1 <= piece_mib <= MAX_PIECE_MIB:
        raise WorkbenchError(
            f"--piece-mib {piece_mib}: a piece must be 1 to {MAX_PIECE_MIB} MiB "
            "(what one transfer to a lent GPU machine takes)"
        )
    if shutil.which("xz") is None:
        raise WorkbenchError("./wb bundle needs xz (apt-get install xz-utils)")
    with tempfile.TemporaryDirectory(prefix="kvlc-bundle-") as tmp:
        wheels = Path(tmp) / "wheels"
        wheels.mkdir()
        pure_wheels = download(PURE_REQUIREMENTS, wheels, python_version)
        impure = [w.name for w in pure_wheels if not _pure(w)]
        if impure:
            raise WorkbenchError(
                f"{', '.join(impure)}: not pure-Python wheels; move them from "
                f"{PURE_REQUIREMENTS.name} to {COMPILED_REQUIREMENTS.name}"
            )
        connector_wheel(root, wheels)
        imports: tuple[str, ...] = ()
        if not pure:
            download(COMPILED_REQUIREMENTS, wheels, python_version)
            vllm = build.repack(stack, build.HOPPER, wheels)
            stored(vllm)
            imports = CUDA_IMPORTS
        names = sorted(w.name for w in wheels.glob("*.whl"))
        manifest = {
            "python": python_version,
            "part": "pure-Python" if pure else "CUDA (dense models on Hopper)",
            "wheels": names,
            "imports": list(imports),
        }
        (wheels / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        tar = Path(tmp) / ARCHIVE.removesuffix(".xz")
        with tarfile.open(tar, "w") as t:
            t.add(wheels, arcname="wheels")
        # Multithreaded xz: the CUDA part is ~700 MB before compression.
        subprocess.run(["xz", "-9", "-T0", str(tar)], check=True)
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        pieces = split(Path(tmp) / ARCHIVE, out, piece_mib * MIB)
    script = out / "install.sh"
    script.write_text((DATA / "offline-install.sh").read_text())
    script.chmod(0o755)
    sums = out / "SHA256SUMS"
    sums.write_text("".join(f"{_sha256(p)}  {p.name}\n" for p in pieces))
    return [*pieces, script, sums]


def describe(files: list[Path]) -> str:
    lines = [f"{f.name}: {os.path.getsize(f) / MIB:.1f} MiB" for f in files]
    return "\n".join(lines)

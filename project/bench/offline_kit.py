"""Install the kit ``./wb bundle`` builds, on a host with no package index.

Standard library only, run by the host's own Python, whatever it is (a
virtual environment's interpreter, a system Python, conda): the kit is a
ready site directory, unpacked into a new folder that goes on
``PYTHONPATH`` ahead of the host's packages. The host's torch and CUDA
libraries are used as they are (the kit holds neither), nothing is
installed into the host's environment, and no virtual environment is made
(one made from a venv's interpreter would not see that venv's torch).

    python3 project/bench/offline_kit.py --kit build/bundle   # prints FOLDER
    PYTHONPATH=FOLDER python3 my_offline_llm_script.py

The kit holds what vLLM's offline ``LLM`` API imports (``vllm serve``'s
HTTP server needs packages it leaves out: docs/gpu.md, "the kit").

``gpu_ttft.py --kit build/bundle`` installs it the same way before it runs.

The install checks the archive against ``kit.json`` (size, sha256) before
unpacking, unpacks into a temporary folder beside the destination, imports
the modules ``kit.json`` names with the host's Python (and checks that torch
is the host's), and only then renames the folder into place. A failure
removes the temporary folder and nothing else; an existing destination is
reused when it holds this kit, and never replaced otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

MANIFEST = "kit.json"
MARKER = ".kvlc-kit.json"

VERIFY = """
import importlib, sys
site, names = sys.argv[1], sys.argv[2:]
import torch
if torch.__file__.startswith(site):
    sys.exit(f"torch was imported from the kit ({torch.__file__}), not the host's")
print(f"torch {torch.__version__} (the host's: {torch.__file__})")
for name in names:
    module = importlib.import_module(name)
    if not (module.__file__ or "").startswith(site):
        sys.exit(f"{name} was imported from {module.__file__}, not the kit at {site}")
    print(f"import {name}: {getattr(module, '__version__', 'ok')}")
if "vllm" in names:
    # The kernels the way vLLM loads them (the CPU build picks a library by
    # the CPU's flags), and one op vLLM calls through them.
    from vllm.platforms import current_platform
    current_platform.import_kernels()
    torch.ops._C.rms_norm
    print(f"vLLM kernels loaded ({type(current_platform).__name__})")
"""


class KitError(Exception):
    pass


def read_manifest(kit: Path) -> dict[str, Any]:
    path = kit / MANIFEST
    if not path.is_file():
        raise KitError(
            f"{path} is missing: build the kit with ./wb bundle (on a machine "
            f"with a package index) and copy or carry the whole folder {kit}"
        )
    manifest: dict[str, Any] = json.loads(path.read_text())
    return manifest


def default_dest(manifest: dict[str, Any]) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kvlc-kit" / manifest["sha256"][:16]


def check_archive(kit: Path, manifest: dict[str, Any]) -> Path:
    archive = kit / manifest["archive"]
    if not archive.is_file():
        raise KitError(f"{archive} is missing: copy it with {kit / MANIFEST}")
    size = archive.stat().st_size
    if size != manifest["bytes"]:
        raise KitError(
            f"{archive} is {size} bytes, {MANIFEST} says {manifest['bytes']}: "
            "a partial or different copy; copy it again, or build both anew "
            "with ./wb bundle"
        )
    digest = hashlib.sha256()
    with archive.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    if digest.hexdigest() != manifest["sha256"]:
        raise KitError(
            f"{archive} does not match the sha256 in {MANIFEST}: damaged in "
            "transit; copy it again"
        )
    return archive


def check_python(manifest: dict[str, Any]) -> None:
    have = "{}.{}".format(*sys.version_info[:2])
    if manifest["python"] != have:
        raise KitError(
            f"the kit's compiled wheels are for Python {manifest['python']}, "
            f"{sys.executable} is {have}: run this with a Python "
            f"{manifest['python']}, or build the kit with ./wb bundle "
            f"--python-version {have}"
        )


def with_site(site: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with ``site`` first on PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    rest = env.get("PYTHONPATH")
    env["PYTHONPATH"] = f"{site}{os.pathsep}{rest}" if rest else str(site)
    return env


def verify(site: Path, imports: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", VERIFY, str(site), *imports],
        env=with_site(site),
        capture_output=True,
        text=True,
        check=False,
    )
    print(proc.stdout, end="", flush=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-12:])
        raise KitError(f"the kit's import check failed with {sys.executable}:\n{tail}")


def install(kit: Path, dest: Path | None = None) -> Path:
    """The site folder of ``kit``, installed at ``dest`` if not there yet."""
    manifest = read_manifest(kit)
    check_python(manifest)
    dest = dest or default_dest(manifest)
    marker = dest / MARKER
    installed = json.loads(marker.read_text()) if marker.is_file() else {}
    if installed.get("sha256") == manifest["sha256"]:
        print(f"kit already installed at {dest}", flush=True)
        return dest
    if dest.exists():
        raise KitError(
            f"{dest} exists and does not hold this kit: name another "
            "destination, or remove it yourself"
        )
    archive = check_archive(kit, manifest)
    partial = dest.with_name(f"{dest.name}.partial-{os.getpid()}")
    partial.mkdir(parents=True)
    try:
        with tarfile.open(archive, "r:xz") as t:
            if hasattr(tarfile, "data_filter"):
                t.extractall(partial, filter="data")
            else:  # Python before 3.11.4 / 3.12: no extraction filters
                t.extractall(partial)
        verify(partial, manifest["imports"])
        (partial / MARKER).write_text(json.dumps(manifest, indent=1) + "\n")
        partial.rename(dest)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    print(f"kit installed at {dest} (vLLM {manifest['vllm']}, commit "
          f"{manifest['commit'][:10]})", flush=True)  # fmt: skip
    return dest


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--kit", type=Path, required=True, help="the folder ./wb bundle wrote"
    )
    p.add_argument("--dest", type=Path, help="default: ~/.cache/kvlc-kit/SHA")
    args = p.parse_args()
    try:
        site = install(args.kit, args.dest)
    except KitError as e:
        print(f"offline_kit: {e}", file=sys.stderr)
        return 1
    print(site)
    return 0


if __name__ == "__main__":
    sys.exit(main())

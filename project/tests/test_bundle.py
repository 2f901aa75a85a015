"""``./wb bundle``, the offline install of the stack, on its pure-Python part.

CI builds ``./wb bundle --pure`` (the connector and ``offline-pure.txt``:
no 326 MB CUDA release wheel; its wheels come from pip's cache after the
first run) in 1 MiB pieces, so the pieces, their sums and the reassembly are
the same code as a CUDA bundle's 60 MiB ones, and installs it with the
bundle's ``install.sh`` into a fresh virtual environment, with no package
index: every wheel lands at its pinned version. Not covered here: the CUDA
wheel's repack and trim (``build.HOPPER``; its file list is checked against
the release whenever it is built) and the imports on a GPU host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from workbench import bundle

PIECE_MIB = 1


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "out"
    command = [sys.executable, str(REPO / "wb"), "bundle", "--pure"]
    command += ["--piece-mib", str(PIECE_MIB), "--out", str(out)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out


def install(out: Path, dest: Path) -> subprocess.CompletedProcess[str]:
    # No index reachable: pip must not need one.
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("PYTHONPATH", None)
    env["PIP_INDEX_URL"] = "http://127.0.0.1:9/simple"
    return subprocess.run(
        ["bash", str(out / "install.sh"), str(dest)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def test_pieces_are_at_most_the_piece_size_and_summed(built: Path):
    pieces = sorted(built.glob(f"{bundle.ARCHIVE}.*"))
    assert len(pieces) >= 2
    sizes = [p.stat().st_size for p in pieces]
    assert all(size == PIECE_MIB << 20 for size in sizes[:-1])
    assert 0 < sizes[-1] <= PIECE_MIB << 20
    sums = (built / "SHA256SUMS").read_text().split()
    assert sums[1::2] == [p.name for p in pieces]
    assert sorted(p.name for p in built.iterdir()) == sorted(
        [*(p.name for p in pieces), "install.sh", "SHA256SUMS"]
    )


def test_offline_install_into_a_fresh_venv(built: Path, tmp_path: Path):
    dest = tmp_path / "venv"
    run = install(built, dest)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (site,) = dest.glob("lib/python*/site-packages")
    listed = subprocess.run(
        [
            str(dest / "bin" / "python"),
            "-c",
            "import importlib.metadata as m, json, sys, kvlc_store; "
            "print(json.dumps(sorted(f\"{d.metadata['Name']}=={d.version}\" "
            "for d in m.distributions(path=[sys.argv[1]]))))",
            str(site),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    installed = {line.lower().replace("_", "-") for line in json.loads(listed.stdout)}
    wanted = {"kvlc-store-connector==0.1.0"}
    for line in bundle.PURE_REQUIREMENTS.read_text().splitlines():
        if line and not line.startswith("#"):
            wanted.add(line.lower().replace("_", "-"))
    assert wanted <= installed, sorted(wanted - installed)


def test_a_damaged_piece_installs_nothing(built: Path, tmp_path: Path):
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in built.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    piece = copy / f"{bundle.ARCHIVE}.001"
    data = bytearray(piece.read_bytes())
    data[100] ^= 1
    piece.write_bytes(bytes(data))
    dest = tmp_path / "venv"
    run = install(copy, dest)
    assert run.returncode == 1
    assert "a piece is missing or damaged" in run.stderr
    assert not dest.exists()

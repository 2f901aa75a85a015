"""The offline GPU kit (``./wb bundle``, ``project/bench/offline_kit.py``):
its parts, and the rehearsal of the one call a lent GPU machine gets.

The rehearsal does here what that call does there, with what differs
replaced by the nearest thing this machine has: a fresh virtual environment
stands in for the GPU image (its interpreter a venv's, CPU torch, the
image's packages that vLLM requires: ``data/gpu-image-standin.txt``), the
kit is built from the CPU release wheel (``./wb bundle --device cpu``, the
same code as the CUDA kit but the fat-binary cut), and a copy of the
repository holding only what would travel (the tracked files and the kit)
runs the command ``docs/gpu.md`` gives, with ``--tiny``, with no index
reachable and ``$HOME`` empty: it installs the kit with the stand-in's
Python and runs plan 1 through.
"""

from __future__ import annotations

import fcntl
import json
import re
import shutil
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import REPO
from test_gpu_ttft_tiny import check_tiny_plan_one
from workbench import bundle, devenv, fatbin, upstream
from workbench.errors import WorkbenchError

sys.path.insert(0, str(REPO / "project" / "bench"))

import offline_kit  # noqa: E402

GPU_MD = REPO / "project" / "docs" / "gpu.md"
STANDIN = REPO / "project" / "tests" / "data" / "gpu-image-standin.txt"
NO_INDEX = {
    "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
    "PIP_NO_INDEX": "1",
    "HTTP_PROXY": "http://127.0.0.1:9",
    "HTTPS_PROXY": "http://127.0.0.1:9",
    "HF_HUB_OFFLINE": "1",
}


# -- the fat-binary cut --------------------------------------------------------


def entry(kind: int, arch: int, payload: bytes) -> bytes:
    head = struct.pack("<HHIQ", kind, 0x101, 64, len(payload))
    head += bytes(28 - len(head)) + struct.pack("<I", arch)
    return head + bytes(64 - len(head)) + payload


def fat_binary(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", fatbin.FATBIN_MAGIC, 1, 16, len(body)) + body


def elf_with(section: bytes) -> bytes:
    """A 64-bit ELF file holding ``section`` as ``.nv_fatbin``."""
    names = b"\0.shstrtab\0.nv_fatbin\0"
    data_at = 64
    names_at = data_at + len(section)
    shoff = names_at + len(names)
    header = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header += struct.pack(
        "<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64, 3, 1
    )

    def sh(name: int, offset: int, size: int) -> bytes:
        return struct.pack("<IIQQQQIIQQ", name, 1, 0, 0, offset, size, 0, 0, 1, 0)

    sections = bytes(64) + sh(1, names_at, len(names)) + sh(11, data_at, len(section))
    return header + section + names + sections


def test_the_cut_keeps_what_sm90_runs_in_place(tmp_path: Path):
    sass90, sass90a = b"S90" * 40, b"S9a" * 40
    both = fat_binary(
        entry(fatbin.ELF, 80, b"S80" * 50),
        entry(fatbin.ELF, 90, sass90),
        entry(fatbin.PTX, 80, b"P80" * 60),
        entry(fatbin.ELF, 90, sass90a),
        entry(fatbin.ELF, 120, b"S12" * 30),
    )
    ptx_only = fat_binary(
        entry(fatbin.ELF, 80, b"S80" * 20),
        entry(fatbin.PTX, 80, b"P80" * 20),
        entry(fatbin.PTX, 100, b"P10" * 20),
    )
    blackwell = fat_binary(entry(fatbin.ELF, 100, b"B10" * 20))
    section = both + bytes(8) + ptx_only + blackwell
    library = tmp_path / "lib.so"
    library.write_bytes(elf_with(section))
    size = library.stat().st_size

    pruned = fatbin.keep_arch(library, 90)

    data = library.read_bytes()
    assert len(data) == size
    found = fatbin.fat_binaries(data)
    kept = [[(e.kind, e.arch) for e in entries] for _, _, entries in found]
    assert kept == [
        [(fatbin.ELF, 90), (fatbin.ELF, 90)],  # SASS for sm_90: nothing else runs
        [(fatbin.PTX, 80)],  # no sm_90 SASS: the PTX the driver compiles
        [(fatbin.ELF, 100)],  # nothing sm_90 runs: left as it was
    ]
    assert sass90 in data and sass90a in data and b"P80" * 20 in data
    assert b"S80" not in data and b"S12" not in data and b"P10" not in data
    assert pruned.unusable == len(blackwell) - 16
    assert pruned.kept + pruned.zeroed + pruned.unusable == len(section) - 8 - 3 * 16


# -- the kit's folder ----------------------------------------------------------


def test_a_new_kit_replaces_an_older_bigger_one_whole(tmp_path: Path):
    """Also what ./wb bundle wrote before the kit: pieces of an archive,
    their sums and an installer, which a later install would read beside
    the new files (``xz: Compressed data is corrupt``)."""
    out = tmp_path / "kit"
    out.mkdir()
    (out / bundle.ARCHIVE).write_bytes(b"old" * 1000)
    (out / bundle.MANIFEST).write_text("{}")
    for name in ("kvlc-bundle.tar.xz.000", "kvlc-bundle.tar.xz.001", "SHA256SUMS",
                 "install.sh"):  # fmt: skip
        (out / name).write_text("old")
    new = tmp_path / "new"
    new.mkdir()
    files = [new / bundle.ARCHIVE, new / bundle.MANIFEST]
    files[0].write_bytes(b"new")
    files[1].write_text('{"new": 1}')
    bundle.replace_out(out, files)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [bundle.ARCHIVE, bundle.MANIFEST]
    )
    assert (out / bundle.ARCHIVE).read_bytes() == b"new"


def test_a_folder_holding_other_files_is_not_emptied(tmp_path: Path):
    out = tmp_path / "kit"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / bundle.ARCHIVE).write_bytes(b"old")
    with pytest.raises(WorkbenchError, match="notes.txt, not a kit's"):
        bundle.replace_out(out, [])
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / bundle.ARCHIVE).read_bytes() == b"old"


def test_a_cuda_kit_that_would_not_fit_one_transfer_is_refused(tmp_path: Path):
    limit = bundle.TRANSFER_LIMIT_MIB * bundle.MIB
    fits = bundle.Kit(tmp_path / "a", tmp_path / "m", limit - 1000, 1000)
    bundle.refuse_oversized(fits)
    over = bundle.Kit(tmp_path / "a", tmp_path / "m", limit - 999, 1000)
    with pytest.raises(WorkbenchError, match="64.0 MiB, over the 64 MiB"):
        bundle.refuse_oversized(over)


# -- the installer, on a small kit ---------------------------------------------


def small_kit(tmp_path: Path, modules: dict[str, str], imports: list[str]) -> Path:
    """A kit whose site holds ``modules`` (name -> source)."""
    kit = tmp_path / "kit"
    kit.mkdir()
    site = tmp_path / "site"
    for name, source in modules.items():
        path = site / name / "__init__.py"
        path.parent.mkdir(parents=True)
        path.write_text(source)
    archive = kit / bundle.ARCHIVE
    with tarfile.open(archive, "w:xz") as t:
        for path in sorted(site.rglob("*")):
            t.add(path, arcname=str(path.relative_to(site)), recursive=False)
    manifest = {
        "archive": bundle.ARCHIVE,
        "sha256": upstream.sha256_of(archive),
        "bytes": archive.stat().st_size,
        "python": "{}.{}".format(*sys.version_info[:2]),
        "vllm": "test",
        "commit": "0" * 40,
        "imports": imports,
    }
    (kit / bundle.MANIFEST).write_text(json.dumps(manifest))
    return kit


def test_install_checks_unpacks_verifies_and_reuses(tmp_path: Path, capfd):
    kit = small_kit(
        tmp_path, {"kvlc_kit_probe": "__version__ = '7'\n"}, ["kvlc_kit_probe"]
    )
    dest = tmp_path / "dest"
    assert offline_kit.install(kit, dest) == dest
    out = capfd.readouterr().out
    assert "import kvlc_kit_probe: 7" in out and "(the host's:" in out
    assert (dest / "kvlc_kit_probe" / "__init__.py").is_file()
    assert offline_kit.install(kit, dest) == dest
    assert "already installed" in capfd.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest", "kit", "site"]


def test_a_damaged_archive_installs_nothing(tmp_path: Path):
    kit = small_kit(tmp_path, {"kvlc_kit_probe": ""}, ["kvlc_kit_probe"])
    archive = kit / bundle.ARCHIVE
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 0xFF
    archive.write_bytes(data)
    with pytest.raises(offline_kit.KitError, match="does not match the sha256"):
        offline_kit.install(kit, tmp_path / "dest")
    archive.write_bytes(data[:-10])
    with pytest.raises(offline_kit.KitError, match="a partial or different copy"):
        offline_kit.install(kit, tmp_path / "dest")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kit", "site"]


def test_a_failed_import_check_leaves_nothing_and_an_existing_folder_is_kept(
    tmp_path: Path,
):
    broken = small_kit(tmp_path, {"kvlc_kit_probe": "raise ImportError('x')\n"},
                       ["kvlc_kit_probe"])  # fmt: skip
    with pytest.raises(offline_kit.KitError, match="import check failed"):
        offline_kit.install(broken, tmp_path / "dest")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kit", "site"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "data").write_text("keep")
    with pytest.raises(offline_kit.KitError, match="does not hold this kit"):
        offline_kit.install(broken, mine)
    assert (mine / "data").read_text() == "keep"


def test_a_kit_that_would_hide_the_hosts_torch_is_refused(tmp_path: Path):
    kit = small_kit(tmp_path, {"torch": "__version__ = 'kit'\n"}, [])
    with pytest.raises(offline_kit.KitError, match="torch was imported from the kit"):
        offline_kit.install(kit, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


def test_a_kit_for_another_python_says_which(tmp_path: Path):
    kit = small_kit(tmp_path, {"kvlc_kit_probe": ""}, [])
    manifest = json.loads((kit / bundle.MANIFEST).read_text())
    manifest["python"] = "3.99"
    (kit / bundle.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(offline_kit.KitError, match="for Python 3.99.*--python-version"):
        offline_kit.install(kit, tmp_path / "dest")


# -- the rehearsal ---------------------------------------------------------------


def one_call_command() -> str:
    """The command docs/gpu.md gives for the lent machine's one call."""
    text = GPU_MD.read_text()
    (command,) = re.findall(r"<!-- one call -->\n```\n(.+?)\n```", text, re.S)
    assert len(command) <= 2000  # what the device tool takes
    return command


@pytest.fixture(scope="module")
def standin() -> Path:
    """The GPU image's stand-in: a venv, CPU torch, the image's packages.
    Like the side environments, it is made once per machine in the cache
    folder and remade when its package list changes: the rehearsal installs
    the kit beside it, never into it."""
    env_dir = upstream.cache_dir() / "venv-gpu-standin"
    state = f"{sys.version}\n{STANDIN.read_text()}"
    marker = env_dir / "kvlc-state"
    env_dir.parent.mkdir(parents=True, exist_ok=True)
    with (env_dir.parent / "venv-gpu-standin.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.is_file() and marker.read_text() == state:
            return env_dir
        subprocess.run(
            [sys.executable, "-m", "venv", "--clear", str(env_dir)], check=True
        )
        python = env_dir / "bin" / "python"
        run = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "-r", str(STANDIN)],
            capture_output=True, text=True, timeout=1200, check=False,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        devenv.share_files(env_dir, REPO)
        marker.write_text(state)
    return env_dir


@pytest.fixture(scope="module")
def travelling(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the repository as the device tool sends it: its tracked
    files and the carried kit (a CPU kit, for this machine's Python)."""
    base = tmp_path_factory.mktemp("travel")
    kit = base / "kit"
    build = subprocess.run(
        [sys.executable, str(REPO / "wb"), "bundle", "--device", "cpu", "--fast",
         "--python-version", "{}.{}".format(*sys.version_info[:2]), "--out", str(kit)],
        capture_output=True, text=True, timeout=1200, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    repo = base / "repo"
    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    for name in filter(None, names):
        if (REPO / name).is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, repo / name)
    shutil.copytree(kit, repo / "build" / "bundle")
    return repo


def test_one_call_installs_the_kit_and_runs_plan_one_offline(
    standin: Path, travelling: Path, tmp_path: Path
):
    travelled = sum(p.stat().st_size for p in travelling.rglob("*") if p.is_file())
    home, out = tmp_path / "home", tmp_path / "out"
    home.mkdir()
    env = {
        "PATH": f"{standin / 'bin'}:/usr/bin:/bin",
        "HOME": str(home),
        "OUT": str(out),
        "TMPDIR": str(tmp_path),
        "VLLM_CPU_CI_ENV": "1",
        **NO_INDEX,
    }
    # The call's budget is a GPU's time; on a loaded 2-core CI machine plan
    # 1's three processes outrun it (330 s: the cold hit was never started).
    # Trimming to a budget and running out of time have their own tests
    # (test_gpu_ttft_tiny.py); here the last --budget-s wins.
    command = one_call_command() + " --tiny --budget-s 800"
    (site_packages,) = standin.glob("lib/python*/site-packages")
    image_before = sorted(p.name for p in site_packages.iterdir())
    run = subprocess.run(
        ["bash", "-c", command], cwd=travelling, env=env,
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-5000:]
    kit = json.loads((travelling / "build" / "bundle" / bundle.MANIFEST).read_text())
    manifest_bytes = (travelling / "build" / "bundle" / bundle.MANIFEST).stat().st_size
    assert travelled == kit["bytes"] + manifest_bytes + bundle.tracked_bytes(REPO)
    print(f"travelling: {travelled / bundle.MIB:.1f} MiB (tracked files, the CPU kit)")
    # The stand-in's own torch, the kit's vLLM and connector.
    assert f"(the host's: {standin}" in run.stdout
    # The image is the next call's too: the kit goes beside it.
    assert sorted(p.name for p in site_packages.iterdir()) == image_before
    site = tmp_path / "kvlc-kit"  # --kit-dest "${TMPDIR:-/tmp}/kvlc-kit"
    assert not (home / ".cache" / "kvlc-kit").exists()
    assert f"import vllm: {kit['vllm']}" in run.stdout
    assert f"kit installed at {site}" in run.stdout
    (results,) = [p for p in out.rglob("results.jsonl")]
    # Nothing in the kit names the folders it was built in.
    assert not list(site.glob("*.dist-info/direct_url.json"))
    check_tiny_plan_one(run.stdout, results.parent)

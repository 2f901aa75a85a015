"""The workbench's tool environments (``workbench.tools``): made correctly from
inside a PEP 517 build, checked by importing, repaired, safe to make twice at once.

These install from the package index, into a fresh ``KVLC_CACHE_DIR``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO
from workbench import tools

# A PEP 517 backend that makes the tools environment while pip builds it, as
# `pip install .` of the repository does (build.py may need `wheel`).
BACKEND = """
import os, sys, zipfile
from pathlib import Path

sys.path.insert(0, os.environ["KVLC_TEST_WORKBENCH"])
from workbench import tools

def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    tools.tools_python()
    name = "kvlc_tools_probe-0-py3-none-any.whl"
    info = "kvlc_tools_probe-0.dist-info"
    files = {
        f"{info}/METADATA": "Metadata-Version: 2.1\\n"
        "Name: kvlc-tools-probe\\nVersion: 0\\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\\nGenerator: probe\\n"
        "Root-Is-Purelib: true\\nTag: py3-none-any\\n",
    }
    record = [*files, f"{info}/RECORD"]
    files[f"{info}/RECORD"] = "".join(f"{p},,\\n" for p in record)
    with zipfile.ZipFile(Path(wheel_directory) / name, "w") as whl:
        for path, text in files.items():
            whl.writestr(path, text)
    return name
"""


def _env(cache: Path) -> dict[str, str]:
    return {**tools.clean_env(), "KVLC_CACHE_DIR": str(cache)}


def _imports(python: Path, modules: list[str]) -> subprocess.CompletedProcess[str]:
    code = "import " + ", ".join(modules)
    return subprocess.run(
        [str(python), "-c", code],
        env=tools.clean_env(),
        capture_output=True,
        text=True,
        check=False,
    )


def test_tools_env_made_inside_a_pep517_build_holds_its_packages(tmp_path: Path):
    project = tmp_path / "probe"
    (project / "backend").mkdir(parents=True)
    (project / "backend" / "probe_backend.py").write_text(BACKEND)
    # The build environment holds packaging (the latest `wheel` brings it):
    # a child pip that inherits pip's build variables sees it as installed.
    (project / "pyproject.toml").write_text(
        textwrap.dedent(
            """\
            [build-system]
            requires = ["packaging==26.3"]
            build-backend = "probe_backend"
            backend-path = ["backend"]
            """
        )
    )
    cache = tmp_path / "cache"
    env = {**_env(cache), "KVLC_TEST_WORKBENCH": str(REPO / "project")}
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", "dist", "./probe"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    python = cache / "tools-venv" / "bin" / "python"
    modules = [m for mods in tools.TOOLS.values() for m in mods]
    result = _imports(python, modules)
    assert result.returncode == 0, result.stderr


def test_broken_tools_env_is_repaired_and_concurrent_makers_agree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    cache = tmp_path / "cache"
    packages = {"packaging==26.3": ("packaging",)}
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from workbench import tools; "
        "print(tools.tools_python('probe', {'packaging==26.3': ('packaging',)}))"
    )
    cmd = [sys.executable, "-c", code, str(REPO / "project")]
    makers = [
        subprocess.Popen(cmd, env=_env(cache), stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [m.communicate(timeout=600)[0] for m in makers]
    assert [m.returncode for m in makers] == [0, 0], outputs
    # One made it; the other waited for the lock and found it complete.
    assert sum("creating" in out for out in outputs) == 1, outputs
    python = cache / "probe-venv" / "bin" / "python"
    assert _imports(python, ["packaging"]).returncode == 0

    # What a fresh machine once had: the install "done", the module absent.
    site = next((cache / "probe-venv" / "lib").glob("python3*/site-packages"))
    shutil.rmtree(site / "packaging")
    assert _imports(python, ["packaging"]).returncode != 0
    monkeypatch.setenv("KVLC_CACHE_DIR", str(cache))
    assert tools.tools_python("probe", packages) == python
    assert _imports(python, ["packaging"]).returncode == 0

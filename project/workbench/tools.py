"""The workbench's tool environment: pinned pre-commit and wheel, one per machine."""

from __future__ import annotations

import subprocess
import venv
from pathlib import Path

from workbench import upstream

TOOLS = ("pre-commit==4.7.0", "wheel==0.45.1")


def tools_python() -> Path:
    """The python of a venv holding ``TOOLS``, created on first use."""
    env_dir = upstream.cache_dir() / "tools-venv"
    python = env_dir / "bin" / "python"
    marker = env_dir / ("installed " + " ".join(TOOLS))
    if not marker.exists():
        print(f"creating {env_dir} with {', '.join(TOOLS)}")
        venv.create(env_dir, with_pip=True, clear=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", *TOOLS], check=True
        )
        marker.touch()
    return python

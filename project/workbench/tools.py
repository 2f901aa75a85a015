"""The workbench's tool environment: pinned pre-commit and wheel, one per machine."""

from __future__ import annotations

import subprocess
import venv
from pathlib import Path

from workbench import upstream

# packaging: pre-commit's virtualenv imports it, and on a fresh machine pip
# once left it out of this environment (pre-commit then cannot make any hook
# environment); naming it makes the install fail loudly instead.
TOOLS = ("pre-commit==4.7.0", "packaging==26.3", "wheel==0.45.1")
# ./wb bench's driver only plots; the workloads run in the vLLM environments.
BENCH_TOOLS = ("matplotlib==3.11.2",)


def tools_python(name: str = "tools", packages: tuple[str, ...] = TOOLS) -> Path:
    """The python of a venv ``<name>-venv`` holding ``packages``, made on first use."""
    env_dir = upstream.cache_dir() / f"{name}-venv"
    python = env_dir / "bin" / "python"
    marker = env_dir / ("installed " + " ".join(packages))
    if not marker.exists():
        print(f"creating {env_dir} with {', '.join(packages)}")
        venv.create(env_dir, with_pip=True, clear=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", *packages], check=True
        )
        marker.touch()
    return python

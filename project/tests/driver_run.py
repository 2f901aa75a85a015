"""Running a test driver in an interpreter of its own, offline against the
small Hugging Face cache: each driver prints one ``RESULT <json>`` line."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from workbench.hf_fixture import write_hf_cache


def run_driver(python: str, driver: Path, args: list[str], hf_home: Path) -> Any:
    """The parsed ``RESULT`` line of ``python driver *args``, run from the
    driver's directory; fails the test with the driver's stderr if it exits
    non-zero or prints no result."""
    env = {
        **os.environ,
        "HF_HOME": str(write_hf_cache(hf_home)),
        "HF_HUB_OFFLINE": "1",
    }
    result = subprocess.run(
        [python, str(driver), *args],
        cwd=driver.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    lines = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))

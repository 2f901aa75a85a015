"""``./wb demo``: install the patched vLLM and the reference connector, then
run ``project/demo/serve_demo.py``.

Ctrl-C reaches the demo script too (same process group); the script stops its
server's process group and removes its scratch folders, which takes a few
seconds. So this process must not kill it (``subprocess.call`` would, 0.25 s
after the interrupt, leaving the server running): it forwards the signal, in
case it alone got it, and waits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType

from workbench import devenv, syspkgs

INTERRUPTED = 128 + signal.SIGINT


def run_child(cmd: list[str], echo: bool = True) -> int:
    """Run ``cmd`` to completion, Ctrl-C included; return its exit status
    (130 when SIGINT killed it).
    """
    if echo:
        print(f"$ {' '.join(cmd)}", flush=True)
    # The demo script names itself after the command the user typed.
    proc = subprocess.Popen(cmd, env={**os.environ, "KVLC_DEMO_PROG": "wb demo"})

    def forward(signum: int, frame: FrameType | None) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = signal.signal(signal.SIGINT, forward)
    try:
        status = proc.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
    return INTERRUPTED if status == -signal.SIGINT else status


def run(root: Path, rest: list[str]) -> int:
    """The demo with ``rest`` as the demo script's arguments."""
    script = root / "project" / "demo" / "serve_demo.py"
    if {"-h", "--help"} & set(rest):
        # The script's parser needs nothing but the standard library.
        return run_child([sys.executable, str(script), "--help"], echo=False)
    # Its connector's system packages before the environment is built.
    if not syspkgs.ensure(root, "./wb demo", syspkgs.for_demo(rest)):
        return 1
    python = devenv.ensure(root, demo_only=True)
    return run_child([str(python), str(script), *rest])

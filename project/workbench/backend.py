"""PEP 517 backend: ``pip install .`` at the repository root installs the patched vLLM.

pip runs this in its isolated build environment. The wheel comes from
``workbench.build`` for the target device (``VLLM_TARGET_DEVICE``, default:
what the machine has): the pinned CPU or CUDA release wheel with the stack
applied. pip then installs it with the release's dependencies. The line naming
the build and why shows with ``pip install -v .``; the version pip reports
installing says it too (``+kvlc.cpu`` or ``+kvlc``).
"""

from __future__ import annotations

from pathlib import Path

from workbench import build, stack

_ROOT = Path(__file__).resolve().parents[2]


def get_requires_for_build_wheel(config_settings: object = None) -> list[str]:
    """Nothing beyond pip: the repack writes the wheel with the standard library."""
    return []


def build_wheel(
    wheel_directory: str,
    config_settings: object = None,
    metadata_directory: object = None,
) -> str:
    wheel = build.build(stack.load(_ROOT), Path(wheel_directory))
    return wheel.name

"""PEP 517 backend: ``pip install .`` at the repository root installs the patched vLLM.

pip runs this in its isolated build environment. The wheel comes from
``workbench.build`` for the target device (``VLLM_TARGET_DEVICE``, default:
what the machine has); pip then installs it with its dependencies.
"""

from __future__ import annotations

from pathlib import Path

from workbench import build, stack

_ROOT = Path(__file__).resolve().parents[2]


def get_requires_for_build_wheel(config_settings: object = None) -> list[str]:
    if build.target_device() == "cuda":
        return list(build.CUDA_BUILD_REQUIRES)
    return ["wheel"]


def build_wheel(
    wheel_directory: str,
    config_settings: object = None,
    metadata_directory: object = None,
) -> str:
    wheel = build.build(stack.load(_ROOT), Path(wheel_directory))
    return wheel.name

"""The machine line of a report: the CPU, its dtype flags, the Python.

The same description as the project's benchmarks give (their
``bench/machine.py``), so a conformance table and a benchmark say the same
of the machine they ran on. ``report.markdown`` writes it; ``engine``
asks ``native_dtype`` which dtype to serve the tiny model in.
"""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path
from typing import Literal

# The flags that decide which dtypes this CPU runs natively.
DTYPE_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def cpu() -> tuple[str, list[str]]:
    """The CPU's model name and which of ``DTYPE_FLAGS`` it has."""
    model, flags = "unknown CPU", set[str]()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown CPU":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    return model, [f for f in DTYPE_FLAGS if f in flags]


def describe() -> str:
    """``<model>, <n> cores, flags <...> (no <...>), Python <version>``."""
    model, present = cpu()
    absent = [f for f in DTYPE_FLAGS if f not in present]
    flags = f"flags {' '.join(present) or 'none'}"
    if absent:
        flags += f" (no {' '.join(absent)})"
    return (
        f"{model}, {os.cpu_count()} cores, {flags}, Python {platform.python_version()}"
    )


def native_dtype() -> Literal["bfloat16", "float32"]:
    """``bfloat16`` where the CPU computes it natively, else ``float32``
    (without AVX512-BF16 or AMX every bf16 op is converted, slower and noisier
    than float32 on such a CPU)."""
    _, present = cpu()
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(present) else "float32"

"""The machine a benchmark ran on, for the first line of every result.

Machines of the same kind differ (Intel with AMX, AMD without AVX-512): bf16
matmuls run ~57x slower on a CPU without native bf16, so a result that does not
say which CPU and which of those flags it had cannot be compared with another.
"""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path

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


def native_dtype() -> str:
    """``bfloat16`` where the CPU computes it natively, else ``float32``.

    Without AVX512-BF16 or AMX, vLLM's CPU kernels convert bf16 on every op, so a
    benchmark in bf16 there measures the conversion, not the system under test.
    """
    _, present = cpu()
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(present) else "float32"


if __name__ == "__main__":
    print(describe())

"""The scheduler-step estimator of ``./wb bench`` and the machine line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import machine  # noqa: E402
import run  # noqa: E402


def test_each_step_costs_its_fastest_sample() -> None:
    # Step 0 was slowed in the first repetition, step 1 in the second.
    assert run.fastest_step_sum([[1.0, 5.0], [3.0, 2.0]]) == pytest.approx(1.5)


def test_repetitions_of_different_lengths_are_refused() -> None:
    with pytest.raises(ValueError):
        run.fastest_step_sum([[1.0, 2.0], [1.0]])


def _result(per_step: list[float]) -> dict[str, object]:
    return {"vllm": "x", "results": {"none/64": [per_step]}}


def test_the_table_reports_the_control_beside_the_ratio() -> None:
    lines, per_config = run.scheduler_section(
        {
            "unpatched": [_result([1e-3, 1e-3]), _result([2e-3, 1e-3])],
            "patched": [_result([1.1e-3, 1.1e-3])],
            "control": [_result([1e-3, 1.02e-3])],
        }
    )
    assert per_config["none/64"]["unpatched"] == pytest.approx((1e-3, 1e-3, 1.5e-3))
    row = next(line for line in lines if line.startswith("| none | 64 |"))
    assert "1.100 (**missed**, target ≤ 1.01)" in row
    assert row.endswith("| 1.010 |")
    # The control is off by 1.0%, the patched ratio by 10%: resolved.
    assert lines[-1].startswith("The control (unpatched against itself) reads 1.010")
    assert "0 of 1 are no further from 1 than that error" in lines[-1]


def test_a_ratio_inside_the_controls_error_is_not_a_measured_cost() -> None:
    line = run.resolution(
        {
            "none/64": {
                "unpatched": (1.0, 1.0, 1.0),
                "patched": (1.05, 1.05, 1.05),
                "control": (1.08, 1.08, 1.08),
            }
        }
    )
    assert "error is up to 8.0%, above the 1%" in line
    assert "1 of 1 are no further from 1" in line


def test_the_machine_line_names_the_dtype_flags() -> None:
    line = machine.describe()
    assert "avx512_bf16" in line and "cores" in line
    assert machine.native_dtype() in ("bfloat16", "float32")

"""regress on a small synthetic test tree: real pytest runs, a real baseline file."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from workbench import regress

TESTS = '''
import pytest


def test_ok():
    pass


def test_now_fails():
    assert False


@pytest.mark.parametrize("x", [1, 2])
def test_param(x):
    assert x == 1


@pytest.fixture
def broken():
    raise RuntimeError("setup")


def test_setup_error(broken):
    pass


def test_skipped():
    pytest.skip("not here")


def test_reads_offline_hf_cache():
    import os
    from pathlib import Path

    hub = Path(os.environ["HF_HOME"]) / "hub" / "models--facebook--opt-125m"
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert (hub / "refs" / "main").is_file()
'''


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_sample.py").write_text(TESTS)
    return tmp_path


def test_outcomes_by_node_id(tree: Path):
    outcomes = regress.run_tests(Path(sys.executable), tree, ["tests"], [])
    assert outcomes == {
        "tests/test_sample.py::test_ok": "passed",
        "tests/test_sample.py::test_now_fails": "failed",
        "tests/test_sample.py::test_param[1]": "passed",
        "tests/test_sample.py::test_param[2]": "failed",
        "tests/test_sample.py::test_setup_error": "error",
        "tests/test_sample.py::test_skipped": "skipped",
        "tests/test_sample.py::test_reads_offline_hf_cache": "passed",
    }


def test_baseline_test_that_fails_is_a_regression(tree: Path, tmp_path: Path, capsys):
    baseline = tmp_path / "baseline.txt"
    baseline.write_text(
        "# header\n"
        "tests/test_sample.py::test_ok\n"
        "tests/test_sample.py::test_now_fails\n"
        "tests/test_sample.py::test_gone\n"
        "tests/other.py::test_outside_selection\n"
    )
    argv = ["--python", sys.executable, "--tests-from", str(tree)]
    selection = "tests/test_sample.py"
    status = regress.main([*argv, "--baseline", str(baseline), selection])
    out = capsys.readouterr().out
    assert status == 1
    assert "REGRESSION: tests/test_sample.py::test_now_fails (failed)" in out
    assert "REGRESSION: tests/test_sample.py::test_gone (not run)" in out
    assert "test_outside_selection" not in out
    assert "regress: 2 regressions" in out


def test_record_then_compare_is_clean(tree: Path, tmp_path: Path, capsys):
    baseline = tmp_path / "baseline.txt"
    argv = ["--python", sys.executable, "--tests-from", str(tree)]
    argv += ["--baseline", str(baseline), "tests"]
    assert regress.main([*argv, "--record"]) == 0
    recorded = regress.read_baseline(baseline)
    assert recorded == {
        "tests/test_sample.py::test_ok",
        "tests/test_sample.py::test_param[1]",
        "tests/test_sample.py::test_reads_offline_hf_cache",
    }
    assert regress.main(argv) == 0
    assert "regress: 0 regressions" in capsys.readouterr().out

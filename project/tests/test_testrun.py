"""``./wb test``'s verdicts (``workbench.testrun``), each step fed a real
pytest run or a stand-in for the tool it calls."""

from __future__ import annotations

import sys
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

from conftest import REPO
from workbench import testrun

HOOKS_OUTPUT = """\
ruff check...........................................................Passed
ruff format..........................................................Passed
mypy (strict) on the workbench and the demo..........................Failed
- hook id: mypy
- exit code: 1
mypy (strict) on the connector.................(no files to check)Skipped
"""


def executable(path: Path, body: str) -> Path:
    path.write_text(f"#!{sys.executable}\n{body}\n")
    path.chmod(0o755)
    return path


def test_hooks_verdict_counts_hooks(tmp_path: Path):
    tools = executable(
        tmp_path / "python", f"import sys\nprint({HOOKS_OUTPUT!r}, end='')\nsys.exit(1)"
    )
    verdict = testrun._hooks(tmp_path, tools)
    assert (verdict.passed, verdict.failed) == (2, 1)
    assert verdict.line() == (
        "=== project hooks: FAIL: 2 hooks passed, 1 failed: "
        "mypy (strict) on the workbench and the demo"
    )


def test_project_tests_verdict_counts_pytest_outcomes(tmp_path: Path):
    tests = tmp_path / "project" / "tests"
    tests.mkdir(parents=True)
    (tests / "test_some.py").write_text(
        "import pytest\n"
        "def test_a(): pass\n"
        "def test_b(): pass\n"
        "def test_c(): assert False\n"
        "def test_d(): pytest.skip('no')\n"
    )
    verdict = testrun._project_tests(tmp_path, Path(sys.executable), {}, [])
    assert (verdict.passed, verdict.failed) == (2, 1)
    assert verdict.line() == "=== project tests: FAIL: 2 passed, 1 failed, 1 skipped"


def test_upstream_verdict_counts_regressions_not_known_failures(tmp_path: Path):
    counts = {
        "passed": 900,
        "regressions": 0,
        "known_failures": 51,
        "retired": 2,
        "skipped": 40,
    }
    # A stand-in for `wb regress`: writes the verdict it was asked for.
    executable(
        tmp_path / "wb",
        "import json, sys\n"
        "out = sys.argv[sys.argv.index('--summary-json') + 1]\n"
        f"open(out, 'w').write(json.dumps({counts!r}))\n"
        "print('51 failed, 900 passed')",
    )
    verdict = testrun._upstream_tests(tmp_path, Path(sys.executable))
    assert (verdict.passed, verdict.failed) == (900, 0)
    assert verdict.line().startswith(
        "=== upstream and stack tests: PASS: 0 regressions"
    )
    lines, status = testrun.summary(
        [testrun.Verdict("project tests", 120, 0, "120 passed"), verdict]
    )
    assert status == 0
    assert lines[-1] == "=== 1020 passed, 0 failed ==="


def test_a_step_that_gives_no_verdict_fails(tmp_path: Path):
    executable(tmp_path / "wb", "import sys; sys.exit(2)")
    verdict = testrun._upstream_tests(tmp_path, Path(sys.executable))
    assert verdict.failed == 1
    lines, status = testrun.summary([verdict])
    assert status == 1 and lines[-1] == "=== 0 passed, 1 failed ==="


def test_steps_beside_keep_their_output_in_logs(tmp_path: Path):
    """The hooks, the workbench's tests, ``wb regress``, then the share of
    the end-to-end tests, each with its commands and output in its log,
    nothing on stdout, and their verdicts."""
    tools = executable(
        tmp_path / "python", f"import sys\nprint({HOOKS_OUTPUT!r}, end='')\nsys.exit(1)"
    )
    counts = {"passed": 7, "regressions": 0, "known_failures": 0, "retired": 0}
    executable(
        tmp_path / "wb",
        "import json, sys\n"
        "out = sys.argv[sys.argv.index('--summary-json') + 1]\n"
        f"open(out, 'w').write(json.dumps({counts!r}))\n"
        "print('regress output')",
    )
    tests = tmp_path / "project" / "tests"
    tests.mkdir(parents=True)
    for path in testrun.WORKBENCH_TESTS:
        (tmp_path / path).write_text("def test_a(): pass\n")
    for path in testrun.BESIDE_E2E_TESTS:
        (tmp_path / path).write_text(
            "import os\ndef test_c(): assert os.environ['KVLC_REQUIRE_E2E'] == '1'\n"
        )
    (tests / "test_e2e.py").write_text("def test_b(): pass\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    e2e_env: Future[dict[str, str]] = Future()
    e2e_env.set_result({"KVLC_REQUIRE_E2E": "1"})
    hooks, workbench, upstream, release, e2e = testrun._beside(
        tmp_path, tools, Path(sys.executable), [], logs, e2e_env
    )
    assert (hooks.passed, hooks.failed) == (2, 1)
    # Only the workbench's own test files, none other.
    assert (workbench.passed, workbench.failed) == (len(testrun.WORKBENCH_TESTS), 0)
    assert (upstream.passed, upstream.failed) == (7, 0)
    assert (release.passed, release.failed) == (7, 0)
    assert release.name.endswith(f"on vLLM {testrun.upstream.NEXT_RELEASE}")
    # Only its share of the end-to-end tests, in the environment given.
    assert (e2e.passed, e2e.failed) == (len(testrun.BESIDE_E2E_TESTS), 0)
    assert (logs / "hooks.log").read_text().endswith(HOOKS_OUTPUT)
    assert "--durations=25" in (logs / "workbench-tests.log").read_text()
    # The pytest steps' reports stay for the time table.
    assert (logs / "workbench-tests.xml").is_file()
    assert (logs / "e2e-beside.xml").is_file()
    assert hooks.seconds > 0 and e2e.seconds > 0
    log = (logs / "upstream.log").read_text().splitlines()
    assert log[0].startswith("$ ") and "regress --python" in log[0]
    assert log[1:] == ["regress output"]
    log = (logs / "release.log").read_text().splitlines()
    assert log[0].startswith("$ ") and "release-test --fast --summary-json" in log[0]
    assert f"--junit {logs / 'release.xml'}" in log[0]
    assert log[1:] == ["regress output"]


def test_run_reports_the_steps_beside_after_the_end_to_end_tests(
    tmp_path: Path, monkeypatch, capsys
):
    """The whole of ``./wb test`` with each step's tool stood in for: the
    steps beside finish during the end-to-end tests, and their logs and
    verdicts follow those tests' verdict, then the count."""
    beside_ran = threading.Event()

    def hooks(root, tools, out):
        print("hook output", file=out)
        return testrun.Verdict("project hooks", 3, 0, "3 hooks passed")

    def upstream_tests(root, python, out, junit):
        print("regress output", file=out)
        beside_ran.set()
        return testrun.Verdict("upstream and stack tests", 5, 0, "0 regressions")

    def release_tests(root, out, junit):
        print("release output", file=out)
        return testrun.Verdict("stack tests on the newest release", 6, 0, "ok")

    def project_tests(
        root, python, env, rest, paths=(), ignore=(), name="", out=None, junit=None
    ):
        assert junit is not None and junit.parent == root / "build" / "wb-test"
        assert rest == ["-k", "x"]
        if name == "workbench tests":
            assert paths == testrun.WORKBENCH_TESTS and out is not None
            print("workbench output", file=out)
            return testrun.Verdict(name, 2, 0, "2 passed")
        assert env["KVLC_REQUIRE_E2E"] == "1"
        assert env["KVLC_UPSTREAM_PYTHON"] == str(python)
        if name == "project tests, beside":
            assert paths == testrun.BESIDE_E2E_TESTS and out is not None
            print("beside e2e output", file=out)
            return testrun.Verdict(name, 4, 0, "4 passed")
        assert beside_ran.wait(30), "the steps beside did not run meanwhile"
        assert ignore == testrun.WORKBENCH_TESTS + testrun.BESIDE_E2E_TESTS
        return testrun.Verdict("project tests", 7, 1, "7 passed, 1 failed")

    python = Path(sys.executable)
    monkeypatch.setattr(testrun.syspkgs, "ensure", lambda root: True)
    for name in ("ensure", "ensure_unpatched", "ensure_lmcache"):
        monkeypatch.setattr(testrun.devenv, name, lambda root: python)
    monkeypatch.setattr(testrun, "tools_python", lambda: python)
    monkeypatch.setattr(testrun.upstream, "pristine_tree", lambda: tmp_path)
    monkeypatch.setattr(testrun, "_hooks", hooks)
    monkeypatch.setattr(testrun, "_upstream_tests", upstream_tests)
    monkeypatch.setattr(testrun, "_release_tests", release_tests)
    monkeypatch.setattr(testrun, "_project_tests", project_tests)
    assert testrun.run(tmp_path, ["-k", "x"]) == 1
    out = capsys.readouterr().out
    order = [
        "=== project tests: FAIL: 7 passed, 1 failed",
        "hook output",
        "=== project hooks: PASS: 3 hooks passed",
        "workbench output",
        "=== workbench tests: PASS: 2 passed",
        "regress output",
        "=== upstream and stack tests: PASS: 0 regressions",
        "release output",
        "=== stack tests on the newest release: PASS: ok",
        "beside e2e output",
        "=== project tests, beside: PASS: 4 passed",
        "=== summary",
        "=== 27 passed, 1 failed ===",
        "=== time table: ",
        "=== steps, slowest first (wall time)",
        "=== the 0 slowest of 0 test files",
    ]
    positions = [out.index(line) for line in order]
    assert positions == sorted(positions), out


@pytest.mark.timeout(120)
def test_a_failed_environment_does_not_leave_the_lane_beside_waiting(
    tmp_path: Path, monkeypatch
):
    """If an environment of the end-to-end tests cannot be made, ``./wb
    test`` stops with that error instead of waiting forever in the lane
    beside for the environment of its share."""
    python = Path(sys.executable)
    verdict = testrun.Verdict("step", 1, 0, "1 passed")

    def unpatched(root):
        raise RuntimeError("no index")

    monkeypatch.setattr(testrun.syspkgs, "ensure", lambda root: True)
    monkeypatch.setattr(testrun.devenv, "ensure", lambda root: python)
    monkeypatch.setattr(testrun.devenv, "ensure_unpatched", unpatched)
    monkeypatch.setattr(testrun, "tools_python", lambda: python)
    monkeypatch.setattr(testrun.upstream, "pristine_tree", lambda: tmp_path)
    monkeypatch.setattr(testrun, "_hooks", lambda root, tools, out: verdict)
    monkeypatch.setattr(testrun, "_upstream_tests", lambda *args, **kw: verdict)
    monkeypatch.setattr(testrun, "_release_tests", lambda *args, **kw: verdict)
    monkeypatch.setattr(testrun, "_project_tests", lambda *args, **kw: verdict)
    with pytest.raises(RuntimeError, match="no index"):
        testrun.run(tmp_path, [])


def junit_xml(path: Path, cases: list[tuple[str, str, float]]) -> Path:
    """A pytest JUnit XML report of ``cases`` (classname, name, seconds)."""
    testcases = "".join(
        f'<testcase classname="{classname}" name="{name}" time="{seconds}" />'
        for classname, name, seconds in cases
    )
    path.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite '
        f'name="pytest" tests="{len(cases)}">{testcases}</testsuite></testsuites>'
    )
    return path


def test_time_table_puts_the_slowest_steps_and_test_files_first(tmp_path: Path):
    """Steps by wall time; test files by the sum of their tests' times across
    reports (a test class's tests count for its file; a file of another tree
    is named from the root), the ``top`` slowest only."""
    tree = tmp_path / "build" / "tree"
    for path in ("project/tests/test_a.py", "project/tests/test_b.py",
                 "project/tests/test_c.py", "build/tree/tests/test_d.py",
                 "build/tree/tests/test_e.py"):  # fmt: skip
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    main_lane = junit_xml(
        tmp_path / "main.xml",
        [
            ("project.tests.test_a", "test_one", 1.5),
            ("project.tests.test_b", "test_one", 3.0),
            ("project.tests.test_c", "test_one", 0.5),
            ("project.tests.test_a.TestGroup", "test_two", 2.0),
        ],
    )
    # The other lane: one more test of test_c.
    beside = junit_xml(tmp_path / "beside.xml", [("project.tests.test_c", "t", 1)])
    regress = junit_xml(
        tmp_path / "regress.xml",
        [("tests.test_d", "test_one", 3.4), ("tests.test_e", "test_one", 0.1)],
    )
    lines = testrun.timetable(
        "Some CPU, 2 cores",
        [("hooks", 1.0), ("project tests", 50.0), ("release", 2.5)],
        [
            (main_lane, tmp_path),
            (tmp_path / "missing.xml", tmp_path),
            (beside, tmp_path),
            (regress, tree),
        ],
        tmp_path,
        top=4,
    )
    assert lines == [
        "=== time table: Some CPU, 2 cores",
        "=== steps, slowest first (wall time)",
        "    50.0 s  project tests",
        "     2.5 s  release",
        "     1.0 s  hooks",
        "=== the 4 slowest of 5 test files (their tests' setup + call + teardown)",
        "     3.5 s     2 tests  project/tests/test_a.py",
        "     3.4 s     1 tests  build/tree/tests/test_d.py",
        "     3.0 s     1 tests  project/tests/test_b.py",
        "     1.5 s     2 tests  project/tests/test_c.py",
    ]


def test_workbench_tests_are_test_files_of_the_project():
    assert all((REPO / path).is_file() for path in testrun.WORKBENCH_TESTS)
    assert all((REPO / path).is_file() for path in testrun.BESIDE_E2E_TESTS)

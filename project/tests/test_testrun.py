"""``./wb test``'s verdicts (``workbench.testrun``), each step fed a real
pytest run or a stand-in for the tool it calls."""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import REPO
from workbench import lanes, testrun

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


def stand_in_wb(tmp_path: Path, passed: int) -> None:
    """A stand-in for ``wb regress`` and ``wb release-test``: writes the
    verdict it was asked for."""
    counts = {"passed": passed, "regressions": 0, "known_failures": 0, "retired": 0}
    executable(
        tmp_path / "wb",
        "import json, sys\n"
        "out = sys.argv[sys.argv.index('--summary-json') + 1]\n"
        f"open(out, 'w').write(json.dumps({counts!r}))\n"
        "print('regress output')",
    )


def test_a_lane_runs_its_steps_then_its_test_files_each_with_its_log(
    tmp_path: Path,
):
    """The workbench's test files in one pytest run of their own python;
    once the environments are made, the release's step; once .venv is made,
    the hooks and upstream's step, then the project's test files in one
    more pytest run, in the environments' variables; each with its log and
    verdict, nothing on stdout but the verdict lines."""
    tools = executable(
        tmp_path / "python", f"import sys\nprint({HOOKS_OUTPUT!r}, end='')\nsys.exit(1)"
    )
    stand_in_wb(tmp_path, 7)
    tests = tmp_path / "project" / "tests"
    tests.mkdir(parents=True)
    workbench = testrun.WORKBENCH_TESTS[:2]
    for path in workbench:
        (tmp_path / path).write_text("def test_a(): pass\n")
    for name in ("test_e2e.py", "test_other.py"):
        (tests / name).write_text(
            "import os\ndef test_c(): assert os.environ['KVLC_REQUIRE_E2E'] == '1'\n"
            "def test_d(): assert os.environ['KVLC_UPSTREAM_PYTHON'] == 'up'\n"
        )
    (tests / "test_not_in_the_share.py").write_text("def test_e(): assert False\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    share = [
        lanes.Job("project/tests/test_e2e.py", 9, needs_envs=True),
        lanes.Job(testrun.HOOKS, 8),
        lanes.Job(workbench[0], 7),
        lanes.Job(testrun.RELEASE, 6, needs_envs=True),
        lanes.Job(testrun.UPSTREAM, 5),
        lanes.Job(workbench[1], 4),
        lanes.Job("project/tests/test_other.py", 3, needs_envs=True),
    ]
    envs: Future[dict[str, str]] = Future()
    # The workbench's tests run before .venv is made, in their own python.
    workbench_python = executable(
        tmp_path / "workbench-python",
        "import os, sys\nos.execv(sys.executable, [sys.executable, *sys.argv[1:]])",
    )
    venv: Future[Path] = Future()
    pythons = testrun.Pythons(tools, workbench_python, venv)
    with ThreadPoolExecutor(1) as pool:
        lane = pool.submit(
            testrun._lane, 2, share, tmp_path, pythons, [], logs, envs,
            lambda: {"KVLC_REQUIRE_E2E": "1", "KVLC_UPSTREAM_PYTHON": "up"},
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while not (logs / "release.log").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not (logs / "hooks.log").exists() and not lane.done()
        venv.set_result(Path(sys.executable))
        ran = lane.result()
    assert envs.result()["KVLC_UPSTREAM_PYTHON"] == "up"
    assert [(r.verdict.name, r.verdict.passed, r.verdict.failed) for r in ran] == [
        ("workbench tests, lane 2", 2, 0),
        (f"upstream and stack tests on vLLM {testrun.upstream.NEXT_RELEASE}", 7, 0),
        ("project hooks", 2, 1),
        ("upstream and stack tests", 7, 0),
        ("project tests, lane 2", 4, 0),
    ]
    assert [r.log.name for r in ran] == [
        "workbench-tests-lane-2.log",
        "release.log",
        "hooks.log",
        "upstream.log",
        "project-tests-lane-2.log",
    ]
    assert str(workbench_python) in (logs / "workbench-tests-lane-2.log").read_text()
    assert all(r.verdict.seconds > 0 for r in ran)
    assert (logs / "hooks.log").read_text().endswith(HOOKS_OUTPUT)
    assert "--durations=25" in (logs / "workbench-tests-lane-2.log").read_text()
    # The pytest steps' reports stay for the time table.
    assert (logs / "workbench-tests-lane-2.xml").is_file()
    assert (logs / "project-tests-lane-2.xml").is_file()
    log = (logs / "upstream.log").read_text().splitlines()
    assert log[0].startswith("$ ") and "regress --python" in log[0]
    assert log[1:] == ["regress output"]
    log = (logs / "release.log").read_text().splitlines()
    assert log[0].startswith("$ ") and "release-test --fast --summary-json" in log[0]
    assert f"--junit {logs / 'release.xml'}" in log[0]


def test_plan_puts_the_longest_job_first_where_it_ends_soonest():
    jobs = [lanes.Job(name, seconds) for name, seconds in
            (("a", 5), ("b", 4), ("c", 3), ("d", 3), ("e", 2), ("f", 1))]  # fmt: skip
    shares = lanes.plan(jobs, 2, 0.0)
    assert [[job.name for job in share] for share in shares] == [
        ["a", "d", "f"],
        ["b", "c", "e"],
    ]
    with pytest.raises(ValueError, match="at least 1"):
        lanes.plan(jobs, 0, 0.0)


def test_jobs_needing_the_environments_start_after_lane_0_made_them():
    """Lane 0 spends the environments' time first; a job that needs them
    starts no earlier in any lane, and after its lane's other jobs."""
    jobs = [
        lanes.Job("e2e", 10, needs_envs=True),
        lanes.Job("small e2e", 2, needs_envs=True),
        lanes.Job("hooks", 3),
        lanes.Job("upstream", 6),
    ]
    shares = lanes.plan(jobs, 2, 8.0)
    # upstream and hooks fill lane 1 until the environments are there (9 s);
    # the long e2e file then ends soonest in lane 0 (8 + 10).
    assert [[job.name for job in share] for share in shares] == [
        ["e2e"],
        ["upstream", "hooks", "small e2e"],
    ]


def test_jobs_needing_venv_start_once_it_is_made_and_the_rest_fill_the_wait():
    """.venv is made beside the lanes: the jobs that do not use it (the
    workbench's tests, the release's, which needs only the side
    environments) run meanwhile; a job that uses it starts no earlier."""
    jobs = [
        lanes.Job("project", 10, needs_envs=True, needs_venv=True),
        lanes.Job("upstream", 6, needs_venv=True),
        lanes.Job("release", 5, needs_envs=True),
        lanes.Job("workbench", 4),
    ]
    shares = lanes.plan(jobs, 2, 0.0, venv_s=5.0)
    # workbench and release fill both lanes until .venv is there (5 s);
    # upstream then ends soonest after workbench (4 -> 5 + 6), project after
    # release (5 + 10).
    assert [[job.name for job in share] for share in shares] == [
        ["workbench", "upstream"],
        ["release", "project"],
    ]
    assert [job.name for job in sorted(jobs, key=lambda job: job.needs)] == [
        "workbench",
        "release",
        "upstream",
        "project",
    ]


def test_jobs_are_every_test_file_and_the_three_steps_with_measured_times(
    tmp_path: Path,
):
    tests = tmp_path / "project" / "tests"
    tests.mkdir(parents=True)
    for name in ("test_x_e2e.py", "conftest.py", "driver.py"):
        (tests / name).write_text("")
    workbench = tmp_path / testrun.WORKBENCH_TESTS[0]
    workbench.write_text("")
    times = {"hooks": 1.0, "project/tests/test_x_e2e.py": 40.0, "gone.py": 9.0}
    jobs = {job.name: job for job in testrun.jobs(tmp_path, times)}
    assert jobs == {
        "hooks": lanes.Job("hooks", 1.0, needs_venv=True),
        "upstream": lanes.Job("upstream", lanes.UNMEASURED_S, needs_venv=True),
        "release": lanes.Job("release", lanes.UNMEASURED_S, needs_envs=True),
        "project/tests/test_x_e2e.py": lanes.Job(
            "project/tests/test_x_e2e.py", 40.0, needs_envs=True, needs_venv=True
        ),
        testrun.WORKBENCH_TESTS[0]: lanes.Job(
            testrun.WORKBENCH_TESTS[0], lanes.UNMEASURED_S
        ),
    }


def test_lane_count_is_the_cores_and_one_as_memory_allows_unless_set(monkeypatch):
    monkeypatch.delenv(testrun.LANES_VAR, raising=False)
    monkeypatch.setattr(testrun.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(testrun, "available_memory", lambda: 21 * 1024**3)
    assert testrun.lane_count() == 3
    monkeypatch.setattr(testrun, "available_memory", lambda: 11 * 1024**3)
    assert testrun.lane_count() == 2
    monkeypatch.setattr(testrun, "available_memory", lambda: 1024**3)
    assert testrun.lane_count() == 1
    monkeypatch.setenv(testrun.LANES_VAR, "5")
    assert testrun.lane_count() == 5
    monkeypatch.setenv(testrun.LANES_VAR, "two")
    with pytest.raises(testrun.WorkbenchError, match="KVLC_TEST_LANES='two'"):
        testrun.lane_count()
    assert testrun.available_memory() > 0


def test_the_measured_times_file_is_sorted_and_read_back(tmp_path: Path):
    path = tmp_path / "project" / "ci" / "test-times.json"
    path.parent.mkdir(parents=True)
    lanes.write(path, {"b": 2.04, "a": 1.0})
    assert path.read_text() == '{\n "a": 1.0,\n "b": 2.0\n}\n'
    assert lanes.load(tmp_path) == {"a": 1.0, "b": 2.0}
    assert lanes.load(tmp_path / "elsewhere") == {}


def test_run_shares_every_job_among_the_lanes_and_reports_them_after(
    tmp_path: Path, monkeypatch, capsys
):
    """The whole of ``./wb test`` with each step's tool stood in for: each
    job runs once, in some lane; the environments are made once, before
    the jobs needing them; the logs and verdicts follow, then the count,
    the time table and the times measured."""
    made: list[str] = []

    def unpatched(root):
        made.append("unpatched")
        return Path("/up/python")

    def hooks(root, tools, out):
        print("hook output", file=out)
        return testrun.Verdict("project hooks", 3, 0, "3 hooks passed")

    def upstream_tests(root, python, out, junit):
        print("regress output", file=out)
        return testrun.Verdict("upstream and stack tests", 5, 0, "0 regressions")

    def release_tests(root, out, junit):
        assert made == ["unpatched", "lmcache", "release"]
        print("release output", file=out)
        return testrun.Verdict("stack tests on the newest release", 6, 0, "ok")

    seen: list[str] = []

    def project_tests(root, python, env, rest, paths=(), name="", out=None, junit=None):
        assert junit is not None and junit.parent == root / "build" / "wb-test"
        assert rest == ["-k", "x"]
        seen.extend(paths)
        assert os.environ["OMP_NUM_THREADS"] == "1"
        if name.startswith("project tests"):
            assert made == ["unpatched", "lmcache", "release"]
            assert env["KVLC_UPSTREAM_PYTHON"] == "/up/python"
        print(f"{name} output", file=out)
        return testrun.Verdict(name, len(paths), 0, f"{len(paths)} passed")

    tests = tmp_path / "project" / "tests"
    tests.mkdir(parents=True)
    files = [*testrun.WORKBENCH_TESTS[:2], "project/tests/test_a.py",
             "project/tests/test_b.py", "project/tests/test_c.py"]  # fmt: skip
    for path in files:
        (tmp_path / path).write_text("")
    python = Path(sys.executable)
    monkeypatch.setenv(testrun.LANES_VAR, "2")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(testrun.syspkgs, "ensure", lambda root: True)
    monkeypatch.setattr(testrun.devenv, "ensure", lambda root: python)
    monkeypatch.setattr(testrun.devenv, "ensure_unpatched", unpatched)
    monkeypatch.setattr(
        testrun.devenv, "ensure_lmcache", lambda root: made.append("lmcache")
    )
    monkeypatch.setattr(
        testrun.release_test, "ensure_env", lambda root: made.append("release")
    )
    monkeypatch.setattr(testrun, "_envs_ready", lambda root: False)
    monkeypatch.setattr(testrun, "tools_python", lambda: python)
    monkeypatch.setattr(testrun, "workbench_test_python", lambda root: python)
    monkeypatch.setattr(testrun.devenv, "is_current", lambda root: False)
    monkeypatch.setattr(testrun.upstream, "pristine_tree", lambda: tmp_path)
    monkeypatch.setattr(testrun, "_hooks", hooks)
    monkeypatch.setattr(testrun, "_upstream_tests", upstream_tests)
    monkeypatch.setattr(testrun, "_release_tests", release_tests)
    monkeypatch.setattr(testrun, "_project_tests", project_tests)
    assert testrun.run(tmp_path, ["-k", "x"]) == 0
    assert sorted(seen) == sorted(files)
    assert made == ["unpatched", "lmcache", "release"]
    out = capsys.readouterr().out
    assert "=== 2 lanes, by the times in project/ci/test-times.json" in out
    summary = out[out.index("=== summary") :]
    assert "=== 19 passed, 0 failed ===" in summary
    for output in ("hook output", "regress output", "release output"):
        assert out.index(output) < out.index("=== summary")
    assert "=== CPU time of the processes it waited for: " in summary
    written = (tmp_path / "build" / "wb-test" / "test-times.json").read_text()
    assert '"environments"' in written and '"hooks"' in written
    # Beside its logs only: the committed times change when a person says so.
    assert not (tmp_path / lanes.TIMES).exists()


def stand_in_steps(tmp_path: Path, monkeypatch, lanes: int) -> None:
    """``./wb test`` on a tree of one test file, every environment made and
    every step passing at once; a test replaces the one it breaks."""
    python = Path(sys.executable)
    verdict = testrun.Verdict("step", 1, 0, "1 passed")
    (tmp_path / "project" / "tests").mkdir(parents=True)
    (tmp_path / "project" / "tests" / "test_a.py").write_text("")
    monkeypatch.setenv(testrun.LANES_VAR, str(lanes))
    monkeypatch.setattr(testrun.syspkgs, "ensure", lambda root: True)
    monkeypatch.setattr(testrun.devenv, "ensure", lambda root: python)
    monkeypatch.setattr(testrun.devenv, "is_current", lambda root: False)
    monkeypatch.setattr(testrun, "tools_python", lambda: python)
    monkeypatch.setattr(testrun, "workbench_test_python", lambda root: python)
    monkeypatch.setattr(testrun.upstream, "pristine_tree", lambda: tmp_path)
    for step in ("_hooks", "_upstream_tests", "_release_tests", "_project_tests"):
        monkeypatch.setattr(testrun, step, lambda *args, **kw: verdict)


def no_index(root: Path) -> Path:
    raise RuntimeError("no index")


@pytest.mark.timeout(120)
def test_a_failed_environment_leaves_no_lane_waiting(tmp_path: Path, monkeypatch):
    """If an environment of the end-to-end tests cannot be made, ``./wb
    test`` stops with that error instead of waiting forever in the lanes
    whose jobs need it."""
    stand_in_steps(tmp_path, monkeypatch, lanes=3)
    monkeypatch.setattr(testrun.devenv, "ensure_unpatched", no_index)
    monkeypatch.setattr(testrun, "_envs_ready", lambda root: False)
    with pytest.raises(RuntimeError, match="no index"):
        testrun.run(tmp_path, [])


@pytest.mark.timeout(120)
def test_a_venv_that_cannot_be_made_stops_the_lanes(tmp_path: Path, monkeypatch):
    """The lanes that wait for .venv get its error instead of waiting
    forever; ``./wb test`` stops with it."""
    stand_in_steps(tmp_path, monkeypatch, lanes=2)
    monkeypatch.setattr(testrun.devenv, "ensure", no_index)
    monkeypatch.setattr(testrun, "_envs_ready", lambda root: True)
    monkeypatch.setattr(testrun, "_side_envs", lambda root, times: {})
    with pytest.raises(RuntimeError, match="no index"):
        testrun.run(tmp_path, [])


def test_workbench_tests_run_in_pytest_of_the_test_requirements(
    tmp_path: Path, monkeypatch
):
    """The workbench's tests' environment holds the test requirements'
    pytest and pytest-timeout, pinned as there, and nothing else."""
    asked = {}

    def tools_python(name, packages):
        asked[name] = dict(packages)
        return Path("/stand-in")

    monkeypatch.setattr(testrun, "tools_python", tools_python)
    assert testrun.workbench_test_python(REPO) == Path("/stand-in")
    pins = (REPO / "project" / "requirements-test.txt").read_text().splitlines()
    assert asked == {
        "workbench-tests": {
            next(line for line in pins if line.startswith("pytest==")): ("pytest",),
            next(line for line in pins if line.startswith("pytest-timeout==")): (
                "pytest_timeout",
            ),
        }
    }


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


def test_cpu_counters_read_the_kernels_busy_and_total_seconds(tmp_path: Path):
    hz = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text(
        f"cpu  {3 * hz} {hz} {2 * hz} {10 * hz} {hz} 0 {hz} 0 {5 * hz} 0\n"
        "cpu0 1 2 3 4 5 6 7 8 9 10\n"
    )
    # Guest time is already in user: busy 3+1+2+1, idle 10+1.
    assert testrun.cpu_counters(stat) == (7.0, 18.0)
    assert testrun.cpu_counters(tmp_path / "missing") is None
    (tmp_path / "other").write_text("intr 1 2 3\n")
    assert testrun.cpu_counters(tmp_path / "other") is None


def test_timetable_says_the_machines_busy_share_between_two_readings(
    tmp_path: Path,
):
    lines = testrun.timetable(
        "Some CPU, 2 cores",
        [("hooks", 1.0)],
        [],
        tmp_path,
        wall_s=100.0,
        counters=((1000.0, 5000.0), (1186.0, 5200.0)),
    )
    assert "=== the machine's CPU time (/proc/stat): 186 s busy of 200 s, 93%" in lines
    assert lines.index("=== steps, slowest first (wall time)") > 1

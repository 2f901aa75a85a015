"""``./wb conformance``'s logic without engines: which connectors run where
with what configuration, the servers' lifecycle (fake processes), the order
of a run's entries, the scrubbing of machine paths, and the kit's merge of
several runs into one document (``vllm-kv-conformance --merge``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from workbench import conformance as wc

sys.path.insert(0, str(REPO / "project" / "conformance" / "src"))
from vllm_kv_conformance import cli as kit_cli  # noqa: E402
from vllm_kv_conformance import report as kit_report  # noqa: E402
from vllm_kv_conformance.results import Report, ScenarioResult  # noqa: E402


class FakeProcess:
    """A server that runs until stopped (or has exited with ``exited``)."""

    def __init__(self, exited: int | None = None) -> None:
        self.returncode = exited
        self.terminated = False

    def poll(self) -> int | None:
        return self.returncode

    def terminate(self) -> None:
        self.terminated = True
        self.returncode = -15

    def kill(self) -> None:
        self.returncode = -9

    def wait(self, timeout: float | None = None) -> int:
        assert self.returncode is not None
        return self.returncode


def _env(key: str = "patched") -> wc.Environment:
    return next(e for e in wc.environments() if e.key == key)


def test_plan_fills_placeholders_and_reports_what_cannot_run() -> None:
    found = wc.Services(
        values={"redis_url": "redis://127.0.0.1:1234/0"},
        missing={wc.MOONCAKE: "mooncake_master exited with 1"},
    )
    importable = {"redis", "kvlc_aibrix"}  # no aibrix_kvcache, no mooncake
    p = wc.plan(_env(), importable, found, Path("build/c/patched"), ".venv/bin/python")
    ran = dict(p.run)
    assert ran["StoreConnector (directory)"]["kv_connector_extra_config"] == {
        "path": "build/c/patched/store"
    }
    redis = ran["StoreConnector (Redis)"]["kv_connector_extra_config"]
    assert redis == {"backend": "redis", "redis_url": "redis://127.0.0.1:1234/0"}
    multi = ran["MultiConnector (StoreConnector, ExampleConnector)"]
    paths = json.dumps(multi)
    assert "build/c/patched/multi-store" in paths and "{scratch}" not in paths
    skipped = p.skipped
    assert skipped["SimpleCPUOffloadConnector"]["not_run"]["status"] == "N/A"
    aibrix = skipped["kvlc-aibrix (AIBrixHookConnector)"]["not_run"]
    assert aibrix == {
        "status": "N/A",
        "reason": "aibrix_kvcache is not installed in .venv/bin/python",
    }
    # Its module is there but its server is not: a failure, not an N/A.
    importable.add("mooncake.store")
    p = wc.plan(_env(), importable, found, Path("s"), "py")
    mooncake = p.skipped["MooncakeStoreConnector"]["not_run"]
    assert mooncake == {
        "status": "FAIL",
        "reason": "not run: mooncake_master exited with 1",
    }
    assert "MOONCAKE_CONFIG_PATH" not in p.env


def test_plan_env_carries_the_running_connectors_settings() -> None:
    found = wc.Services(values={"mooncake_config": "build/c/servers/mooncake.json"})
    importable = {"redis", "kvlc_aibrix", "aibrix_kvcache", "mooncake.store"}
    p = wc.plan(_env(), importable, found, Path("build/c"), "py")
    assert p.env["MOONCAKE_CONFIG_PATH"] == "build/c/servers/mooncake.json"
    assert p.env["AIBRIX_KV_CACHE_OL_SHFS_ROOT"] == "build/c/aibrix-l2"
    # A server is missing only when it was asked for and did not start.
    assert "StoreConnector (Redis)" in dict(p.run)


def test_unpatched_has_no_aibrix_and_each_env_names_its_sources() -> None:
    p = wc.plan(_env("unpatched"), {"redis"}, wc.Services(), Path("s"), "py")
    why = p.skipped["kvlc-aibrix (AIBrixHookConnector)"]["not_run"]["reason"]
    assert "before_update_states" in why
    assert wc.STORE_SRC in _env("unpatched").pythonpath
    assert [c.label for c in _env("lmcache").connectors] == [wc.LMCACHE.label]


def test_services_start_and_always_stop(tmp_path: Path) -> None:
    launched: list[tuple[list[str], FakeProcess]] = []

    def launch(argv: list[str], log: Path) -> FakeProcess:
        proc = FakeProcess()
        launched.append((argv, proc))
        return proc

    ports = iter(range(5000, 5010))
    exes: dict[str, str | None] = {wc.REDIS: "redis-server", wc.MOONCAKE: "master"}
    with (
        pytest.raises(RuntimeError, match="the block failed"),
        wc.services(
            {wc.REDIS, wc.MOONCAKE},
            tmp_path,
            exes,
            launch=launch,
            listening=lambda port: True,
            ports=lambda: next(ports),
        ) as found,
    ):
        assert found.values["redis_url"] == "redis://127.0.0.1:5000/0"
        config = json.loads(Path(found.values["mooncake_config"]).read_text())
        assert config["master_server_address"] == "127.0.0.1:5002"
        assert config["metadata_server"] == "http://127.0.0.1:5001/metadata"
        raise RuntimeError("the block failed")
    assert [argv[0] for argv, _ in launched] == ["redis-server", "master"]
    assert all(proc.terminated for _, proc in launched)


def test_a_server_that_exits_is_missing_and_the_others_run(tmp_path: Path) -> None:
    procs: list[FakeProcess] = []

    def launch(argv: list[str], log: Path) -> FakeProcess:
        proc = FakeProcess(exited=1 if argv[0] == "master" else None)
        procs.append(proc)
        return proc

    exes: dict[str, str | None] = {wc.REDIS: None, wc.MOONCAKE: "master"}
    with wc.services(
        {wc.REDIS, wc.MOONCAKE},
        tmp_path,
        exes,
        launch=launch,
        listening=lambda port: False,
    ) as found:
        assert found.values == {}
        assert "redis-server not found" in found.missing[wc.REDIS]
        assert found.missing[wc.MOONCAKE] == "mooncake_master exited with 1"
    assert len(procs) == 1


def test_merge_entries_keeps_the_environments_order() -> None:
    env = _env("unpatched")
    ran = [{"label": "ExampleConnector (legacy pair)", "report": {}}]
    skipped = {"SimpleCPUOffloadConnector": {"label": "SimpleCPUOffloadConnector"}}
    ran.insert(0, {"label": "StoreConnector (directory)", "report": {}})
    labels = [e["label"] for e in wc.merge_entries(env, ran, skipped)]
    assert labels == [
        "StoreConnector (directory)",
        "ExampleConnector (legacy pair)",
        "SimpleCPUOffloadConnector",
    ]


def test_scrub_and_shown_command() -> None:
    root, home = Path("/x/repo"), Path("/home/u")
    text = "/x/repo/build/a and /home/u/.cache/m and /x/repo"
    assert wc.scrub(text, root, home) == "build/a and ~/.cache/m and ."
    argv = wc.kit_argv(
        ".venv/bin/python", [("A", {"kv_connector": "A"})], "T", Path("o")
    )
    line = wc.shown(argv, {"PYTHONPATH": wc.KIT_SRC})
    assert line.startswith(f"PYTHONPATH={wc.KIT_SRC} \\\n.venv/bin/python -m ")
    assert '\\\n    --kv-transfer-config \'{"kv_connector": "A"}\'' in line


def test_two_ranks_only_for_the_labels_asked() -> None:
    connectors = [("A", {"kv_connector": "A"}), ("B", {"kv_connector": "B"})]
    argv = wc.kit_argv(".venv/bin/python", connectors, "T", Path("o"), tp2=("B",))
    assert argv.count("--tp2") == 1
    assert argv[argv.index("--tp2") + 1] == "B"
    patched = next(e for e in wc.environments() if e.key == "patched")
    labels = {c.label for c in patched.connectors}
    assert patched.tp2 and set(patched.tp2) <= labels


def _run(title: str, failed: bool) -> dict[str, object]:
    report = Report("StoreConnector", "0.32.0", lifecycle=not failed, seed=1)
    report.results = [
        ScenarioResult.passed("miss", "nothing offered"),
        (ScenarioResult.failed if failed else ScenarioResult.passed)("hit", "a|b"),
    ]
    entries = [
        {"label": "Store", "config": {}, "report": kit_report.report_to_dict(report)},
        {
            "label": "Other",
            "config": {},
            "not_run": {"status": "N/A", "reason": "needs X"},
        },
    ]
    return kit_report.run_record(title, "cmd " + title, entries, commit="abc")


def test_kit_merge_writes_one_document_of_several_runs(tmp_path: Path) -> None:
    paths = []
    for title, failed in (("Patched", False), ("Unpatched", True)):
        path = tmp_path / f"{title}.json"
        path.write_text(json.dumps(_run(title, failed)))
        paths.append(path)
    out = tmp_path / "out.md"
    argv = ["--command", "./wb conformance", "--markdown", str(out)]
    for path in paths:
        argv += ["--merge", str(path)]
    assert kit_cli.main(argv) == 1  # the unpatched run has a FAIL
    text = out.read_text()
    assert "```\n./wb conformance\n```" in text
    assert text.index("## Patched") < text.index("## Unpatched")
    assert "| connector | miss | hit |" in text
    assert "| Store | PASS | FAIL |" in text and "| Other | N/A | N/A |" in text
    assert "Not run (N/A): needs X" in text
    assert "| hit | FAIL | a\\|b |" in text
    assert "- commit: `abc`" in text


def test_kit_merge_usage_errors(tmp_path: Path) -> None:
    assert kit_cli.main(["--merge", str(tmp_path / "absent.json")]) == 2
    out = str(tmp_path / "o.md")
    missing = ["--merge", str(tmp_path / "absent.json"), "--markdown", out]
    assert kit_cli.main(missing) == 2
    assert kit_cli.main([]) == 2


def test_report_round_trips_through_json() -> None:
    report = _run("T", True)["entries"][0]["report"]  # type: ignore[index]
    back = kit_report.report_from_dict(json.loads(json.dumps(report)))
    assert back.failed[0].name == "hit" and back.connector == "StoreConnector"


def test_wb_conformance_is_registered() -> None:
    res = subprocess.run(
        [sys.executable, str(REPO / "wb"), "conformance", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0 and "--no-venv" in res.stdout


def test_connector_requirements_are_the_connectors_pins() -> None:
    pins = wc.connector_requirements(REPO)
    assert pins and all(pin.startswith(f"{module}==") for module, pin in pins.items())

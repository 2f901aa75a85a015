"""The conformance kit (project/conformance) against real connectors and planted bugs.

Every engine runs in this process, one after the other (the kit's
``KitEngine``; ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` from conftest.py), so the
file pays one import of vLLM; each connector configuration's report is made
once and shared by the tests that read it. The kit is imported from its
source tree, so the tests check this checkout's kit whether or not it is
installed.

- ``StoreConnector`` (directory store) conforms: every scenario passes or
  is N/A (no asynchronous load by default; TP=2 is not run by the kit).
- ``StoreConnector`` driven through its legacy pair
  (``LegacyStoreConnector``) conforms through the stack's bridge, leases
  checked.
- ``ExampleConnector`` (vLLM's, the legacy pair only) passes through the
  stack's bridge, except ``preemption_while_loading``: its resumed-request
  load reads a file named after the hash of the prompt *and* the generated
  tokens, which it never wrote (``FileNotFoundError`` in its
  ``start_load_kv``). That is upstream's bug, found by the kit, asserted
  here so the table in docs/conformance.md stays honest.
- Three ``StoreConnector`` subclasses with a planted bug each
  (conformance_plants.py) fail the scenario that names the bug and no
  other; ``CONFORMANCE_PLANTS_OFF=1`` removes the plants, and then these
  three tests fail (checked by hand, see the kit's README).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "project" / "conformance" / "src"))

from vllm_kv_conformance import Report, Status  # noqa: E402
from vllm_kv_conformance.cli import main as cli_main  # noqa: E402
from vllm_kv_conformance.report import markdown  # noqa: E402

pytest_plugins = ["pytester"]

# Prompts for which the tiny model's answers to the reference and the control
# prompt differ (test_control_prompt_differs_without_a_connector proves it).
SEED = 20261129
PASS, FAIL, NA = Status.PASS, Status.FAIL, Status.NA

STORE_EXPECTED = {
    "miss": PASS,
    "hit": PASS,
    "correctness": PASS,
    "partial_hit": PASS,
    "preemption_while_loading": PASS,
    "abort_before_load": PASS,
    "abort_after_load": PASS,
    "async_load": NA,
    "step_raises": PASS,
    "legacy_bridge": NA,
    "scheduler_context": PASS,
    "failed_load_recompute": PASS,
    "failed_load_fail": PASS,
    "tensor_parallel_2": NA,
}
EXAMPLE_EXPECTED = {
    "miss": PASS,
    "hit": PASS,
    "correctness": PASS,
    "partial_hit": PASS,
    "preemption_while_loading": FAIL,
    "abort_before_load": PASS,
    "abort_after_load": PASS,
    "async_load": NA,
    "step_raises": PASS,
    "legacy_bridge": PASS,
    "scheduler_context": NA,
    "failed_load_recompute": NA,
    "failed_load_fail": NA,
    "tensor_parallel_2": NA,
}


LEGACY_STORE_EXPECTED = dict(
    STORE_EXPECTED,
    legacy_bridge=PASS,
    # Its legacy pair hands the kit no query_result naming the chunks to damage.
    failed_load_recompute=NA,
    failed_load_fail=NA,
)


def store_config(path: Path, connector: str = "StoreConnector") -> dict[str, Any]:
    module = "kvlc_store" if connector == "StoreConnector" else "conformance_plants"
    return {
        "kv_connector": connector,
        "kv_connector_module_path": module,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"path": str(path)},
    }


@pytest.fixture(scope="module", autouse=True)
def _environment_restored() -> Iterator[None]:
    """The kit's CLI and a KitEngine built here set what vLLM needs in
    ``os.environ`` (run_conformance() restores it itself): the files CI runs
    after this one in the same process, and the servers they start, must not
    inherit it (a logging level of ERROR hid the log lines they read)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_kv_conformance.model import make_model

    return make_model(tmp_path_factory.mktemp("conformance") / "model")


@pytest.fixture(scope="module")
def report(
    model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], Report]]:
    """``report(name)``: the kit's report for one configuration, made once."""
    from vllm_kv_conformance.runner import run_conformance

    root = tmp_path_factory.mktemp("stores")
    configs = {
        "store": store_config(root / "store"),
        "example": {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(root / "example")},
        },
        **{
            plant: store_config(root / plant, plant)
            for plant in (
                "LegacyStoreConnector",
                "PreemptionLeakConnector",
                "AbortLeakConnector",
                "WrongKVConnector",
            )
        },
    }
    made: dict[str, Report] = {}

    def get(name: str) -> Report:
        if name not in made:
            made[name] = run_conformance(configs[name], model_dir=model, seed=SEED)
        return made[name]

    yield get


def statuses(report: Report) -> dict[str, Status]:
    return {r.name: r.status for r in report.results}


def why(report: Report) -> str:
    return "\n".join(f"{r.status.value} {r.name}: {r.reason}" for r in report.results)


def test_store_connector_conforms(report: Callable[[str], Report]) -> None:
    before = dict(os.environ)
    store = report("store")
    assert dict(os.environ) == before, "run_conformance() left os.environ changed"
    assert store.lifecycle
    assert statuses(store) == STORE_EXPECTED, why(store)
    reasons = store.by_name()
    assert "no lease left" in reasons["abort_after_load"].reason
    assert "preempted" in reasons["preemption_while_loading"].reason


def test_example_connector_through_the_bridge(report: Callable[[str], Report]) -> None:
    example = report("example")
    assert statuses(example) == EXAMPLE_EXPECTED, why(example)
    reasons = example.by_name()
    assert "leases: N/A" in reasons["hit"].reason
    # Upstream's bug, reported (see the module docstring).
    preemption = reasons["preemption_while_loading"].reason
    assert "FileNotFoundError" in preemption, preemption


def test_a_legacy_connector_with_leases_through_the_bridge(
    report: Callable[[str], Report],
) -> None:
    """StoreConnector driven through its legacy pair: the bridge, with the
    leases the kit sees (ExampleConnector has none)."""
    legacy = report("LegacyStoreConnector")
    assert statuses(legacy) == LEGACY_STORE_EXPECTED, why(legacy)
    reasons = legacy.by_name()
    assert "no lease left" in reasons["preemption_while_loading"].reason
    assert "lookups" in reasons["hit"].reason


@pytest.mark.parametrize(
    ("plant", "scenario", "says"),
    [
        ("PreemptionLeakConnector", "preemption_while_loading", "lease(s) left open"),
        ("AbortLeakConnector", "abort_after_load", "lease(s) left open"),
        ("WrongKVConnector", "correctness", "loaded another prompt's KV"),
    ],
)
def test_a_planted_bug_fails_its_scenario_only(
    report: Callable[[str], Report], plant: str, scenario: str, says: str
) -> None:
    planted = report(plant)
    expected = dict(STORE_EXPECTED, **{scenario: FAIL})
    assert statuses(planted) == expected, why(planted)
    assert says in planted.by_name()[scenario].reason


def test_control_prompt_differs_without_a_connector(
    model: Path, report: Callable[[str], Report]
) -> None:
    """The correctness scenario's prompts, served by an engine without a
    connector: the control prompt's answer differs from the reference's, and
    both are what the kit took as vLLM's recompute."""
    from vllm_kv_conformance.engine import BLOCK_SIZE, KitEngine
    from vllm_kv_conformance.prompts import make_prompts

    store = report("store")
    engine = KitEngine(model, None)
    try:
        prompts = make_prompts(SEED, engine.vocab_size, BLOCK_SIZE)
        served = engine.run({"p": prompts.reference, "c": prompts.control})
    finally:
        engine.close()
    assert served["p"].token_ids != served["c"].token_ids
    assert served["p"].token_ids == store.references["reference"]
    assert served["c"].token_ids == store.references["control"]


def test_markdown_table(report: Callable[[str], Report]) -> None:
    text = markdown([("StoreConnector", report("store"))], "vllm-kv-conformance ...")
    assert "- machine: " in text and "- commit: `" in text
    assert "| miss | PASS |" in text


def test_cli_refuses_a_config_that_is_not_json(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli_main(["--kv-transfer-config", "{not json"]) == 2
    assert "not JSON" in capsys.readouterr().err


def test_pytest_plugin_makes_a_test_per_scenario(
    pytester: pytest.Pytester, model: Path
) -> None:
    """The plugin as a connector's CI uses it; only the scenario that builds no
    engine, so this costs no engine."""
    pytester.makepyfile(
        test_kv="""
        from vllm_kv_conformance.pytest_plugin import assert_conforms

        def test_kv_conformance(kv_conformance_result):
            assert_conforms(kv_conformance_result)
        """
    )
    result = pytester.runpytest_inprocess(
        "-p",
        "vllm_kv_conformance.pytest_plugin",
        "--kv-conformance-config",
        '{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}',
        "--kv-conformance-only",
        "tensor_parallel_2",
        "--kv-conformance-model",
        str(model),
        "-rs",
    )
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*tensor_parallel_2: not asked for: --tp2*"])


class _Match:
    def __init__(self, num_tokens: int, load_kv_async: bool = False) -> None:
        self.num_tokens = num_tokens
        self.load_kv_async = load_kv_async
        self.query_result = object()


class _Request:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


class _LifecycleConnector:
    """What the recorder wraps: the scheduler-side methods, doing nothing."""

    def prepare_external_match(self, request: Any, num_computed_tokens: int) -> Any:
        return _Match(128)

    def commit_external_match(self, request: Any, blocks: Any, match: Any) -> None:
        return None

    def abort_external_match(self, request: Any, match: Any) -> None:
        return None

    def request_finished(self, request: Any, block_ids: Any) -> Any:
        return False, None


def test_recorder_reports_each_broken_guarantee() -> None:
    """The scheduler-side half of the contract, which vLLM's scheduler keeps
    (so no planted connector can break it): each guarantee the recorder
    checks is reported when broken, with the request's id."""
    from vllm_kv_conformance.recorder import LIFECYCLE, LifecycleRecorder

    connector = _LifecycleConnector()
    recorder = LifecycleRecorder(connector, LIFECYCLE)
    a, b, c = _Request("a"), _Request("b"), _Request("c")
    match = connector.prepare_external_match(a, 0)
    connector.prepare_external_match(a, 0)  # prepared twice
    connector.commit_external_match(a, None, _Match(256))  # more than prepared
    connector.abort_external_match(a, match)  # abort after the commit
    connector.commit_external_match(b, None, _Match(128))  # never prepared
    connector.prepare_external_match(c, 0)
    connector.request_finished(c, [])  # finished with its match open
    connector.request_finished(c, [])  # finished twice
    recorder.end_of_step()
    assert recorder.ledger.violations == [
        "prepare for a while its match is open",
        "commit for a with another query_result",
        "commit of 256 tokens for a, 128 prepared",
        "abort for a of a match that is not open",
        "commit of 128 tokens for b without an open prepared match",
        "c finished with its match still prepared",
        "request_finished called twice for c",
        "match of c still prepared after the step",
    ]
    recorder.uninstall()
    assert "prepare_external_match" not in vars(connector)


def test_a_scheduler_without_the_lifecycle_drives_the_legacy_pair() -> None:
    """vLLM 0.32.0's Scheduler has no ``external_matches``: the kit records
    the legacy pair there (the unpatched release, checked without one)."""
    from vllm_kv_conformance.recorder import LEGACY, driving_mode

    class Scheduler:
        connector = None

    assert driving_mode(Scheduler()) == LEGACY


def _answer(tokens: list[int], cached: int = 0) -> dict[str, Any]:
    return {"token_ids": tokens, "num_cached_tokens": cached}


@pytest.mark.parametrize(
    ("repeat", "status", "says"),
    [
        (_answer([1, 2], cached=256), PASS, "hit 256 tokens"),
        (_answer([1, 2]), FAIL, "took no hit"),
        (_answer([1, 3], cached=256), FAIL, "repeat's tokens [1, 3] differ"),
    ],
)
def test_tensor_parallel_2_judges_what_the_ranks_served(
    repeat: dict[str, Any], status: Status, says: str
) -> None:
    """What the TP=2 child served, judged (the child itself runs in
    ``./wb conformance``: an engine start on two cores is too dear for CI,
    where test_store_tp_e2e.py serves StoreConnector with two ranks)."""
    from vllm_kv_conformance.tp2 import judge

    result = judge(
        {"miss": _answer([1, 2]), "repeat": repeat, "recompute": _answer([1, 2])}
    )
    assert result.status is status
    assert says in result.reason

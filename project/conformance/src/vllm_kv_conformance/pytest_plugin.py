"""The kit as a pytest plugin, for a connector's own CI: one test per scenario.

Load it where asked for (it has no ``pytest11`` entry point, so installing the
kit changes no other test run) and give the connector's config::

    pytest -p vllm_kv_conformance.pytest_plugin \\
        --kv-conformance-config '{"kv_connector": "MyConnector", ...}' tests/test_kv.py

with, in ``tests/test_kv.py``::

    from vllm_kv_conformance.pytest_plugin import assert_conforms

    def test_kv_conformance(kv_conformance_result):
        assert_conforms(kv_conformance_result)

``pytest_generate_tests`` parametrizes every test that takes
``kv_conformance_scenario`` (which ``kv_conformance_result`` does) with the
scenario names; the session fixture ``kv_conformance_report`` runs the kit
once (``runner.run_conformance``) for all of them; ``assert_conforms`` fails
the test of a FAIL and skips that of an N/A, with the scenario's reason. A
suite may override the ``kv_conformance_config`` fixture instead of passing
the option (e.g. to point the store at ``tmp_path_factory``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from vllm_kv_conformance.results import Report, ScenarioResult, Status
from vllm_kv_conformance.runner import SCENARIO_NAMES


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kv-conformance", "vLLM KV connector conformance kit")
    group.addoption(
        "--kv-conformance-config",
        metavar="JSON",
        help="the connector's --kv-transfer-config",
    )
    group.addoption(
        "--kv-conformance-only",
        action="append",
        choices=SCENARIO_NAMES,
        help="run only these scenarios (repeatable)",
    )
    group.addoption("--kv-conformance-model", type=Path, help="tiny model directory")
    group.addoption("--kv-conformance-seed", type=int, help="the prompts' seed")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kv_conformance_scenario" in metafunc.fixturenames:
        only = metafunc.config.getoption("--kv-conformance-only")
        metafunc.parametrize("kv_conformance_scenario", list(only or SCENARIO_NAMES))


@pytest.fixture(scope="session")
def kv_conformance_config(request: pytest.FixtureRequest) -> dict[str, Any]:
    text = request.config.getoption("--kv-conformance-config")
    if not text:
        pytest.skip("no --kv-conformance-config given")
    config = json.loads(text)
    if not isinstance(config, dict):
        raise pytest.UsageError("--kv-conformance-config must be a JSON object")
    return config


@pytest.fixture(scope="session")
def kv_conformance_report(
    request: pytest.FixtureRequest, kv_conformance_config: dict[str, Any]
) -> Report:
    from vllm_kv_conformance.runner import run_conformance

    return run_conformance(
        kv_conformance_config,
        model_dir=request.config.getoption("--kv-conformance-model"),
        seed=request.config.getoption("--kv-conformance-seed"),
        only=request.config.getoption("--kv-conformance-only"),
    )


@pytest.fixture
def kv_conformance_result(
    kv_conformance_report: Report, kv_conformance_scenario: str
) -> ScenarioResult:
    return kv_conformance_report.by_name()[kv_conformance_scenario]


def assert_conforms(result: ScenarioResult) -> None:
    """Fail on FAIL, skip on N/A, each with the scenario's reason."""
    if result.status is Status.FAIL:
        pytest.fail(f"{result.name}: {result.reason}", pytrace=False)
    if result.status is Status.NA:
        pytest.skip(f"{result.name}: {result.reason}")

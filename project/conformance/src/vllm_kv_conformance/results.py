"""What a scenario returns and what a run of the kit reports.

Each scenario function (``scenarios.py``) returns one ``ScenarioResult``;
``runner.run_conformance`` collects them, in the order of
``scenarios.SCENARIOS``, into a ``Report``, which the CLI prints as a table
(``report.py``) and the pytest plugin turns into one test per scenario.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Status(enum.Enum):
    """A scenario's outcome."""

    PASS = "PASS"
    FAIL = "FAIL"
    NA = "N/A"


@dataclass(frozen=True)
class ScenarioResult:
    """One scenario's outcome and one line of why."""

    name: str
    status: Status
    reason: str

    @classmethod
    def passed(cls, name: str, reason: str) -> ScenarioResult:
        return cls(name, Status.PASS, reason)

    @classmethod
    def failed(cls, name: str, reason: str) -> ScenarioResult:
        return cls(name, Status.FAIL, reason)

    @classmethod
    def not_applicable(cls, name: str, reason: str) -> ScenarioResult:
        return cls(name, Status.NA, reason)


@dataclass
class Report:
    """A run of the kit against one connector configuration."""

    connector: str
    """The connector's name as configured (``kv_connector``)."""
    vllm_version: str
    lifecycle: bool
    """Whether this vLLM has the external-match lifecycle (the patch stack)."""
    results: list[ScenarioResult] = field(default_factory=list)
    seed: int = 0
    """The prompts' seed (``prompts.make_prompts``)."""
    references: dict[str, list[int]] = field(default_factory=dict)
    """vLLM's recomputed greedy tokens per prompt name (``reference``,
    ``control``, ``partial``), as the scenarios compared them."""

    def by_name(self) -> dict[str, ScenarioResult]:
        return {r.name: r for r in self.results}

    @property
    def failed(self) -> list[ScenarioResult]:
        return [r for r in self.results if r.status is Status.FAIL]

"""How ``./wb test`` shares its jobs among lanes: by measured time.

A job is a step (the project's hooks, upstream's tests on the pinned release,
on the newest release) or one test file. ``TIMES`` holds each job's seconds
from a clean-clone run; every ``./wb test`` writes the times it measured to
``build/wb-test/test-times.json``, to copy over ``TIMES`` after a change that
moves time. A job missing there counts ``UNMEASURED_S``.

The plan is the longest-processing-time rule: longest job first, each to the
lane where it ends soonest. ``.venv`` is made beside the lanes, and lane 0
makes the side environments first: a job that needs either starts no earlier
than it is made, in whichever lane it lands, and after that lane's jobs that
need less (the order ``Job.needs`` gives).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

TIMES = "project/ci/test-times.json"
# What a new test file is assumed to take until a run measured it: about
# one served engine's start and a few requests on 2 cores.
UNMEASURED_S = 30.0
# The keys of the side environments' and ``.venv``'s making in ``TIMES``.
ENVIRONMENTS = "environments"
VENV = "venv"


@dataclass(frozen=True)
class Job:
    """A step or a test file, its expected seconds, and whether it waits
    for the side environments and for ``.venv``."""

    name: str
    seconds: float
    needs_envs: bool = False
    needs_venv: bool = False

    @property
    def needs(self) -> tuple[bool, bool]:
        """The order a lane runs its jobs in: those that wait for nothing,
        then for the side environments only (made first, and cached), then
        for ``.venv`` only, then for both."""
        return (self.needs_venv, self.needs_envs)


def plan(
    jobs: Sequence[Job], lanes: int, envs_s: float, venv_s: float = 0.0
) -> list[list[Job]]:
    """``jobs`` shared among ``lanes`` lanes, each lane's in the order it
    runs them; lane 0 spends ``envs_s`` making the side environments first,
    while ``.venv`` takes ``venv_s`` beside the lanes."""
    if lanes < 1:
        raise ValueError(f"lanes must be at least 1, not {lanes}")
    ends = [envs_s] + [0.0] * (lanes - 1)
    shares: list[list[Job]] = [[] for _ in range(lanes)]
    order = sorted(jobs, key=lambda job: (job.needs, -job.seconds, job.name))
    for job in order:
        ready = max(
            envs_s if job.needs_envs else 0.0, venv_s if job.needs_venv else 0.0
        )
        starts = [max(end, ready) for end in ends]
        lane = min(range(lanes), key=lambda i: (starts[i] + job.seconds, i))
        ends[lane] = starts[lane] + job.seconds
        shares[lane].append(job)
    return shares


def load(root: Path) -> dict[str, float]:
    """The measured seconds per job (``TIMES``); none if it is missing."""
    path = root / TIMES
    if not path.is_file():
        return {}
    times = json.loads(path.read_text())
    return {str(name): float(seconds) for name, seconds in times.items()}


def write(path: Path, times: Mapping[str, float]) -> None:
    """``times`` as ``TIMES`` holds them: sorted, to a tenth of a second."""
    rounded = {name: round(seconds, 1) for name, seconds in sorted(times.items())}
    path.write_text(json.dumps(rounded, indent=1) + "\n")

"""Checks that the connector's unit tests catch plausible bugs: hand-made
mutations of ``kvlc_store`` (issue 44), each applied alone to a copy of the
package, with the unit tests run against that copy; a mutation the tests
pass ("survived") is a bug they would miss.

Run by hand after changing the connector, not in CI (a few minutes: one
pytest run per mutation), from the repository root::

    .venv/bin/python project/tests/store_mutations.py          # all of them
    .venv/bin/python project/tests/store_mutations.py lease-ttl-in-seconds

The working tree is never edited: each mutation is applied to a copy of
``project/connector/src`` in a temporary directory, put first on
``PYTHONPATH`` for pytest and the processes it starts. Each line says
``killed`` (with the first failing test), ``SURVIVED`` or ``STALE`` (the
text it mutates is gone: the code changed, so write the mutation anew);
the exit status is 1 unless every mutation was killed. The tests run are
the connector's unit files (no engine, no server but a throwaway
redis-server), the ones expected to catch a mutation first, with ``-x``.

To check a change the same way, add the bugs it could plausibly have: a
mutation is an exact text in one file and what replaces it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "project" / "connector" / "src"
TESTS = REPO / "project" / "tests"

# The connector's unit test files: no vLLM engine or server.
UNIT_TESTS = [
    "test_store_units.py",
    "test_store_identity.py",
    "test_store_faults.py",
    "test_store_load.py",
    "test_store_lookup.py",
    "test_store_device_transfer.py",
    "test_store_worker_hit_keys.py",
    "test_store_async_load.py",
    "test_store_prefetch.py",
    "test_store_lazy_offload.py",
    "test_store_plugin.py",
]


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # under kvlc_store/
    old: str  # must occur exactly once in the file
    new: str
    first: str  # the unit test file expected to catch it


MUTATIONS = [
    Mutation(
        "identity-without-quantization",
        "core.py",
        '        "quantization": model.quantization,\n',
        "",
        "test_store_identity.py",
    ),
    Mutation(
        "read-only-on-erofs-only",
        "backends/directory.py",
        "        return e.errno in READ_ONLY_ERRNOS\n",
        "        return e.errno == errno.EROFS\n",
        "test_store_faults.py",
    ),
    Mutation(
        "batched-read-swallows-store-failure",
        "worker_side.py",
        "    except BackendUnavailable as e:\n        return checked, e\n",
        "    except BackendUnavailable:\n        return checked, None\n",
        "test_store_load.py",
    ),
    Mutation(
        "open-error-is-a-miss",
        "backends/directory.py",
        "        fd = os.open(path, os.O_RDONLY)\n    except FileNotFoundError:\n",
        "        fd = os.open(path, os.O_RDONLY)\n    except OSError:\n",
        "test_store_faults.py",
    ),
    Mutation(
        "lease-ttl-in-seconds",
        "backends/redis.py",
        "ttl_ms = max(1, int(ttl_s * 1000))",
        "ttl_ms = max(1, int(ttl_s))",
        "test_store_units.py",
    ),
    Mutation(
        "lookup-ignores-damaged-header",
        "scheduler_side.py",
        "core.bad_chunk(key, e)\n                good = min(good, block)\n",
        "core.bad_chunk(key, e)\n",
        "test_store_lookup.py",
    ),
    Mutation(
        "offer-one-block-longer",
        "scheduler_side.py",
        "num_tokens = min((start + num_blocks) * bs,",
        "num_tokens = min((start + num_blocks + 1) * bs,",
        "test_store_lookup.py",
    ),
    Mutation(
        "offer-past-the-leased-run",
        "scheduler_side.py",
        "        num_blocks = n // core.tp_size\n",
        "        num_blocks = n // core.tp_size + 1\n",
        "test_store_lookup.py",
    ),
    Mutation(
        "chunk-keys-ignore-tp-rank",
        "core.py",
        'return [f"{self.identity}/{h}.{r}" for r in range(self.tp_size)]',
        'return [f"{self.identity}/{h}.0" for r in range(self.tp_size)]',
        "test_store_load.py",
    ),
    Mutation(
        "damaged-chunk-counts-in-worker-hit",
        "worker_side.py",
        "whole = whole and bool(ok)",
        "whole = whole and ok is not None",
        "test_store_worker_hit_keys.py",
    ),
    Mutation(
        "negative-seconds-accepted",
        "config.py",
        "return f if 0 < f < math.inf else None",
        "return f if f and f < math.inf else None",
        "test_store_units.py",
    ),
]


def run(mutation: Mutation, python: str) -> tuple[str, str]:
    """(verdict, detail) of ``mutation``."""
    text = (SRC / "kvlc_store" / mutation.file).read_text()
    if text.count(mutation.old) != 1:
        return "STALE", f"{mutation.file} no longer holds the text it mutates"
    with tempfile.TemporaryDirectory(prefix="kvlc-mutant-") as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(SRC, src, ignore=shutil.ignore_patterns("__pycache__"))
        (src / "kvlc_store" / mutation.file).write_text(
            text.replace(mutation.old, mutation.new)
        )
        files = [mutation.first] + [f for f in UNIT_TESTS if f != mutation.first]
        env = dict(os.environ)
        paths = [str(src), str(REPO / "project"), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        proc = subprocess.run(
            [python, "-m", "pytest", "-p", "no:cacheprovider", "-x", "-q"]
            + ["-o", "addopts=", "--no-header", "-rf"]
            + [str(TESTS / f) for f in files],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    if proc.returncode == 0:
        return "SURVIVED", "every unit test passed"
    failed = re.search(r"^FAILED (\S+)", proc.stdout, re.MULTILINE)
    if proc.returncode != 1 or failed is None:
        tail = proc.stdout.strip().splitlines()[-1:]
        return "ERROR", f"pytest exited {proc.returncode}: {' '.join(tail)}"
    return "killed", f"by {failed.group(1)}"


def main(argv: list[str]) -> int:
    chosen = [m for m in MUTATIONS if not argv or m.name in argv]
    unknown = set(argv) - {m.name for m in MUTATIONS}
    if unknown:
        names = ", ".join(m.name for m in MUTATIONS)
        print(f"unknown mutation(s) {sorted(unknown)}; known: {names}")
        return 2
    survivors = 0
    for mutation in chosen:
        verdict, detail = run(mutation, sys.executable)
        survivors += verdict != "killed"
        print(f"{mutation.name:40} {verdict:8} {detail}", flush=True)
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

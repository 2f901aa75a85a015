"""Checks that the connector's unit tests catch plausible bugs: hand-made
mutations of ``kvlc_store`` (issues 44 and 50: the store, the host tier, the
KV layout header, the trust checks, secrets, settings and the save thread),
each applied alone to a copy of the package, with the unit tests run
against that copy; a mutation the tests pass ("survived") is a bug they
would miss. Each is a bug a user would see (wrong KV served, a secret
printed, a hang, a setting read wrong), not a change of the code's shape.

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
    "test_store_host_tier.py",
    "test_store_kv_layout.py",
    "test_store_security.py",
    "test_store_trust.py",
    "test_store_async_save.py",
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
        "load_path.py",
        "    except BackendUnavailable as e:\n        return checked, e\n",
        "    except BackendUnavailable:\n        return checked, None\n",
        "test_store_load.py",
    ),
    Mutation(
        "open-error-is-a-miss",
        "backends/chunk_files.py",
        "        fd = os.open(path, _OPEN_CHUNK)\n    except FileNotFoundError:\n",
        "        fd = os.open(path, _OPEN_CHUNK)\n    except OSError:\n",
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
        'return [f"{self.key_prefix}/{h}.{r}" for r in range(self.tp_size)]',
        'return [f"{self.key_prefix}/{h}.0" for r in range(self.tp_size)]',
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
        "    return f if math.isfinite(f) and f > 0 else None\n",
        "    return f if math.isfinite(f) and f != 0 else None\n",
        "test_store_security.py",
    ),
    # -- issue 50: the host tier and the save thread
    Mutation(
        "tier-hands-out-a-slot-a-load-copies-from",
        "host_tier.py",
        "                del self._keys[old]\n                if not self._pins[old]:\n"
        "                    self._free.append(old)\n",
        "                del self._keys[old]\n                self._free.append(old)\n",
        "test_store_host_tier.py",
    ),
    Mutation(
        "tier-keeps-a-chunk-the-store-refused",
        "async_save.py",
        "                        if store_up:\n"
        "                            tier.publish(key, slot)\n",
        "                        tier.publish(key, slot)\n",
        "test_store_host_tier.py",
    ),
    Mutation(
        "save-copy-not-after-the-forward",
        "worker_side.py",
        "                    self._device.mark_compute(),\n",
        "                    None,\n",
        "test_store_async_save.py",
    ),
    Mutation(
        "tier-save-copy-not-after-the-forward",
        "async_save.py",
        "                        [tier.addr(slot) for slot in slots],\n"
        "                        job.ready,\n",
        "                        [tier.addr(slot) for slot in slots],\n"
        "                        None,\n",
        "test_store_async_save.py",
    ),
    Mutation(
        "save-thread-bug-leaves-requests-pending",
        "async_save.py",
        "                for save in job.saves[finished:]:\n"
        "                    self._finish(save, False)\n",
        "                pass\n",
        "test_store_async_save.py",
    ),
    # -- the KV layout header and the chunk format
    Mutation(
        "header-without-layout-loads-anywhere",
        "chunk.py",
        "    if layout is not None and header.layout != layout:\n",
        "    if layout and header.layout and header.layout != layout:\n",
        "test_store_kv_layout.py",
    ),
    Mutation(
        "format-3-called-unknown",
        "chunk.py",
        "    if type(version) is int and version < FORMAT_VERSION:\n",
        "    if type(version) is int and version < 3:\n",
        "test_store_kv_layout.py",
    ),
    # -- the store's identity
    Mutation(
        "identity-without-the-config",
        "core.py",
        '        "config": config_content(model.hf_config),\n',
        "",
        "test_store_identity.py",
    ),
    Mutation(
        "identity-without-the-kv-cache-dtype",
        "core.py",
        '        "cache_dtype": str(cache.cache_dtype),\n',
        "",
        "test_store_identity.py",
    ),
    Mutation(
        "identity-keeps-the-configs-path",
        "identity.py",
        '            if not str(k).startswith("_") and k != "transformers_version"\n',
        '            if k != "transformers_version"\n',
        "test_store_identity.py",
    ),
    # -- whom the directory store trusts
    Mutation(
        "store-another-user-made-accepted",
        "store_checks.py",
        "    if st.st_uid == os.geteuid() or not os.access(path, os.W_OK):\n",
        "    if st.st_uid in (os.geteuid(), st.st_uid)"
        " or not os.access(path, os.W_OK):\n",
        "test_store_trust.py",
    ),
    Mutation(
        "writable-store-trusts-its-owner",
        "backends/chunk_files.py",
        "        if read_only:\n            self.uids.add(root_stat.st_uid)\n",
        "        self.uids.add(root_stat.st_uid)\n",
        "test_store_trust.py",
    ),
    Mutation(
        "group-writable-chunk-served",
        "backends/chunk_files.py",
        "        others = stat.S_IWOTH | (0 if self.group_access else stat.S_IWGRP)\n",
        "        others = stat.S_IWOTH\n",
        "test_store_trust.py",
    ),
    Mutation(
        "only-the-parent-above-the-store-checked",
        "store_checks.py",
        "    while probe.parent != probe:\n        probe = probe.parent\n",
        "    for _ in range(1):\n        probe = probe.parent\n",
        "test_store_trust.py",
    ),
    Mutation(
        "path-checked-only-as-resolved",
        "config.py",
        "            check_private(given, bool(group_access))\n            or ",
        "            ",
        "test_store_trust.py",
    ),
    Mutation(
        "store-directories-unchecked",
        "store_checks.py",
        "    for probe in (path, *(path / d for d in "
        '("chunks", "leases", "tmp", "checked"))):\n',
        "    for probe in (path,):\n",
        "test_store_trust.py",
    ),
    Mutation(
        "chunk-opened-through-links",
        "backends/chunk_files.py",
        "_OPEN_CHUNK = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK\n",
        "_OPEN_CHUNK = os.O_RDONLY | os.O_NONBLOCK\n",
        "test_store_trust.py",
    ),
    Mutation(
        "chunk-opened-blocking",
        "backends/chunk_files.py",
        "_OPEN_CHUNK = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK\n",
        "_OPEN_CHUNK = os.O_RDONLY | os.O_NOFOLLOW\n",
        "test_store_trust.py",
    ),
    Mutation(
        "lease-counts-links",
        "backends/directory.py",
        "            if not self._trusted(path, st):\n"
        "                break\n",
        "",
        "test_store_trust.py",
    ),
    # -- secrets and settings
    Mutation(
        "password-file-anyone-may-read-accepted",
        "config.py",
        "        if mode & 0o077:\n",
        "        if mode & 0o022:\n",
        "test_store_trust.py",
    ),
    Mutation(
        "password-env-not-passed-to-the-backend",
        "core.py",
        "            password=redis_password(config),\n"
        "        )\n    assert config.path",
        "            password=redis_password(config)\n"
        "            if config.redis_password_file\n            else None,\n"
        "        )\n    assert config.path",
        "test_store_security.py",
    ),
    Mutation(
        "wrong-scheme-url-prints-its-password",
        "config.py",
        "            if isinstance(raw, str) and redact_url(raw) != raw:\n"
        "                secret, raw = True, redact_url(raw)\n",
        "",
        "test_store_trust.py",
    ),
    Mutation(
        "gigabytes-read-as-gibibytes",
        "config.py",
        '    "gb": 10**9,\n',
        '    "gb": 2**30,\n',
        "test_store_trust.py",
    ),
    Mutation(
        "redis-timeout-up-to-a-day",
        "config.py",
        "        _seconds(MAX_REDIS_TIMEOUT_S),\n",
        "        _seconds(MAX_LEASE_TTL_S),\n",
        "test_store_trust.py",
    ),
    # -- outages, damaged chunks, evictions
    Mutation(
        "failed-write-stops-lookups",
        "core.py",
        '        if what == "read":\n            # A store that cannot be read',
        '        if what == "write":\n'
        '            reads = self._outages.setdefault("read", _Outage(outage.wait_s))\n'
        "            reads.retry_at = outage.retry_at\n"
        '        if what == "read":\n            # A store that cannot be read',
        "test_store_trust.py",
    ),
    Mutation(
        "damaged-keys-remembered-when-writable",
        "scheduler_side.py",
        "if bad and request is not None and not self._core.writable():",
        "if bad and request is not None and self._core.writable():",
        "test_store_trust.py",
    ),
    Mutation(
        "damaged-keys-never-remembered",
        "scheduler_side.py",
        "                    self._core.bad_keys.update("
        "self._core.keys(request.block_hashes[i]))\n",
        "                    pass\n",
        "test_store_trust.py",
    ),
    Mutation(
        "evictions-only-counted",
        "worker_side.py",
        "        core.evicted(evicted or 0)\n",
        '        core.stats.inc("evictions", evicted or 0)\n',
        "test_store_trust.py",
    ),
    Mutation(
        "every-rank-counts-store-tokens",
        "load_path.py",
        "        if self.rank == 0:\n"
        '            self._core.stats.inc("store_loaded_tokens"',
        '        if True:\n            self._core.stats.inc("store_loaded_tokens"',
        "test_store_host_tier.py",
    ),
    Mutation(
        "every-rank-counts-tier-tokens",
        "load_path.py",
        "                if self.rank == 0:\n"
        '                    core.stats.inc("host_tier_loaded_tokens"',
        "                if True:\n"
        '                    core.stats.inc("host_tier_loaded_tokens"',
        "test_store_host_tier.py",
    ),
    # -- issue 58: a full disk and a store failing mid-load
    Mutation(
        "failed-save-backs-off-reads",
        "worker_side.py",
        '            core.unavailable(e, "write")\n',
        "            core.unavailable(e)\n",
        "test_store_faults.py",
    ),
    Mutation(
        "tier-load-counts-past-a-store-failure",
        "load_path.py",
        "                hits = end - sum(1 for j in misses if j < end)\n",
        "                hits = end - len(misses)\n",
        "test_store_host_tier.py",
    ),
    Mutation(
        "loads-and-saves-share-a-stream",
        "device_transfer.py",
        "    return _new_stream(device), _new_stream(device)\n",
        "    shared = _new_stream(device)\n    return shared, shared\n",
        "test_store_device_transfer.py",
    ),
    # -- the record of checked headers (known_chunks.py)
    Mutation(
        "record-outlives-a-reboot",
        "backends/known_chunks.py",
        '        return self.record_dir / f"{self._boot}-{self._at}"\n',
        '        return self.record_dir / f"boot-{self._at}"\n',
        "test_store_lookup.py",
    ),
    Mutation(
        "record-of-any-owner-taken",
        "backends/known_chunks.py",
        "            if st.st_size <= self._record_read or not self._trust.trusted(\n"
        '                path, st, "record of checked chunks"\n'
        "            ):\n",
        "            if st.st_size <= self._record_read:\n",
        "test_store_trust.py",
    ),
    Mutation(
        "record-vouches-for-chunks-not-known-stored",
        "backends/known_chunks.py",
        "            if key in self.stored and self.checked.get(key) != layout\n",
        "            if self.checked.get(key) != layout\n",
        "test_store_lookup.py",
    ),
    Mutation(
        "saves-not-recorded-checked",
        "worker_side.py",
        "                    self.saved.failed.add(save.block_id)\n"
        "        self._vouch_written()\n",
        "                    self.saved.failed.add(save.block_id)\n",
        "test_store_lookup.py",
    ),
    Mutation(
        "save-thread-records-nothing",
        "async_save.py",
        "            self._after_job()\n",
        "",
        "test_store_async_save.py",
    ),
    # -- chunks removed by hand, a full disk (issue 58)
    Mutation(
        "gone-chunk-not-reported",
        "load_path.py",
        "        if gone:\n            core.gone_at_load(gone)\n",
        "",
        "test_store_lookup.py",
    ),
    Mutation(
        "gone-chunk-not-forgotten",
        "backends/directory.py",
        "                self._memory.new_generation()\n"
        "                self._write_size(self._scan_size())\n"
        "                return\n",
        "                return\n",
        "test_store_lookup.py",
    ),
    Mutation(
        "size-not-counted-at-start",
        "backends/directory.py",
        "        with self._locked():\n"
        "            self._write_size(self._scan_size())\n",
        "        if not self._size_path.exists():\n"
        "            with self._locked():\n"
        "                self._write_size(self._scan_size())\n",
        "test_store_lookup.py",
    ),
    Mutation(
        "failed-load-still-known-stored",
        "scheduler_side.py",
        "                    for i in bad:\n"
        "                        self._known.pop(request.block_hashes[i], None)\n",
        "                    pass\n",
        "test_store_trust.py",
    ),
    Mutation(
        "full-disk-lease-backs-off-reads",
        "backends/directory.py",
        "_UNWRITABLE_ERRNOS = READ_ONLY_ERRNOS | {errno.ENOSPC, errno.EDQUOT}\n",
        "_UNWRITABLE_ERRNOS = READ_ONLY_ERRNOS\n",
        "test_store_faults.py",
    ),
    Mutation(
        "scheduler-remembers-blocks-unbounded",
        "scheduler_side.py",
        "        while len(known) > self._known_blocks:\n"
        "            known.popitem(last=False)\n",
        "",
        "test_store_lookup.py",
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

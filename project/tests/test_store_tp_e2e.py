"""StoreConnector with tensor parallelism, and a store damaged while it
serves, end to end: ``vllm serve`` on the CPU build, real HTTP.

A TP=1 server without a connector gives the reference answers while one
TP=2 server (``VLLM_CPU_OMP_THREADS_BIND="0|1"``) starts (a start is mostly
one busy core), with the connector named only by name (its plugin entry
point registers it) on a directory store, shared by the tests below. Its scheduler lookups are off,
so every hit is found by each rank's worker on its own
(``before_update_states``) and the runner takes the minimum across ranks:
ranks that disagree load only their common prefix.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO
from forked_cli import ForkedCli
from kvlc_store.chunk import encode_chunk, read_header
from test_store_connector_e2e import BLOCK, Answer, Engine, prompt

sys.path.insert(0, str(REPO / "project" / "demo"))
import serve_demo  # noqa: E402
from make_model import make_model  # noqa: E402

# Every prompt the tests send; the reference server answers each once.
TAGS = ("tp", "split", "truncated", "foreign", "kv-layout", "deleted")


def first_block_only(text: str) -> str:
    """A prefix of ``text`` whose tokens fill its first block and not its
    second: it shares block 0 (and that block's hash) with ``text``."""
    return text[: len(text) * 3 // 5]


def all_prompts() -> dict[str, str]:
    out = {tag: prompt(tag) for tag in TAGS}
    out["split-head"] = first_block_only(out["split"])
    return out


def start(
    cli: ForkedCli,
    name: str,
    root: Path,
    model: Path,
    tp: int,
    kv: dict[str, Any] | None,
) -> Engine:
    port = serve_demo.free_port()
    # float32, the checkpoint's dtype: TP=2 sums the heads of two ranks in
    # another order than TP=1, and in bfloat16 that flipped a greedy token on
    # an AMD EPYC (bfloat16 without AMX); in float32 the orders agree to
    # rounding noise on every CPU.
    command = serve_demo.server_command(model, port, kv, eager=True) + ["--dtype", "float32"]
    env = serve_demo.server_env()
    if tp > 1:
        command += ["--tensor-parallel-size", str(tp)]
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    log = root / f"{name}.log"
    engine = Engine(
        name, serve_demo.Server(command, env, log, cli.starter(command)), port
    )
    try:
        engine.server.wait_healthy(engine.url, timeout=600)
    except BaseException:
        engine.server.stop()
        raise
    return engine


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("store-tp")


@pytest.fixture(scope="module")
def model(root: Path) -> Path:
    return make_model(root / "model")


@pytest.fixture(scope="module")
def servers(
    root: Path, model: Path, forked_cli: ForkedCli
) -> Iterator[tuple[dict[str, Answer], Engine]]:
    """The reference answers (TP=1, no connector: what every answer below
    must equal), taken while the TP=2 server starts, and that server."""
    kv = {
        "kv_connector": "StoreConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "path": str(root / "store"),
            "scheduler_lookup": False,
        },
    }
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(start, forked_cli, "tp2", root, model, 2, kv)
        try:
            engine = start(forked_cli, "reference", root, model, 1, None)
            try:
                answers = {t: engine.complete(p) for t, p in all_prompts().items()}
            finally:
                engine.server.stop()
        except BaseException:
            if starting.exception() is None:
                starting.result().server.stop()
            raise
        tp2 = starting.result()
    try:
        yield answers, tp2
    finally:
        tp2.server.stop()


@pytest.fixture(scope="module")
def reference(servers: tuple[dict[str, Answer], Engine]) -> dict[str, Answer]:
    return servers[0]


@pytest.fixture(scope="module")
def tp2(servers: tuple[dict[str, Answer], Engine]) -> Engine:
    return servers[1]


def chunk_files(root: Path) -> set[Path]:
    return set((root / "store" / "chunks").rglob("*.[0-9]"))


def assert_matches(answer: Answer, expected: Answer) -> None:
    assert answer.token_ids == expected.token_ids
    # TP=2 sums the heads of two ranks in another order than TP=1 (float32).
    assert answer.logprobs == pytest.approx(expected.logprobs, abs=1e-2)


def test_repeat_hits_on_both_ranks(tp2, reference, root):
    text = prompt("tp")
    before = chunk_files(root)
    miss = tp2.complete(text)
    stored = chunk_files(root) - before
    assert sorted(p.suffix for p in stored) == [".0", ".0", ".1", ".1"]
    hit = tp2.complete(text)
    assert miss.cached_tokens == 0
    assert hit.cached_tokens == 2 * BLOCK
    assert_matches(miss, reference["tp"])
    assert_matches(hit, reference["tp"])
    metrics = tp2.store_metrics()
    assert metrics["vllm:kvlc_store_worker_hit_tokens_total"] >= 2 * BLOCK
    assert metrics["vllm:kvlc_store_leases_open"] == 0


def test_ranks_that_disagree_load_their_common_prefix(tp2, reference, root):
    text = prompt("split")
    tp2.complete(first_block_only(text))  # stores block 0 on both ranks
    before = chunk_files(root)
    tp2.complete(text)  # hits block 0, stores block 1 on both ranks
    block_1 = chunk_files(root) - before
    (rank_1,) = [p for p in block_1 if p.suffix == ".1"]
    rank_1.unlink()
    # Rank 0 finds blocks 0 and 1, rank 1 only block 0: both load block 0.
    again = tp2.complete(text)
    assert again.cached_tokens == BLOCK
    assert_matches(again, reference["split"])
    assert tp2.store_metrics()["vllm:kvlc_store_leases_open"] == 0


def damage_and_repeat(tp2, root, tag: str, damage) -> Answer:
    before = chunk_files(root)
    tp2.complete(prompt(tag))
    for path in chunk_files(root) - before:
        path.write_bytes(damage(path.read_bytes(), path))
    return tp2.complete(prompt(tag))


def test_truncated_chunk_is_a_miss_with_one_warning(tp2, reference, root):
    again = damage_and_repeat(tp2, root, "truncated", lambda data, _: data[:-100])
    assert again.cached_tokens == 0
    assert_matches(again, reference["truncated"])
    assert tp2.server.log_text().count("unusable (truncated payload") >= 1
    third = tp2.complete(prompt("truncated"))  # stored again
    assert third.cached_tokens == 2 * BLOCK
    assert_matches(third, reference["truncated"])


def test_chunk_of_another_identity_is_a_miss(tp2, reference, root):
    def foreign(data: bytes, path: Path) -> bytes:
        header, offset = read_header(data)
        return encode_chunk("0" * 24, str(header["key"]), data[offset:])

    again = damage_and_repeat(tp2, root, "foreign", foreign)
    assert again.cached_tokens == 0
    assert_matches(again, reference["foreign"])
    assert "unusable (foreign chunk" in tp2.server.log_text()
    assert tp2.store_metrics()["vllm:kvlc_store_corrupt_chunks_total"] > 0


def test_chunk_of_another_kv_layout_is_a_miss_and_replaced(tp2, reference, root):
    """Both ranks sent their KV layout to the scheduler (chunks are keyed by
    it); a chunk whose header names another layout (what a server with
    another attention backend or kernel block size writes) is refused by
    each rank's worker lookup and replaced by this server's own save."""

    def other_layout(data: bytes, path: Path) -> bytes:
        header, offset = read_header(data)
        layout = str(header["layout"])
        assert path.parent.parent.name == f"{header['identity']}-{layout}"
        return encode_chunk(
            str(header["identity"]), str(header["key"]), data[offset:], "0" * 16
        )

    again = damage_and_repeat(tp2, root, "kv-layout", other_layout)
    assert again.cached_tokens == 0
    assert_matches(again, reference["kv-layout"])
    log = tp2.server.log_text()
    assert "unusable (written under KV layout '0000000000000000'" in log
    third = tp2.complete(prompt("kv-layout"))  # this server's save replaced them
    assert third.cached_tokens == 2 * BLOCK
    assert_matches(third, reference["kv-layout"])


def test_store_deleted_while_serving_keeps_answering(tp2, reference, root):
    shutil.rmtree(root / "store")
    miss = tp2.complete(prompt("deleted"))  # an HTTP 500 and a dead server before
    assert miss.cached_tokens == 0
    assert_matches(miss, reference["deleted"])
    assert (root / "store" / "chunks").is_dir()
    assert "was missing (deleted?); recreated it empty" in tp2.server.log_text()
    hit = tp2.complete(prompt("deleted"))
    assert hit.cached_tokens == 2 * BLOCK
    assert_matches(hit, reference["deleted"])
    assert tp2.server.proc.poll() is None

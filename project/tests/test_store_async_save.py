"""Saves of a KV cache off the host, on the save thread (``async_save.py``),
on CPU tensors: each copy is queued after the forward that computed its
blocks, and a bug in the thread drops the step's saves, never the requests
waiting for them (vLLM keeps a finished request's blocks until reported).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvlc_store.backends import Data, DirectoryBackend, new_lease_id
from kvlc_store.metadata import SaveSpec, StoreMetadata
from test_store_device_transfer import key, make, wait_finished


@pytest.mark.parametrize("layout", ["kv-split-blocks-dim1", "hnd-strided"])
def test_save_copies_wait_for_the_forward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
):
    """Every copy of a save (through the host tier, or staged for a layout
    pointer copies cannot move) is queued after the event recorded when the
    step's forward was queued: copied before it, the blocks would hold the
    KV of their previous request, stored with a valid digest for good."""
    core, worker, kv, _ = make(tmp_path, layout=layout, tier_blocks=8)
    device = worker._device
    assert device is not None
    forward = object()  # the event ``mark_compute`` records on a GPU
    monkeypatch.setattr(device, "mark_compute", lambda: forward)
    after: list[object] = []
    side = device._side

    @contextlib.contextmanager
    def recording(stream: object, event: object) -> Iterator[object]:
        after.append(event)
        with side(stream, None) as queued_on:
            yield queued_on

    monkeypatch.setattr(device, "_side", recording)
    saves = [SaveSpec(b, [key(b)], req_id="r") for b in range(3)]
    worker.save(StoreMetadata(saves=saves))
    worker.finished_saves({"r"})
    wait_finished(worker, "r")
    assert after and all(event is forward for event in after), after
    assert core.stats.data["stored_chunks"] == 3
    worker.close()


def test_a_bug_in_the_save_thread_still_reports_the_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """An unexpected exception (not a store failure) while saving: logged,
    the step's saves dropped, and the finished request reported so vLLM
    frees its blocks; lazy offload's pinned blocks come back failed."""
    core, worker, kv, backend = make(tmp_path)

    def broken(key: str, data: Data) -> int:
        raise RuntimeError("injected bug")

    monkeypatch.setattr(backend, "put", broken)
    saves = [SaveSpec(0, [key(0)], req_id="r"), SaveSpec(1, [key(1)], pinned=True)]
    worker.save(StoreMetadata(saves=saves))
    worker.finished_saves({"r"})
    wait_finished(worker, "r")
    saved = worker.take_saved()
    assert saved is not None and saved.failed == {1}
    assert core.stats.data.get("stored_chunks", 0) == 0
    worker.close()


@pytest.mark.parametrize("tier_blocks", [0, 8], ids=["staged", "host-tier"])
def test_the_save_thread_records_its_chunks_checked(tmp_path: Path, tier_blocks: int):
    """The headers the save thread wrote are this worker's own: they go to
    the store's record, so any server's first lookup of them reads none."""
    core, worker, kv, _ = make(tmp_path, tier_blocks=tier_blocks)
    saves = [SaveSpec(b, [key(b)], req_id="r") for b in range(3)]
    worker.save(StoreMetadata(saves=saves))
    worker.finished_saves({"r"})
    wait_finished(worker, "r")
    worker.close()  # the thread is done with its last job
    other = DirectoryBackend(tmp_path / "store", 10**9)
    keys = [key(b) for b in range(3)]
    assert other.lease(keys, new_lease_id(), 60) == 3
    assert {k: other.checked().get(k) for k in keys} == dict.fromkeys(
        keys, worker.layout.digest
    )

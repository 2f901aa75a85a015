"""The store's identity: one model is one identity wherever it is mounted
and however its path is written; another model (other weights) or another
dtype never is; ``model_id`` names the model instead of its files."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kvlc_store import identity
from kvlc_store.core import store_identity


def model_dir(path: Path, weights: bytes = b"\x01" * 4096) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (path / "model.safetensors").write_bytes(weights)
    (path / ".cache").mkdir()  # what a hub download leaves: not the model
    (path / ".cache" / "lock").write_text(str(path))
    return path


def server(
    model: str | Path, dtype: str = "bfloat16", model_id: str | None = None
) -> str:
    vllm_config: Any = SimpleNamespace(
        model_config=SimpleNamespace(
            model=str(model),
            revision=None,
            hf_overrides={},
            quantization=None,
            dtype=dtype,
        ),
        cache_config=SimpleNamespace(block_size=16, prefix_caching_hash_algo="sha256"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    kv_cache_config: Any = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l1"], kv_cache_spec="s")]
    )
    return store_identity(vllm_config, kv_cache_config, model_id)


def test_one_model_under_any_path_is_one_identity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    model = model_dir(tmp_path / "build" / "demo-model")
    (tmp_path / "mounted").symlink_to(model)
    copy = tmp_path / "elsewhere" / "demo-model"
    shutil.copytree(model, copy)
    (copy / ".cache" / "lock").write_text("another download")
    monkeypatch.chdir(tmp_path)
    ids = {
        server(model),
        server("build/demo-model"),
        server("./build/../build/demo-model/"),
        server(tmp_path / "mounted"),
        server(copy),
    }
    assert len(ids) == 1


def test_other_weights_or_dtype_never_match(tmp_path: Path):
    model = model_dir(tmp_path / "a")
    tuned = model_dir(tmp_path / "b", weights=b"\x01" * 4095 + b"\x02")
    renamed = model_dir(tmp_path / "c")
    (renamed / "model.safetensors").rename(renamed / "model-00001.safetensors")
    assert len({server(model), server(tuned), server(renamed)}) == 3
    assert server(model, dtype="float32") != server(model)


def test_model_id_names_the_model_instead_of_its_files(tmp_path: Path):
    a = model_dir(tmp_path / "a")
    b = model_dir(tmp_path / "b", weights=b"other")
    assert server(a, model_id="llama-3-8b") == server(b, model_id="llama-3-8b")
    assert server(a, model_id="llama-3-8b") != server(a)
    assert server(a, model_id="x", dtype="float32") != server(a, model_id="x")


def test_hub_models_are_named_by_id_and_revision(tmp_path: Path):
    assert identity.model_identity("org/model", "abc", None) == "hub:org/model@abc"
    assert identity.model_identity("org/model", None, "mine") == "id:mine"

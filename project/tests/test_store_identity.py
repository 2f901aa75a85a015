"""The store's identity: one model is one identity wherever it is mounted
and however its path (or its config's) is written; another model (other
weights), another config (``--hf-config-path``: another RoPE base, its
quantization config and KV scales scheme), another dtype, KV cache dtype,
quantization, ``hf_overrides``, block size, hash algorithm, TP size or KV
cache layout never is; ``model_id`` names the model instead of its files."""

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


ONE_GROUP = [(["l0", "l1"], "FullAttentionSpec(block_size=16, num_kv_heads=8)")]

# What vLLM's ModelConfig.hf_config.to_dict() holds for the test model.
CONFIG = {
    "_name_or_path": "/models/demo",
    "architectures": ["LlamaForCausalLM"],
    "rope_theta": 10000.0,
    "text_config": {"_name_or_path": "/models/demo", "num_key_value_heads": 8},
    "transformers_version": "4.57.0",
}


class HfConfig:
    """A resolved Hugging Face config, as the identity reads it."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings

    def to_dict(self) -> dict[str, Any]:
        return self.settings


def server(
    model: str | Path,
    dtype: str = "bfloat16",
    model_id: str | None = None,
    *,
    quantization: str | None = None,
    hf_overrides: Any = None,
    block_size: int = 16,
    hash_algo: str = "sha256",
    tensor_parallel_size: int = 1,
    groups: list[tuple[list[str], str]] = ONE_GROUP,
    config: dict[str, Any] = CONFIG,
    cache_dtype: str = "auto",
    skip_layers: tuple[str, ...] = (),
) -> str:
    """The identity of a server of ``model`` with this setup (vLLM's
    ``--dtype``, ``--quantization``, ``--hf-overrides``, ``--block-size``,
    ``--prefix-caching-hash-algo``, ``--tensor-parallel-size``,
    ``--kv-cache-dtype``, ``--kv-cache-dtype-skip-layers``; ``groups``: its
    KV cache groups, layers and spec; ``config``: its resolved config)."""
    vllm_config: Any = SimpleNamespace(
        model_config=SimpleNamespace(
            model=str(model),
            revision=None,
            hf_config=HfConfig(config),
            hf_overrides=hf_overrides or {},
            quantization=quantization,
            dtype=dtype,
        ),
        cache_config=SimpleNamespace(
            block_size=block_size,
            prefix_caching_hash_algo=hash_algo,
            cache_dtype=cache_dtype,
            kv_cache_dtype_skip_layers=list(skip_layers),
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=tensor_parallel_size),
    )
    kv_cache_config: Any = SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(layer_names=layers, kv_cache_spec=spec)
            for layers, spec in groups
        ]
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


@pytest.mark.parametrize(
    "setup",
    [
        {"quantization": "fp8"},
        {"hf_overrides": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}},
        # --hf-config-path: the same checkpoint read with another config.
        {"config": {**CONFIG, "rope_theta": 500.0}},
        {"config": {**CONFIG, "text_config": {"num_key_value_heads": 4}}},
        # The checkpoint's quantization config, its KV cache scheme included
        # (static KV scales, per tensor or per head).
        {"config": {**CONFIG, "quantization_config": {"kv_cache_scheme": None}}},
        {
            "config": {
                **CONFIG,
                "quantization_config": {
                    "kv_cache_scheme": {"num_bits": 8, "strategy": "tensor"}
                },
            }
        },
        # fp8 KV: e4m3 and e5m2 are both uint8 in the cache spec.
        {"cache_dtype": "fp8_e4m3"},
        {"cache_dtype": "fp8_e5m2"},
        {"skip_layers": ("0",)},
        {"block_size": 32},
        {"hash_algo": "sha256_cbor"},
        {"tensor_parallel_size": 2},
        # A hybrid model's second group (sliding window), or one layer less.
        {"groups": [*ONE_GROUP, (["l2"], "SlidingWindowSpec(sliding_window=128)")]},
        {"groups": [(["l0"], ONE_GROUP[0][1])]},
        {
            "groups": [
                (["l0", "l1"], "FullAttentionSpec(block_size=16, num_kv_heads=4)")
            ]
        },
    ],
    ids=lambda setup: "-".join(f"{k}={v}" for k, v in setup.items())[:60],
)
def test_same_checkpoint_with_other_kv_never_matches(tmp_path: Path, setup):
    """Two servers of one checkpoint whose KV differs (one quantized with
    fp8, one with a longer context through ``hf_overrides``, another block
    size or TP size, another KV cache layout) never share chunks, whether
    the model is named by its files or by ``model_id``."""
    model = model_dir(tmp_path / "m")
    assert server(model, **setup) != server(model)
    assert server(model, model_id="x", **setup) != server(model, model_id="x")
    assert server(model, **setup) == server(model, **setup)


def test_fp8_formats_never_match_each_other(tmp_path: Path):
    model = model_dir(tmp_path / "m")
    e4m3 = server(model, cache_dtype="fp8_e4m3")
    assert e4m3 != server(model, cache_dtype="fp8_e5m2")


def test_one_config_read_from_two_paths_is_one_identity(tmp_path: Path):
    """What only says where the config was read from (``_name_or_path`` and
    the other ``_`` entries) and the transformers version that wrote it are
    not the config."""
    model = model_dir(tmp_path / "m")
    moved = {
        **CONFIG,
        "_name_or_path": "/elsewhere/config",
        "_commit_hash": "abc",
        "text_config": {"_name_or_path": "/x", "num_key_value_heads": 8},
        "transformers_version": "4.58.0",
    }
    assert server(model, config=moved) == server(model)

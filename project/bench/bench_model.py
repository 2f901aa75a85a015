"""Generate a random-weight model with the shape of Qwen2.5-0.5B for the TTFT
benchmark (``ttft.py``): the real architecture and KV-cache size, no weights
to download.

Contract: ``make_bench_model(out_dir, dtype)`` leaves ``out_dir`` holding
``config.json``, ``model.safetensors``, the demo model's tokenizer
(``project/demo/make_model.py``) and, written last, the marker ``.complete``;
a directory already carrying the marker is returned untouched. The weights
depend only on the fixed seed and the installed library versions. Prompts are
sent as token ids, so the tokenizer only has to exist (and bounds the ids a
prompt may use: vLLM rejects ids past the tokenizer's vocabulary).

Run it with the python of a vLLM install (torch, transformers)::

    python bench_model.py OUT_DIR [--dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "demo"))
from make_model import (  # noqa: E402
    MARKER,
    _lib,
    _remove_stale,
    _train_tokenizer,
    is_complete,
)

SEED = 1234
# Qwen2.5-0.5B's config.json, less what only matters for training or for
# its own tokenizer (the vocabulary size stays: it sizes the embedding).
QWEN25_05B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "use_sliding_window": False,
}
ROPE_THETA = 1_000_000.0
MAX_POSITIONS = 32768


def make_bench_model(out_dir: Path, dtype: str = "bfloat16") -> Path:
    """Create the model in ``out_dir`` unless it is already complete."""
    out_dir = out_dir.resolve()
    if is_complete(out_dir):
        return out_dir
    _remove_stale(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    staging.chmod(0o755)
    try:
        tokenizer_size = _train_tokenizer(staging)
        torch = _lib("torch")
        transformers = _lib("transformers")
        config = transformers.Qwen2Config(
            **QWEN25_05B,
            rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=2,
        )
        config.architectures = ["Qwen2ForCausalLM"]
        torch.manual_seed(SEED)
        model = transformers.Qwen2ForCausalLM(config).to(getattr(torch, dtype))
        model.config.dtype = dtype
        model.save_pretrained(staging, safe_serialization=True)
        (staging / MARKER).write_text(
            f"random weights, Qwen2.5-0.5B shape, {dtype}, tokenizer of "
            f"{tokenizer_size} ids\n"
        )
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args(argv)
    print(make_bench_model(args.out_dir, args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())

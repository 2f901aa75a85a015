"""The kit's tiny model: a random-weight Llama that vLLM serves on CPU.

The project's one model generator (its demo, end-to-end tests and benchmarks
import it through ``project/demo/make_model.py``), here so the kit needs no
checkout of this repository: ``engine.KitEngine`` calls ``make_model`` for the
model directory it is given (``--model``, default a directory in the user's
cache) unless that directory already holds a finished model. Two hidden layers and
128 hidden units: a served step costs milliseconds, and the random weights
(initializer range 0.2) make greedy tokens depend strongly on the prompt, which
the correctness scenario relies on (and checks at every run).

``make_model(out_dir)`` leaves ``out_dir`` holding ``config.json``,
``model.safetensors``, the tokenizer files and, written last, the marker
``.complete``; a directory that carries the marker is returned untouched.
"""

from __future__ import annotations

import importlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

MARKER = ".complete"
SEED = 1234
VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
# Files this script writes: an incomplete directory holding only these is ours
# to replace; anything else there means the path belongs to someone else.
OWN_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        MARKER,
    }
)

# Training text for the tokenizer. Byte-level BPE can encode any string, so the
# corpus only shapes which merges exist, not what can be served.
CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "A key-value cache stores attention keys and values for tokens already seen.",
    "Prefix caching lets a server skip the prefill of a prompt it has seen before.",
    "An external connector saves blocks of the cache and loads them back later.",
    "vLLM is a fast and easy-to-use library for LLM inference and serving.",
    "Blocks hold one hundred and twenty-eight tokens each on the CPU backend.",
    "Greedy decoding picks the most likely token at every step.",
    "The same prompt sent twice should give the same text twice.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ( ) [ ].",
    "User: hello there. Assistant: hello, how can I help you today?",
)

# A minimal template so /v1/chat/completions works too; the demo itself only
# uses /v1/completions.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def _lib(name: str) -> Any:
    """Import ``name`` from the target venv, untyped.

    These libraries belong to the vLLM install under test, not to this project:
    type checkers run without them (or with partial stubs), so they are Any here.
    """
    return importlib.import_module(name)


def is_complete(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds a finished model (its marker exists)."""
    return (out_dir / MARKER).is_file()


def _train_tokenizer(out_dir: Path) -> int:
    """Train a byte-level BPE tokenizer, save it in ``out_dir``; return its size."""
    tk = _lib("tokenizers")
    Tokenizer, decoders, models = tk.Tokenizer, tk.decoders, tk.models
    pre_tokenizers, trainers = tk.pre_tokenizers, tk.trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        # Without the full byte alphabet, text outside CORPUS would hit <unk>.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "</s>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    size: int = tok.get_vocab_size()
    return size


def _write_weights(out_dir: Path, vocab_size: int) -> None:
    """Write ``config.json`` and random ``model.safetensors`` for a tiny Llama."""
    torch = _lib("torch")
    transformers = _lib("transformers")
    LlamaConfig, LlamaForCausalLM = (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
    )

    bos_id, eos_id = 1, 2  # Positions of <s> and </s> in SPECIAL_TOKENS.
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        # vLLM's CPU attention rejects small head sizes (16 fails); 64 works.
        head_dim=64,
        max_position_embeddings=1024,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        tie_word_embeddings=False,
        # Wider than the default 0.02 so the logits of random weights are not
        # near-ties: greedy text should not flip on rounding noise.
        initializer_range=0.2,
    )
    torch.manual_seed(SEED)
    # Saved in float32 (the config's dtype). vLLM serves a float32 checkpoint
    # in bfloat16 unless told otherwise (`--dtype float32`), so the tests'
    # logprob tolerances are bf16 noise.
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)


def _write_json(path: Path, data: dict[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _remove_stale(out_dir: Path) -> None:
    """Remove an incomplete earlier attempt, refusing to touch foreign files."""
    if not out_dir.exists():
        return
    foreign = sorted(p.name for p in out_dir.iterdir() if p.name not in OWN_FILES)
    if foreign:
        raise RuntimeError(
            f"{out_dir} exists, has no {MARKER} marker and holds files this "
            f"script did not write ({', '.join(foreign)}); choose another path"
        )
    shutil.rmtree(out_dir)


def make_model(out_dir: Path) -> Path:
    """Create the tiny model in ``out_dir`` unless it is already complete.

    The model is built in a temporary sibling directory and renamed into place
    with its marker already written, so an interrupted run never leaves a
    directory that looks complete. Returns ``out_dir``.
    """
    out_dir = out_dir.resolve()
    if is_complete(out_dir):
        return out_dir
    _remove_stale(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would surprise whoever shares the model.
    try:
        vocab_size = _train_tokenizer(staging)
        _write_weights(staging, vocab_size)
        (staging / MARKER).write_text("tiny random Llama for the KV connector demo\n")
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir

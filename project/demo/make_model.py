"""Generate a tiny random-weight Llama model directory that vLLM can serve on CPU.

The generator is the conformance kit's (``vllm_kv_conformance.model`` in
``project/conformance/src``, which imports no vLLM), so the kit, the demo,
the end-to-end tests and the benchmarks serve the same model; this module is
its command line and the name they import it by. ``make_model(out_dir)``
leaves ``out_dir`` holding the model and, written last, the marker
``.complete``; the contents depend only on fixed seeds and the installed
library versions. Run it with the interpreter of the vLLM venv under test::

    python make_model.py OUT_DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "conformance" / "src"))
from vllm_kv_conformance.model import (  # noqa: E402
    MARKER,
    _lib,
    _remove_stale,
    _train_tokenizer,
    is_complete,
    make_model,
)

__all__ = [
    "MARKER",
    "_lib",
    "_remove_stale",
    "_train_tokenizer",
    "is_complete",
    "make_model",
]


def main(argv: list[str] | None = None) -> int:
    """CLI: ``make_model.py OUT_DIR``; prints the model directory."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="directory to create")
    args = parser.parse_args(argv)
    print(make_model(args.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())

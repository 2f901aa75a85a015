"""An offline Hugging Face cache holding what upstream's scheduler and connector
tests read from the hub: the config of ``facebook/opt-125m`` (no weights).

Without it, with ``HF_HUB_OFFLINE=1`` those tests fail on a missing config, and
without ``HF_HUB_OFFLINE=1`` every lookup retries for about 30 s when the hub
cannot be reached. The config is what ``transformers.OPTConfig(architectures=
["OPTForCausalLM"], torch_dtype="float16").save_pretrained()`` writes
(transformers 5.19), committed in ``data/`` because the workbench runs without
transformers.
"""

from __future__ import annotations

import shutil
from pathlib import Path

DATA = Path(__file__).parent / "data"
MODELS = {"facebook/opt-125m": DATA / "opt-125m-config.json"}
# Any fixed revision works offline: refs/main points at it.
REVISION = "0" * 40


def write_hf_cache(hf_home: Path) -> Path:
    """Create the cache under ``hf_home`` (to use as ``HF_HOME``); return it."""
    for repo_id, config in MODELS.items():
        repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
        snapshot = repo / "snapshots" / REVISION
        snapshot.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(config, snapshot / "config.json")
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(REVISION)
    return hf_home

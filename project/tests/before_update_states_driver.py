"""Run the demo model once with (or without) RecordedKVConnector; print JSON.

Usage: python before_update_states_driver.py MODEL_DIR CONFIG_JSON
CONFIG_JSON: {"mode": null|"capture"|"load"|"garbage", "path": DIR,
"hit_tokens": [per TP rank], "tp": 1|2, "hit_on": "first"|"continuation",
"max_num_batched_tokens": N (chunked prefill below the prompt length)}. Prints one line starting with
``RESULT `` holding, per prompt, the greedy token ids, their logprobs and
``num_cached_tokens``.
"""

from __future__ import annotations

import json
import sys

PROMPTS = [
    " ".join(
        [
            "A key-value cache stores attention keys and values for tokens already",
            "seen. An external connector saves blocks of that cache and loads them",
            "back later, so a repeated prompt skips most of its prefill.",
        ]
        * 6
    ),
    "An external connector saves blocks of that cache. " * 3,
]


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    model_dir, config = sys.argv[1], json.loads(sys.argv[2])
    kv_transfer_config = None
    if config["mode"] is not None:
        kv_transfer_config = KVTransferConfig(
            kv_connector="RecordedKVConnector",
            kv_connector_module_path="kv_hits_connector",
            kv_role="kv_both",
            kv_connector_extra_config=config,
        )
    llm = LLM(
        model=model_dir,
        max_model_len=1024,
        block_size=128,
        enable_prefix_caching=False,
        tensor_parallel_size=config.get("tp", 1),
        max_num_batched_tokens=config.get("max_num_batched_tokens"),
        # A step may not schedule fewer tokens than sequences.
        max_num_seqs=8 if "max_num_batched_tokens" in config else None,
        kv_transfer_config=kv_transfer_config,
        seed=0,
        # On CPU this is the share of host memory the engine may reserve;
        # keep it small so the test runs beside other work.
        gpu_memory_utilization=0.3,
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1)
    results = []
    for out in llm.generate(PROMPTS, params):
        completion = out.outputs[0]
        assert completion.logprobs is not None
        results.append(
            {
                "prompt_len": len(out.prompt_token_ids or []),
                "token_ids": list(completion.token_ids),
                "logprobs": [
                    lp[tok].logprob
                    for tok, lp in zip(completion.token_ids, completion.logprobs)
                ],
                "num_cached_tokens": out.num_cached_tokens,
            }
        )
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()

"""Start one engine on the demo model, then run the prompts once per line of
stdin; print JSON for each.

Usage: python before_update_states_driver.py MODEL_DIR ENGINE_JSON
ENGINE_JSON: {"connector": true|false (RecordedKVConnector), "tp": 1|2,
"max_num_batched_tokens": N (chunked prefill below the prompt length)}.
Each line of stdin is one run: the JSON of RecordedKVConnector's settings for
its requests (kv_hits_connector.py: {"mode": "capture"|"load"|"garbage",
"path": DIR, "hit_tokens": [per TP rank], "hit_on": "first"|"continuation"}),
or ``{}`` for none. For each run, stdout gets one line starting with
``RESULT `` holding, per prompt, the greedy token ids, their logprobs and
``num_cached_tokens``; everything else this process and the engine print goes
to stderr. The process ends at the end of stdin.
"""

from __future__ import annotations

import json
import os
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
    # The results' own channel: the engine's processes inherit fd 1, and
    # what they print goes to stderr instead.
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    model_dir, engine = sys.argv[1], json.loads(sys.argv[2])
    kv_transfer_config = None
    if engine.get("connector"):
        kv_transfer_config = KVTransferConfig(
            kv_connector="RecordedKVConnector",
            kv_connector_module_path="kv_hits_connector",
            kv_role="kv_both",
        )
    llm = LLM(
        model=model_dir,
        max_model_len=1024,
        block_size=128,
        enable_prefix_caching=False,
        tensor_parallel_size=engine.get("tp", 1),
        max_num_batched_tokens=engine.get("max_num_batched_tokens"),
        # A step may not schedule fewer tokens than sequences.
        max_num_seqs=8 if "max_num_batched_tokens" in engine else None,
        kv_transfer_config=kv_transfer_config,
        seed=0,
        # On CPU this is the share of host memory the engine may reserve;
        # keep it small so the test runs beside other work.
        gpu_memory_utilization=0.3,
    )
    for line in sys.stdin:
        run = json.loads(line)
        params = SamplingParams(
            temperature=0.0,
            max_tokens=16,
            logprobs=1,
            extra_args={"recorded_kv": run} if run else None,
        )
        outputs = []
        for out in llm.generate(PROMPTS, params, use_tqdm=False):
            completion = out.outputs[0]
            assert completion.logprobs is not None
            outputs.append(
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
        print("RESULT " + json.dumps(outputs), file=results, flush=True)


if __name__ == "__main__":
    main()

"""StoreConnector's saves off the forward's path under vLLM's real scheduler.

Run in a subprocess by ``test_store_device_transfer.py`` (the model config
comes from a fake Hugging Face cache, read when vLLM is imported). One
connector object plays both sides: the scheduler's (``scheduler_harness``)
and one worker's, over a KV cache of CPU tensors on the batched path, with a
directory store. A prompt of two blocks and a token is computed in one step
and finishes there (``max_tokens=1``); each step then runs the worker's hooks
(``wait_for_save``, ``get_finished``) and hands their output back, as the
model runner does. Prints, per mode (CPU: saves in the step; GPU: on the
save thread) and step, the saves planned, the requests reported sent, whether
the request's blocks are still held and how many chunks are stored.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

from vllm import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from testing import scheduler_harness  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 32
EOS_TOKEN_ID = 50256


def run(store: Path, async_saves: bool) -> dict[str, Any]:
    cache_config = CacheConfig(
        block_size=BLOCK_SIZE,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=False,
    )
    scheduler = scheduler_harness.make_scheduler(
        model_config=ModelConfig(
            model="facebook/opt-125m", trust_remote_code=True, dtype="float16", seed=42
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=256,
            max_model_len=256,
            is_encoder_decoder=False,
        ),
        cache_config=cache_config,
        kv_transfer_config=KVTransferConfig(
            kv_connector="StoreConnector",
            kv_connector_module_path="kvlc_store",
            kv_role="kv_both",
            kv_connector_extra_config={"path": str(store)},
        ),
        num_blocks=NUM_BLOCKS,
        device_config=DeviceConfig("cpu"),
    )
    connector: Any = scheduler.connector
    # What the connector decides from a GPU's device config.
    connector._scheduler.async_saves = async_saves
    worker = connector._worker
    kv = torch.randn(2, NUM_BLOCKS * BLOCK_SIZE, 2, 8).to(torch.bfloat16)
    worker.register({"layer": kv}, NUM_BLOCKS, 0)
    if async_saves:
        worker.start_batched_transfers()
    pool = scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()

    params = SamplingParams(max_tokens=1)
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    scheduler.add_request(
        Request(
            request_id="r",
            prompt_token_ids=list(range(100, 100 + 2 * BLOCK_SIZE + 1)),
            sampling_params=params,
            pooling_params=None,
            mm_features=None,
            block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
        )
    )
    steps: list[dict[str, Any]] = []
    # A step of a real engine takes a while: the save thread writes meanwhile.
    for _ in range(3000):
        output = scheduler.schedule()
        meta = output.kv_connector_metadata
        assert meta is not None
        # The worker's step.
        connector.bind_connector_metadata(meta)
        connector.wait_for_save()
        sending, _ = connector.get_finished(output.finished_req_ids)
        connector.clear_connector_metadata()
        req_ids = list(output.num_scheduled_tokens)
        scheduler.update_from_output(
            output,
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=[[11] for _ in req_ids],
                logprobs=None,
                prompt_logprobs_dict={},
                pooler_output=[None] * len(req_ids),
                kv_connector_output=KVConnectorOutput(finished_sending=sending)
                if sending
                else None,
            ),
        )
        steps.append(
            {
                "saves": [[s.block_id, s.req_id] for s in meta.saves],
                "sending": sorted(sending or ()),
                "held": "r" in scheduler.requests,
                "free": pool.get_num_free_blocks() == free_before,
                "stored": len(list(store.rglob("*.0"))),
            }
        )
        if not scheduler.has_requests():
            break
        time.sleep(0.01)
    connector.shutdown()
    return {"steps": steps}


def main() -> None:
    root = Path(sys.argv[1])
    init_none_hash(sha256)
    results = {
        mode: run(root / mode, async_saves=mode == "async")
        for mode in ("sync", "async")
    }
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()

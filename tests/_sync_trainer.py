"""Trainer process for tests/test_robustness.py (issue #16 item 6): ``python tests/_sync_trainer.py MODEL_DIR MODE``.

Starts a multiprocess vLLM engine with the weight-sync extension, exercises the sync guards and prints one JSON line
(``RESULT {...}``).  MODE ``orphan``: then sleeps (the test kills this process and checks the engine exits).  MODE
``kill``: then kills the engine's worker and times the next push (must raise WeightSyncError, never hang).
"""

import json
import os
import signal
import sys
import time


def attempt(fn) -> str:
    """``"ok"``, or the ``WeightSyncError`` a push raised (what the test judges), one string."""
    from megatron_consistent.sync import WeightSyncError

    try:
        fn()
        return "ok"
    except WeightSyncError as e:
        return f"WeightSyncError: {e}"


if __name__ == "__main__":
    model_dir, mode = sys.argv[1], sys.argv[2]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from megatron_consistent.conversion import hf_state_dict
    from megatron_consistent.layers import build_consistent_gpt_model
    from megatron_consistent.sync import WORKER_EXTENSION, WeightSyncChannel, pack_update
    from megatron_consistent.rl import TINY_RL_HF_CONFIG

    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", seed=0, gpu_memory_utilization=0.3,
              max_model_len=256, block_size=32, max_num_batched_tokens=64, enforce_eager=True,
              worker_extension_cls=WORKER_EXTENSION)
    ch = WeightSyncChannel(llm, rpc_timeout=60, push_timeout=60)
    model = build_consistent_gpt_model(TINY_RL_HF_CONFIG, seed=1)
    out = {"worker_pids": ch._rpc("mc_sync_watch_parent", os.getpid()),
           "engine_pids": [p.pid for p in llm.llm_engine.engine_core.resources.engine_manager.processes]}

    llm.llm_engine.add_request("inflight-0", TokensPrompt(prompt_token_ids=[5, 6, 7]), SamplingParams(max_tokens=8))
    out["push_inflight"] = attempt(lambda: ch.push_model(model))
    out["version_after_inflight"] = ch.engine_version()
    out["push_inflight_drained"] = attempt(lambda: ch.push_model(model, drained=True))  # the caller vouches for it
    llm.llm_engine.abort_request(["inflight-0"])
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    bad = hf_state_dict(model, model.arch_config)
    bad["model.norm.weight"][0] = float("nan")
    out["push_nan"] = attempt(lambda: ch.push_tensors(bad))
    update = pack_update(bad, ch.version + 1)  # bypass the trainer-side check: the engine must refuse it too
    try:
        out["engine_nan_reply"] = ch._rpc("mc_sync_apply", update)[0]
    finally:
        os.unlink(update["path"])
    out["version_after_nan"] = ch.engine_version()
    out["push_ok"] = attempt(lambda: ch.push_model(model))
    out["version_final"] = ch.engine_version()
    if mode == "kill":
        os.kill(out["worker_pids"][0], signal.SIGKILL)
        t0 = time.monotonic()
        out["push_after_kill"] = attempt(lambda: ch.push_model(model))
        out["push_after_kill_seconds"] = time.monotonic() - t0
        t0 = time.monotonic()
        out["rpc_after_kill"] = attempt(lambda: ch.engine_version())
        out["rpc_after_kill_seconds"] = time.monotonic() - t0
    print("RESULT " + json.dumps(out), flush=True)
    if mode == "orphan":
        while True:
            time.sleep(1)
    os._exit(0)

"""Engine process of the soak (``verify/soak.py``): ``python -m megatron_consistent.verify.soak_engine REQUEST.json RESULT.json``.

Drives vLLM's ``LLMEngine`` step by step with a seeded random request stream: requests arrive a few per step, some are
aborted while running, ``n`` is 1 or 2, the temperature one of two, prompts share prefixes (prefix-cache hits), and the
KV cache is small (``num_gpu_blocks_override``) so the scheduler preempts.  Every finished completion is written with its
prompt, tokens, processed log-probs and temperature (JSON, no pickle); preemptions come from vLLM's own counter.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path


def _prompt(rng: random.Random, prefixes: list[list[int]], vocab: int, max_len: int) -> list[int]:
    tail = [rng.randrange(3, vocab) for _ in range(rng.randint(2, max_len // 2))]
    return (rng.choice(prefixes) + tail)[:max_len] if rng.random() < 0.7 else tail


def run(req: dict) -> dict:
    from tqdm import tqdm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # the CPU engine eager; on a GPU vLLM's default (the plugin compiles the models it can, with CUDA graphs)
    llm = LLM(model=req["model_dir"], skip_tokenizer_init=True, dtype=req["dtype"], seed=req["seed"], gpu_memory_utilization=0.3,
              max_num_batched_tokens=req["max_num_batched_tokens"], max_model_len=req["max_model_len"], block_size=32,
              enable_prefix_caching=True, logprobs_mode="processed_logprobs", enforce_eager=req.get("device") != "cuda",
              disable_log_stats=False, num_gpu_blocks_override=req["kv_blocks"], max_num_seqs=req["max_num_seqs"])
    engine = llm.llm_engine
    rng = random.Random(req["seed"])
    vocab, n_req = req["vocab_size"], req["requests"]
    prefixes = [[rng.randrange(3, vocab) for _ in range(req["prefix_len"])] for _ in range(req["prefix_groups"])]
    running: set[str] = set()
    meta: dict[str, dict] = {}
    finished, aborted, submitted, steps = [], 0, 0, 0
    t0 = time.perf_counter()
    bar = tqdm(total=n_req, desc="soak requests", mininterval=5)
    while submitted < n_req or engine.has_unfinished_requests():
        for _ in range(min(rng.randint(0, 3), n_req - submitted)):
            rid = f"r{submitted}"
            prompt = _prompt(rng, prefixes, vocab, req["max_prompt_len"])
            temperature = rng.choice(req["temperatures"])
            n = rng.choice((1, 2))
            params = SamplingParams(n=n, temperature=temperature, max_tokens=rng.randint(1, req["max_tokens"]), logprobs=0,
                                    ignore_eos=True)  # (no per-request seed: vLLM CPU refuses it)
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
            meta[rid] = {"prompt": prompt, "temperature": temperature, "n": n}
            running.add(rid)
            submitted += 1
            bar.update(1)
        if running and rng.random() < req["abort_probability"]:
            rid = rng.choice(sorted(running))
            engine.abort_request([rid])
            running.discard(rid)
            aborted += 1
        if not engine.has_unfinished_requests():  # step() would wait for outputs that never come
            continue
        for out in engine.step():
            if out.finished and out.request_id in running:
                running.discard(out.request_id)
                m = meta[out.request_id]
                for c in out.outputs:
                    finished.append({"request": out.request_id, "prompt": m["prompt"], "temperature": m["temperature"],
                                     "tokens": list(c.token_ids),
                                     "logprobs": [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]})
        steps += 1
    bar.close()
    seconds = time.perf_counter() - t0
    preemptions = sum(int(getattr(m, "value", 0)) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    return {"finished": finished, "requests": submitted, "aborted": aborted, "steps": steps, "engine_seconds": seconds,
            "preemptions": preemptions, "n2_requests": sum(m["n"] == 2 for m in meta.values())}


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    result = run(json.loads(Path(args[0]).read_text()))
    Path(args[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Engine process for tests/test_robustness.py (issue #16 item 3): ``python tests/_warmup_engine.py MODEL_DIR``.

A consistent engine whose start runs vLLM's profile / warm-up forward (``attn_metadata=None``): compilation on
(``torch.compile`` with the eager backend, quick), unlike the ``enforce_eager`` engines of ``check``.  Prints
``ENGINE-OK <all log-probs finite> <count>``.
"""

import math
import sys

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="bfloat16", seed=0, gpu_memory_utilization=0.3,
              max_num_batched_tokens=64, max_model_len=256, block_size=32, enforce_eager=False,
              compilation_config={"mode": 1, "backend": "eager"})  # 1: STOCK_TORCH_COMPILE -> CPU warm-up profile run
    outs = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7, 8]), TokensPrompt(prompt_token_ids=[9, 10])],
                        SamplingParams(max_tokens=4, logprobs=0, ignore_eos=True), use_tqdm=False)
    lps = [step[t].logprob for o in outs for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
    print("ENGINE-OK", all(math.isfinite(x) for x in lps), len(lps), flush=True)

"""The consistent path inside a real vLLM GPU engine (vllm 0.26 on CUDA): engine modes, trainer vs rollout.

Needs a CUDA device and vLLM's GPU build (``../shared/gpu-vllm/``); skipped otherwise, with the reason.

* the consistent engine gives identical tokens and log-probs eager, compiled without CUDA graphs, and
  compiled with CUDA graphs (vLLM's default), for one mixed batch under chunked prefill and prefix caching;
* ``check`` on CUDA: the Megatron-Core trainer on the GPU recomputes every sampled token's log-prob with
  the same bits as the GPU engine (max_abs = k3 = 0, exact_fraction 1.0), while the stock rows do not.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.engine,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU vLLM engine)"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None or torch.version.cuda is None,
                       reason="needs vLLM's CUDA build (see ../shared/gpu-vllm/README.md)"),
]

DENSE = ["tiny-llama", "tiny-qwen2-mqa", "tiny-qwen3-qknorm-tied"]


def _export(name: str, folder):
    from megatron_consistent.config import ArchConfig, builtin_model_dir, load_hf_config
    from megatron_consistent.conversion import export_hf
    from megatron_consistent.layers import build_consistent_gpt_model

    arch = ArchConfig.from_hf(load_hf_config(builtin_model_dir(name)))
    export_hf(build_consistent_gpt_model(arch, seed=5), arch, folder)
    return arch


def test_engine_bits_same_eager_compiled_and_graphs(tmp_path):
    from megatron_consistent.verify.check import CheckConfig, make_prompts
    from megatron_consistent.verify.rollout import RolloutRequest, run_in_subprocess

    arch = _export("tiny-llama", tmp_path / "model")
    prompts = make_prompts(CheckConfig(num_prompts=24, seed=3), arch.vocab_size)
    runs = {}
    for mode, eager, extra in (("eager", True, {}), ("compiled", False, {"compilation_config": {"cudagraph_mode": "NONE"}}),
                               ("graphs", False, {})):
        req = RolloutRequest(model_dir=str(tmp_path / "model"), prompts=prompts, consistent=True, dtype=arch.dtype,
                             temperature=1.0, max_tokens=32, seed=3, max_num_batched_tokens=64, block_size=16,
                             max_model_len=512, enforce_eager=eager, engine_kwargs={"max_num_seqs": 32, **extra})
        runs[mode] = run_in_subprocess(req, tmp_path / "engines", mode)
        assert "error" not in runs[mode], runs[mode]
        assert runs[mode]["plugin_active"]
    for mode in ("compiled", "graphs"):
        assert runs[mode]["tokens"] == runs["eager"]["tokens"], mode
        assert runs[mode]["logprobs"] == runs["eager"]["logprobs"], mode  # float32 values, exact through JSON


@pytest.mark.parametrize("name", DENSE + ["tiny-qwen3moe-top1"])
def test_check_zero_mismatch_on_cuda(name, tmp_path):
    from megatron_consistent.config import builtin_model_dir
    from megatron_consistent.verify.check import BATCH_INVARIANT_ROW, load_check_config, run_check

    cfg = load_check_config(hf_config=str(builtin_model_dir(name)), num_prompts=64, max_tokens=64, device="cuda",
                            block_size=16, max_num_batched_tokens=64, out_dir=str(tmp_path))
    report = run_check(cfg)
    c = report["consistent"]
    assert "tokens" in c, c
    assert c["max_abs"] == 0 and c["k3"] == 0 and c["exact_fraction"] == 1.0, c
    assert report["zero_mismatch"]
    for row in ("baseline", BATCH_INVARIANT_ROW):
        assert "tokens" in report[row], report[row]
        assert report[row]["max_abs"] > 0, (row, report[row])  # the stock paths do differ from their trainer

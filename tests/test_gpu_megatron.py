"""Megatron-Core on the GPU with the consistent spec (issue #6 part 3).

Runs only where CUDA is present (the H200 via the device tool, with the
megatron-core 0.19.2 wheel carried); CPU machines run the same model checks in
test_layers.py and test_reference_checks.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_consistent.layers import build_consistent_gpt_model, compute_token_logprobs
from megatron_consistent.config import builtin_model_dir
from megatron_consistent.verify.reference import gradient_check

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the GPU path runs the Triton kernels")]

# The GPU attention kernel takes bf16/fp16, so the model runs in bf16: every op rounds its output to bf16
# (unit roundoff 2^-9 = 2e-3), ~20 such roundings per layer forward and backward over 2 layers give an expected
# relative gradient error of ~1e-2; a wrong backward formula gives errors of order 1e-1 .. 1.
BF16_GRAD_REL_TOL = 5e-2


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3-qknorm-tied", "tiny-qwen2-mqa"])
def test_gpu_gradients_vs_float64_reference(name):
    r = gradient_check(builtin_model_dir(name), dtype=torch.bfloat16, device="cuda")
    print(f"{name}: max relative gradient error {r['max_rel_err']:.3e} ({r['worst']}), loss rel err {r['loss_rel_err']:.2e}")
    assert r["max_rel_err"] <= BF16_GRAD_REL_TOL, r["worst"]
    assert r["loss_rel_err"] <= BF16_GRAD_REL_TOL


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3-qknorm-tied"])
def test_gpu_row_alone_equals_row_in_batch(name):
    model = build_consistent_gpt_model(builtin_model_dir(name), seed=3).cuda()
    arch = model.arch_config
    ids = torch.randint(3, arch.vocab_size, (6, 70), generator=torch.Generator().manual_seed(4)).cuda()
    with torch.no_grad():
        batch = compute_token_logprobs(model, ids)
        for i in (0, 3, 5):
            assert torch.equal(compute_token_logprobs(model, ids[i : i + 1])[0], batch[i])
        prefix = compute_token_logprobs(model, ids[:, :33])
    assert torch.equal(prefix, batch[:, :32])


def test_megatron_core_version_recorded():
    import megatron.core

    print("megatron-core", megatron.core.__version__)
    assert megatron.core.__version__

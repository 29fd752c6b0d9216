"""The contract's ``exp`` on the GPU: the one-launch Triton kernel (``kernels/triton/exp.py``, what
:func:`kernels.numerics.exp` hands CUDA tensors) against the torch ops on the same GPU, bitwise, over the whole range
and its edges; and the routing itself.  Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from megatron_consistent.kernels import numerics

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU: the Triton exp kernel (kernels/triton/exp.py)")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_exp_kernel_equals_the_torch_ops_on_the_gpu(dtype):
    from megatron_consistent.kernels.triton.exp import exp_triton

    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.tensor([0.0, -0.0, 90.0, 95.0, -110.0, -120.0, float("inf"), float("-inf"), float("nan")]),
                   torch.rand(1 << 20, generator=g) * 220 - 120]).to(dtype).cuda()
    assert torch.equal(exp_triton(x).view(torch.int32), numerics.exp_torch(x).view(torch.int32))
    assert torch.equal(numerics.exp(x).view(torch.int32), exp_triton(x).view(torch.int32))  # routed
    assert numerics.exp(x.float().requires_grad_()).grad_fn is not None  # a gradient keeps the torch ops

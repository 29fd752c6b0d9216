"""The contract's ``exp`` (:func:`megatron_consistent.kernels.numerics.exp`) over a CUDA tensor in one launch.

Numerics: :func:`.numerics.exp_f32` on every element -- the float64 clamp, range reduction, degree-12 Horner chain and
one rounding to float32 of :func:`kernels.numerics.exp`, each operation its own IEEE operation (mul-add fusion off),
NaN kept -- so the bits of the torch evaluation on the same device (``tests/test_triton_interpret_exp.py`` in Triton's
interpreter against the CPU function, ``tests/test_gpu_ssm.py``'s exp test on the GPU), where the torch evaluation
takes some 30 elementwise launches a call.  Registered as ``("exp", "cuda")``: :func:`kernels.numerics.exp` hands
CUDA tensors that need no gradient to it (the hybrid mixer's decay rates and chunk decays, a few per decode step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import register
from .numerics import exp_f32

BLOCK = 1024


@triton.jit
def _exp_kernel(X, Y, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    tl.store(Y + i, exp_f32(tl.load(X + i, mask=live, other=0.0)), mask=live)


@register("exp", "cuda")
def exp_triton(x: torch.Tensor) -> torch.Tensor:
    """float32 ``exp(x)`` of a floating tensor of any shape, with :func:`kernels.numerics.exp`'s bits."""
    if not x.is_floating_point():
        raise TypeError(f"exp: expected a floating tensor, got {x.dtype}")
    src = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n = src.numel()
    if n:
        _exp_kernel[(triton.cdiv(n, BLOCK),)](src, out, n, BLOCK=BLOCK, enable_fp_fusion=False)
    return out

"""The Mamba-2 mixer's ``dt`` (``clamp(softplus(dt_raw + dt_bias), dt_min, dt_max)``) on CUDA (Triton):
:func:`megatron_consistent.kernels.ssd._mamba_dt_cpu`'s contract in one elementwise launch.

For ``dt_raw [..., H]`` and ``dt_bias [H]`` every element is, in the torch evaluation's order of IEEE operations:

* ``v = float32(dt_raw) + float32(dt_bias)``;
* ``e = exp(v)`` -- :func:`numerics.exp`'s float64 arithmetic (:func:`.numerics.exp_f32`);
* ``sp = v`` where ``v > 20``, else ``e`` where ``v < -20``, else ``log(1 + float64(e))`` -- the ``1 +`` a float64
  add, ``log`` :func:`numerics.log`'s float64 arithmetic (:func:`.numerics.log_f32`: ``frexp`` on the float64 bits,
  the IEEE float64 division, the atanh series by Horner, one rounding to float32; a NaN ``v`` reaches it and gives
  its NaN);
* ``clamp(sp, dt_min, dt_max)`` -- the bounds rounded to float32 as torch rounds the Python scalars, then
  ``max(sp, lo)`` and ``min(., hi)`` as ``(sp < lo) ? lo : sp`` and ``(hi < .) ? hi : .`` (explicit selects: a
  NaN stays NaN with its bits, as torch's clamp propagates it; Triton's ``minimum`` / ``maximum`` / ``clamp`` would
  not say which NaN or bound comes out).

Launched without mul-add fusion (``enable_fp_fusion=False``), every multiply and add is its own IEEE operation, as in
torch's separate kernels: not a new contract but another evaluation of the torch one, with its bits on the same device
(in Triton's interpreter on CPU tensors ``_mamba_dt_cpu``'s, tests/test_triton_interpret_mamba_dt.py; on the GPU the
torch evaluation's there, tests/test_gpu_gated_norm_dt.py).  Elementwise, so an output depends on its own input
alone: not on its position, the batch or the launch.  Returns float32 ``[..., H]``.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from ._common import float32_scalar, next_pow2
from .numerics import exp_f32, log_f32


@triton.jit(do_not_specialize=["n_rows"])
def _mamba_dt_kernel(RAW, BIAS, OUT, n_rows, H, stride_r, lo, hi, BR: tl.constexpr, BH: tl.constexpr):
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    mask = (rows < n_rows)[:, None] & (cols < H)[None, :]
    raw = tl.load(RAW + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    bias = tl.load(BIAS + cols, mask=cols < H, other=0.0).to(tl.float32)
    v = raw + bias[None, :]
    e = exp_f32(v)
    sp = tl.where(v > 20.0, v, tl.where(v < -20.0, e, log_f32(1.0 + e.to(tl.float64))))
    sp = tl.where(sp < lo, lo, sp)
    sp = tl.where(hi < sp, hi, sp)
    tl.store(OUT + rows[:, None] * H + cols[None, :], sp, mask=mask)


def mamba_dt_triton(dt_raw: torch.Tensor, dt_bias: torch.Tensor, dt_min: float, dt_max: float) -> torch.Tensor:
    """``_mamba_dt_cpu(dt_raw, dt_bias, dt_min, dt_max)``'s bits (module docstring): float32 ``[..., H]``; ``dt_raw``
    may be a row-strided view (its last dim contiguous: otherwise copied)."""
    if dt_raw.dim() == 0:
        raise ValueError("mamba_dt: dt_raw needs a head dim, got a scalar")
    heads = dt_raw.shape[-1]
    if tuple(dt_bias.shape) != (heads,):
        raise ValueError(f"mamba_dt: dt_bias {tuple(dt_bias.shape)} does not match {heads} heads")
    if not dt_min <= dt_max:
        raise ValueError(f"mamba_dt: dt_min {dt_min} > dt_max {dt_max}")
    out = torch.empty(dt_raw.shape, dtype=torch.float32, device=dt_raw.device)
    if out.numel() == 0:
        return out
    raw = dt_raw.reshape(-1, heads)
    if raw.stride(-1) != 1:
        raw = raw.contiguous()
    n_rows = raw.shape[0]
    bh = min(next_pow2(heads), 256)
    br = max(1, 1024 // bh)
    _mamba_dt_kernel[(triton.cdiv(n_rows, br), triton.cdiv(heads, bh))](
        raw, dt_bias.contiguous(), out, n_rows, heads, raw.stride(0), float32_scalar(dt_min), float32_scalar(dt_max),
        BR=br, BH=bh, num_warps=4, enable_fp_fusion=False)
    return out

"""The Mamba-2 mixer's gated, grouped RMSNorm forward on CUDA (Triton):
:mod:`megatron_consistent.kernels.gated_rms_norm`'s contract in one launch, one program a (block of rows, group).

For ``y, z [..., D]``, ``D = n_groups * group_size``, each program evaluates, for its rows and its group's channels,
the IEEE operations of :func:`kernels.gated_rms_norm._gated_rms_norm_cpu` in its order:

* ``zf = float32(z)``; ``h = float32(y) * (zf / (1 + exp(-zf)))`` -- ``exp`` is :func:`numerics.exp`'s float64
  arithmetic (:func:`.numerics.exp_f32`), ``1 +`` a float32 add, the division IEEE (``div_rn``);
* ``ms = tree(h * h) / group_size`` -- the tree is :func:`numerics.tree_sum`'s over the group (zero-padded to the
  next power of two, element ``i`` paired with ``i + n/2``, level by level: :func:`.numerics.tree_cols`), the
  division by the Python int as torch evaluates it on the tensors' device: an IEEE float32 division on the CPU, on
  CUDA a multiply by ``float32(1 / float32(group_size))`` (torch's CUDA ``div`` by a CPU scalar multiplies by its
  reciprocal; the two agree for a power-of-two ``group_size``);
* ``rstd = 1 / sqrt(ms + eps)`` -- ``eps`` rounded to float32 as torch rounds the Python scalar, IEEE ``sqrt_rn``
  and ``div_rn`` (``1.0 / t`` is torch's ``reciprocal(t) * 1.0``, the same bits);
* ``out = round((h * rstd) * float32(weight))`` to ``y.dtype``, one rounding.

Launched without mul-add fusion (``enable_fp_fusion=False``), every multiply and add is its own IEEE operation, as
in torch's separate kernels.  So this is not a new contract but another evaluation of the torch one, with its bits on
the same device: in Triton's interpreter on CPU tensors ``_gated_rms_norm_cpu``'s bits
(tests/test_triton_interpret_gated_norm.py), on the GPU those of the torch evaluation there
(tests/test_gpu_gated_norm_dt.py).  An output depends only on its own row's group, never on the other rows or the
batch.  The interpreter rounds float32 to bfloat16 by truncation, so on CPU tensors a bfloat16 output is rounded on
its bits instead (to nearest even, NaN as ``0x7FC0``: torch's scalar CPU cast); on the GPU it is the hardware's
round-to-nearest-even conversion, as torch's CUDA cast.  NaN payloads are the hardware's (canonical on the GPU).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._common import float32_scalar, next_pow2
from .numerics import exp_f32, tree_cols

MAX_GROUP = 1 << 16  # tree_cols' trees reach 2**16 elements


def _gated_rms_norm(Y, Z, W, OUT, n_rows, stride_y, stride_z, stride_o, group_size, scale, eps,
                           BLOCK_G: tl.constexpr, ROWS: tl.constexpr, CPU_DIV: tl.constexpr,
                           BF16_BITS: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    c = tl.arange(0, BLOCK_G)
    cols = tl.program_id(1) * group_size + c
    mask = (rows < n_rows)[:, None] & (c < group_size)[None, :]
    zf = tl.load(Z + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    yf = tl.load(Y + rows[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h = yf * tl.div_rn(zf, 1.0 + exp_f32(-zf))
    hh = tl.where(mask, h * h, 0.0)  # the tree's zero padding
    total = tree_cols(hh, ROWS, BLOCK_G)
    if CPU_DIV:  # scale: float32(group_size)
        ms = tl.div_rn(total, tl.full((ROWS,), scale, tl.float32))
    else:  # scale: float32(1 / float32(group_size))
        ms = total * scale
    rstd = tl.div_rn(tl.full((ROWS,), 1.0, tl.float32), tl.sqrt_rn(ms + eps))
    w = tl.load(W + cols, mask=c < group_size, other=0.0).to(tl.float32)
    out = (h * rstd[:, None]) * w[None, :]
    at = OUT + rows[:, None] * stride_o + cols[None, :]
    if BF16_BITS:  # round to nearest even on the bits (the interpreter's own cast truncates)
        b = out.to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where(out != out, 0x7FC0, r)
        tl.store(at, r.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(at, out.to(OUT.dtype.element_ty), mask=mask)


# Two compilations of the same kernel, by what Triton may assume about the row strides (scheduling only: the same
# operations in the same order).  Aligned strides let Triton vectorise the loads, and for a one-row program of a
# large group that vectorised layout makes every thread evaluate the whole group's tree from shared memory (sm_90a
# offline, group 1 024: 1 032 float32 adds and 258 shared loads a thread); with the strides left unspecialised the
# loads are scalar (coalesced across the warp) and the tree is spread (143 adds, 32 shared loads).
_gated_rms_norm_kernel = triton.jit(do_not_specialize=["n_rows"])(_gated_rms_norm)
_gated_rms_norm_kernel_scalar_loads = triton.jit(do_not_specialize=["n_rows", "stride_y", "stride_z", "stride_o"])(
    _gated_rms_norm)
# One-row programs of groups up to this many (padded) channels take the scalar-load compilation (0: none).  At 8 192
# its tree is spread too (543 vs 4 120 adds) but it spills 888 bytes: kept vectorised until measured.
SCALAR_LOADS_MAX_BLOCK = 4096


def _rows(t: torch.Tensor, d: int) -> torch.Tensor:
    t2 = t.reshape(-1, d)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


@functools.lru_cache(maxsize=None)
def _group_scale(group_size: int, cuda: bool) -> float:
    """The CPU divides by ``float32(group_size)``; CUDA multiplies by ``float32(1 / float32(group_size))``, the
    reciprocal in float32 arithmetic as torch's host code forms it (module docstring)."""
    size = torch.tensor(group_size, dtype=torch.float32)
    return (torch.ones((), dtype=torch.float32) / size if cuda else size).item()


def _launch(block: int) -> tuple[int, int]:
    """(rows per program, warps) for a group of ``block`` (padded) channels: small groups share a program."""
    rows = max(1, 1024 // block)
    elements = rows * block
    return rows, 4 if elements <= 1024 else 8 if elements <= 4096 else 16


def gated_rms_norm_triton(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                          eps: float) -> torch.Tensor:
    """``_gated_rms_norm_cpu(y, z, weight, group_size, eps)``'s bits (module docstring): ``[..., D]`` in ``y.dtype``;
    ``y`` / ``z`` may be row-strided views (their last dim contiguous: otherwise copied)."""
    if y.dim() == 0:
        raise ValueError("gated_rms_norm: y needs a channel dim, got a scalar")
    if y.shape != z.shape:
        raise ValueError(f"gated_rms_norm: y {tuple(y.shape)} and gate z {tuple(z.shape)} differ in shape")
    d = y.shape[-1]
    if tuple(weight.shape) != (d,):
        raise ValueError(f"gated_rms_norm: weight {tuple(weight.shape)} does not match {d} channels")
    if isinstance(group_size, bool) or int(group_size) != group_size or group_size <= 0 or d % group_size:
        raise ValueError(f"gated_rms_norm: group_size {group_size} does not divide {d} channels")
    if group_size > MAX_GROUP:
        raise ValueError(f"gated_rms_norm: group_size {group_size} is over the kernel's {MAX_GROUP}")
    group_size = int(group_size)
    out = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    if out.numel() == 0:
        return out
    y2, z2 = _rows(y, d), _rows(z, d)
    n_rows = y2.shape[0]
    block = next_pow2(group_size)
    per_program, warps = _launch(block)
    out2 = out.view(n_rows, d)
    kernel = (_gated_rms_norm_kernel_scalar_loads if per_program == 1 and block <= SCALAR_LOADS_MAX_BLOCK
              else _gated_rms_norm_kernel)
    kernel[(triton.cdiv(n_rows, per_program), d // group_size)](
        y2, z2, weight.contiguous(), out2, n_rows, y2.stride(0), z2.stride(0), out2.stride(0), group_size,
        _group_scale(group_size, y.is_cuda), float32_scalar(eps), BLOCK_G=block, ROWS=per_program,
        CPU_DIV=not y.is_cuda, BF16_BITS=(not y.is_cuda) and y.dtype == torch.bfloat16, num_warps=warps, enable_fp_fusion=False)
    return out

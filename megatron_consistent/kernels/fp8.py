"""Block-scaled low-precision quantization and the FP8 linear (issue #9).

Quantizer interface
-------------------
A :class:`QuantFormat` names a value codec (``"e4m3"``: ``torch.float8_e4m3fn``
storage, largest finite value 448), a block shape ``(rows, cols)`` over the
last two dimensions of a tensor (leading dimensions are flattened into rows),
and a scale format:

* ``"fp32"`` — ``scale = amax / max_value`` (one IEEE float32 division of the
  block's exact ``amax``);
* ``"pow2"`` — that float32 quotient rounded **up** to a power of two (if it
  already is one it is kept).  Dequantization is then exact.

``amax`` is ``torch.amax(|x|)`` over the block, which is exact (max involves no
rounding, so no order dependence).  A block whose ``amax`` is 0 (or whose
scale underflows to 0) gets scale 1.  Partial blocks at the edges are padded
with zeros for the ``amax`` only (zeros never change a max); the scale tensor
has ``ceil(rows / br) x ceil(cols / bc)`` entries (the DeepSeek / HF block-FP8
convention).

:func:`quantize` — the exact order of operations, per element::

    q = cast_e4m3( clamp( float32(x) / scale_of_its_block , -448, 448 ) )

with IEEE float32 division and torch's float32 -> float8_e4m3fn cast
(round-to-nearest-even; the clamp makes saturation explicit — e4m3fn has no
infinity).  :func:`dequantize` is ``float32(q) * scale`` (fp8 -> fp32 is exact;
the product is exact for ``pow2`` scales and rounded once to float32 for
``fp32`` scales — deterministic either way).  The scale returned is the
*dequantization multiplier* (the tensor stored as ``weight_scale_inv`` in HF
block-FP8 checkpoints).

NVFP4: :data:`NVFP4_WEIGHT` = ``QuantFormat("e2m1", (1, 16), "e4m3")`` — the
E2M1 codec (max 6; one code per byte in memory, packed two per byte in
checkpoints) and the ``"e4m3"`` scale format (E4M3 block scales times a
per-tensor float32 global scale); order of operations in :mod:`.nvfp4`.
:func:`quantize` returns the effective float32 block scale ``float32(sb) * g``.
Weight-only (W4A16): the linears take ``a_fmt=None``.  Unknown codecs and
scale formats are refused by name.

FP8 linear
----------
Weights: :data:`E4M3_WEIGHT_128` (128x128 blocks).  Activations:
:data:`E4M3_ACT_1x128` (per token, groups of 128 along the reduction axis),
quantized dynamically on every call.  :func:`fp8_linear` quantizes the input,
dequantizes input and weight to float32 (above), then runs the batch-invariant
``linear`` kernel of :mod:`.linear` (float32 products, fixed 64-blocks, fixed
tree, one rounding to ``out_dtype``).  Every step is per row (activation groups
never cross tokens), so a row's output is independent of the batch.

Weights travel as ``(w_q [N, K] fp8, row_scales [N, ceil(K/128)] fp32)``:
``row_scales`` is the block-scale tensor with each block row repeated for its
rows (:func:`weight_row_scales`), so fused weights (q/k/v, gate/up) whose
parts have their own block grids are concatenated row-wise.

Row-parallel FP8 linear (``fp8_linear(..., segments=S)``, registered as
``fp8_linear_segment_tree``): the contract of :func:`.linear.row_parallel_linear`
on the FP8 linear -- segment ``s`` is the float32 FP8 linear over K slice ``s``
of S equal slices (on CPU: the K slice of the dequantized operands), the S
partials summed by ``adjacent_tree_sum``, bias, one rounding.  A rank of a
tensor-parallel layer runs it on its K shard with S/t segments, float32 out,
no bias (its subtree).  Activation groups and weight block columns are aligned
at the shard's first column, so a shard or a segment of whole 128-wide groups
sees exactly the groups of the full K (``conversion.fp8.fp8_tp_refusal``
refuses other layouts at TP > 1).

Backward (:class:`FP8LinearSTE`): a straight-through estimator — the
quantizers are treated as the identity in the backward, so with
``xd = dq(q(x))`` and ``wd = dq(q(W))``: ``dL/dx = g @ wd`` and
``dL/dW_master = g^T @ xd`` (float32 matmuls, rounded to the dtypes of ``x``
and of the bf16 master weight; on CUDA with bf16/fp16 ``x``, tensor-core matmuls in
that dtype as :class:`.linear.LinearFunction`), ``dL/db = sum g``.  Its forward is
the registered ``fp8_linear`` of the device (CUDA: the FP8 Triton GEMM of
:mod:`.triton.fp8_linear`, batch-invariant, not bit-equal to the CPU path), so the
trainer's FP8 forward equals the engine's on each device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from . import moe as kmoe
from .dispatch import implementation, register
from .linear import check_segments
from .nvfp4 import E2M1_MAX, decode_e2m1, encode_e2m1, nvfp4_effective_scales, nvfp4_quantize
from .silu_and_mul import silu_and_mul

__all__ = [
    "E4M3_ACT_1x128", "E4M3_MAX", "E4M3_WEIGHT_128", "NVFP4_WEIGHT", "FP8LinearSTE", "FP8Weights", "QuantFormat", "VALUE_CODECS", "block_amax",
    "compute_scales", "constant_row_block", "dequantize", "dequantize_rows", "fp8_combine_experts", "fp8_expert_mlp",
    "fp8_expert_outputs", "fp8_linear", "fp8_linear_ste", "fp8_moe_experts", "fp8_owned_expert_outputs", "gate_up_block_rows",
    "part_block_ids", "quantize", "row_block_of_parts", "weight_row_scales",
]

E4M3_MAX = 448.0
SCALE_FORMATS = ("fp32", "pow2", "e4m3")  # e4m3: NVFP4's two-level scales (E4M3 per block x float32 per tensor), kernels/nvfp4.py


def _encode_e4m3(y: torch.Tensor) -> torch.Tensor:
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _decode_e4m3(q: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float32)


# codec name -> (largest finite value, storage dtype, encode(float32 scaled values), decode(storage) -> float32)
VALUE_CODECS: dict[str, tuple[float, torch.dtype, Callable, Callable]] = {
    "e4m3": (E4M3_MAX, torch.float8_e4m3fn, _encode_e4m3, _decode_e4m3),
    "e2m1": (E2M1_MAX, torch.uint8, encode_e2m1, decode_e2m1),  # NVFP4 values: one 4-bit code per byte in memory
}


@dataclass(frozen=True)
class QuantFormat:
    """A block-scaled format: value codec, block shape over the last two dims, scale format."""

    name: str = "e4m3"
    block: tuple[int, int] = (128, 128)
    scale_format: str = "fp32"

    def __post_init__(self):
        if self.name not in VALUE_CODECS:
            raise ValueError(f"unknown value codec {self.name!r}; implemented: {', '.join(VALUE_CODECS)}")
        if self.scale_format not in SCALE_FORMATS:
            raise ValueError(f"unknown scale format {self.scale_format!r}; implemented: {', '.join(SCALE_FORMATS)}")
        if len(self.block) != 2 or min(self.block) < 1:
            raise ValueError(f"block must be two positive sizes, got {self.block}")
        if (self.scale_format == "e4m3") != (self.name == "e2m1") or (self.name == "e2m1" and self.block[0] != 1):
            raise ValueError(f"unsupported format {self}: the e2m1 codec goes with e4m3 scales over (1, n) blocks (NVFP4)")

    @property
    def max_value(self) -> float:
        return VALUE_CODECS[self.name][0]

    @property
    def storage_dtype(self) -> torch.dtype:
        return VALUE_CODECS[self.name][1]

    def as_dict(self) -> dict:
        return {"name": self.name, "block": list(self.block), "scale_format": self.scale_format}

    @property
    def spec(self) -> str:
        """The format as one string, ``name:RxC:scale_format`` (a custom op's argument); :meth:`from_spec` reads it."""
        return f"{self.name}:{self.block[0]}x{self.block[1]}:{self.scale_format}"

    @classmethod
    def from_spec(cls, spec: str) -> "QuantFormat":
        name, block, scale_format = spec.split(":")
        rows, cols = block.split("x")
        return cls(name, (int(rows), int(cols)), scale_format)


E4M3_WEIGHT_128 = QuantFormat("e4m3", (128, 128), "fp32")
E4M3_ACT_1x128 = QuantFormat("e4m3", (1, 128), "fp32")
NVFP4_WEIGHT = QuantFormat("e2m1", (1, 16), "e4m3")  # W4A16: pass a_fmt=None to the linears (kernels/nvfp4.py)


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 0:
        raise ValueError("quantize: needs at least one dimension")
    return x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 ``[ceil(R/br), ceil(C/bc)]``: exact max of ``|x|`` per block of the 2-D view ``[R, C]`` (zero-padded edges)."""
    x2 = _as_2d(x).to(torch.float32).abs()
    r, c = x2.shape
    br, bc = block
    rb, cb = _cdiv(r, br), _cdiv(c, bc)
    if (rb * br, cb * bc) != (r, c):
        x2 = torch.nn.functional.pad(x2, (0, cb * bc - c, 0, rb * br - r))
    return x2.reshape(rb, br, cb, bc).amax(dim=(1, 3))


def compute_scales(amax: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """Dequantization scales from block amax: ``amax / max_value`` (fp32), rounded up to 2^k for ``pow2``; 1 for zero blocks."""
    amax = amax.to(torch.float32)
    # a tensor divisor: on CUDA, torch computes ``t / python_scalar`` as ``t * (1 / scalar)`` (not one IEEE division)
    s = amax / torch.full_like(amax, fmt.max_value)
    if fmt.scale_format == "pow2":
        m, e = torch.frexp(s)  # s = m * 2^e, m in [0.5, 1)
        s = torch.where(m == 0.5, s, torch.ldexp(torch.ones_like(s), e))
    return torch.where((s == 0) | (amax == 0), torch.ones_like(s), s)


def _expand(scale: torch.Tensor, block: tuple[int, int], r: int, c: int) -> torch.Tensor:
    return scale.repeat_interleave(block[0], dim=0)[:r].repeat_interleave(block[1], dim=1)[:, :c]


def quantize(x: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``q`` in the format's storage dtype, shaped like ``x``; ``scale`` float32 per block (module doc)."""
    _, _, encode, _ = VALUE_CODECS[fmt.name]
    x2 = _as_2d(x)
    if fmt.scale_format == "e4m3":  # NVFP4: per-tensor global scale; the returned scale is float32(sb) * g per block
        q, sb, g = nvfp4_quantize(x2, fmt.block[1])
        scale = nvfp4_effective_scales(sb, g)
        return (q.reshape(x.shape), scale.reshape(*x.shape[:-1], scale.shape[-1])) if x.dim() != 2 else (q, scale)
    scale = compute_scales(block_amax(x2, fmt.block), fmt)
    y = x2.to(torch.float32) / _expand(scale, fmt.block, *x2.shape)
    q = encode(y)
    if x.dim() != 2:
        q = q.reshape(x.shape)
        scale = scale.reshape(*x.shape[:-1], scale.shape[-1]) if fmt.block[0] == 1 else scale
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """float32 ``decode(q) * scale`` (each element times its block's scale)."""
    _, _, _, decode = VALUE_CODECS[fmt.name]
    q2 = _as_2d(q)
    s2 = scale.reshape(-1, scale.shape[-1]) if fmt.block[0] == 1 else scale
    return (decode(q2) * _expand(s2, fmt.block, *q2.shape)).reshape(q.shape)


def weight_row_scales(scale: torch.Tensor, rows: int, fmt: QuantFormat = E4M3_WEIGHT_128) -> torch.Tensor:
    """Block scales ``[..., ceil(N/br), ceil(K/bc)]`` -> per-row scales ``[..., N, ceil(K/bc)]`` (block rows
    repeated; leading dims, e.g. stacked experts, kept)."""
    return scale.repeat_interleave(fmt.block[0], dim=-2)[..., :rows, :].contiguous()


TENSOR_CORE_GROUP = 128  # the CUDA FP8 GEMM's activation group = weight block column = its BLOCK_K


def tensor_core_formats(w_fmt: QuantFormat, a_fmt: QuantFormat | None) -> bool:
    """Whether the CUDA FP8 GEMM serves these formats: E4M3 weights in 128-wide column blocks and E4M3 activations
    quantized per token in 1 x 128 groups.  Other formats run the dequantized float32 path on every device."""
    return (a_fmt is not None and w_fmt.name == "e4m3" and a_fmt.name == "e4m3"
            and tuple(a_fmt.block) == (1, TENSOR_CORE_GROUP) and w_fmt.block[1] == TENSOR_CORE_GROUP)


def dequantize_rows(w_q: torch.Tensor, row_scales: torch.Tensor, fmt: QuantFormat = E4M3_WEIGHT_128) -> torch.Tensor:
    """float32 weight ``decode(w_q) * row_scales`` expanded along the columns (equal to :func:`dequantize` on the blocks)."""
    _, _, _, decode = VALUE_CODECS[fmt.name]
    n, k = w_q.shape
    return decode(w_q) * row_scales.repeat_interleave(fmt.block[1], dim=1)[:, :k]


def _check_formats(w_fmt: QuantFormat, a_fmt: QuantFormat | None) -> None:
    if a_fmt is None:  # weight-only (W4A16 / W8A16): activations enter unquantized
        return
    if a_fmt.name == "e2m1":
        raise ValueError("NVFP4 activations are not implemented (per-tensor global scales depend on the batch): use a_fmt=None (W4A16)")
    if a_fmt.block[0] != 1:
        raise ValueError(f"activation format must quantize per token (block rows 1), got {a_fmt.block}")


def _dequantized_operands(x2d, w_q, w_row_scales, w_fmt, a_fmt):
    _check_formats(w_fmt, a_fmt)
    if a_fmt is None:
        return x2d.to(torch.float32), dequantize_rows(w_q, w_row_scales, w_fmt)
    xq, xs = quantize(x2d, a_fmt)
    return dequantize(xq, xs, a_fmt), dequantize_rows(w_q, w_row_scales, w_fmt)


def constant_row_block(block_ids: torch.Tensor, limit: int = 256) -> int:
    """The largest power of two ``P <= limit`` such that ``block_ids`` (the scale block of each weight row, in the
    weight's row order) is constant over every aligned run of ``P`` rows (the last run may be short).  A GEMM tile of
    ``BN | P`` rows then has one weight scale per group (``w_block_rows`` of the CUDA FP8 GEMM).  A fused weight's
    parts are quantized one by one, so its blocks follow the parts' boundaries, not multiples of the format's block."""
    ids = block_ids.reshape(-1)
    p = 1
    while 2 * p <= limit and ids.numel():
        q = 2 * p
        pad = (-ids.numel()) % q
        runs = (torch.cat([ids, ids[-1:].expand(pad)]) if pad else ids).view(-1, q)
        if not bool((runs == runs[:, :1]).all()):
            break
        p = q
    return p


def part_block_ids(part_rows, block_rows: int) -> list[torch.Tensor]:
    """Per part of ``part_rows`` rows, each quantized on its own (blocks of ``block_rows`` rows from its first row):
    each row's scale-block id, distinct across parts."""
    ids, base = [], 0
    for n in part_rows:
        ids.append(torch.arange(n) // block_rows + base)
        base += -(-n // block_rows)
    return ids


@functools.lru_cache(maxsize=None)
def row_block_of_parts(part_rows: tuple[int, ...], block_rows: int) -> int:
    """:func:`constant_row_block` of the parts of :func:`part_block_ids` stacked in that order."""
    return constant_row_block(torch.cat(part_block_ids(part_rows, block_rows)))


def gate_up_block_rows(rows: int, block_rows: int) -> int:
    """:func:`row_block_of_parts` of an expert's fused ``[gate; up]`` weight of ``rows`` rows (two equal parts)."""
    return row_block_of_parts((rows // 2, rows // 2), block_rows)


@register("fp8_linear", "cpu")
def _fp8_linear_cpu(x2d, w_q, w_row_scales, bias, out_dtype, w_fmt=E4M3_WEIGHT_128, a_fmt=E4M3_ACT_1x128, w_block_rows=0):
    """``w_block_rows`` (the CUDA GEMM's scale-load hint) does not enter the CPU arithmetic."""
    xd, wd = _dequantized_operands(x2d, w_q, w_row_scales, w_fmt, a_fmt)
    return implementation("linear", x2d.device)(xd, wd, bias, out_dtype)


@register("fp8_linear_segment_tree", "cpu")
def _fp8_linear_segment_tree_cpu(x2d, w_q, w_row_scales, segments, bias, out_dtype, w_fmt=E4M3_WEIGHT_128,
                                 a_fmt=E4M3_ACT_1x128, w_block_rows=0):
    """The row-parallel FP8 linear over ``segments`` K segments: the dequantized operands (activation groups aligned
    at this K's first column), then ``linear_segment_tree``'s contract -- segment ``s`` the float32 linear over K
    slice ``s``, the adjacent tree, bias, one rounding to ``out_dtype`` (float32 without bias: a rank's subtree)."""
    xd, wd = _dequantized_operands(x2d, w_q, w_row_scales, w_fmt, a_fmt)
    return implementation("linear_segment_tree", x2d.device)(xd, wd, segments, bias, out_dtype)


def _fp8_forward(x2d, w_q, w_row_scales, bias, out_dtype, w_fmt, a_fmt, w_block_rows, segments):
    """The device's FP8 linear (``segments`` 0) or its row-parallel tree of ``segments`` K segments."""
    if segments:
        check_segments(w_q.shape[-1], segments)
        return implementation("fp8_linear_segment_tree", x2d.device)(x2d, w_q, w_row_scales, segments, bias, out_dtype,
                                                                     w_fmt, a_fmt, w_block_rows)
    return implementation("fp8_linear", x2d.device)(x2d, w_q, w_row_scales, bias, out_dtype, w_fmt, a_fmt, w_block_rows)


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_row_scales: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None, *, w_fmt: QuantFormat = E4M3_WEIGHT_128,
               a_fmt: QuantFormat = E4M3_ACT_1x128, w_block_rows: int = 0, segments: int = 0) -> torch.Tensor:
    """Inference FP8 linear (no autograd): dynamic per-token activation quantization, then the batch-invariant linear.
    ``w_block_rows``: the row scales are constant over aligned runs of that many rows (:func:`constant_row_block`;
    0 = unknown) -- lets the CUDA GEMM load one scale per tile; never changes a bit.  ``segments`` S > 0: the
    row-parallel contract -- the float32 FP8 linear of each of S equal K slices, ``adjacent_tree_sum``, bias, one
    rounding (``out_dtype`` float32 without bias: a tensor-parallel rank's subtree)."""
    if x.shape[-1] != w_q.shape[-1]:
        raise ValueError(f"fp8_linear: input has {x.shape[-1]} features, weight expects {w_q.shape[-1]}")
    x2d = x.reshape(-1, x.shape[-1])
    y = _fp8_forward(x2d, w_q, w_row_scales, bias, out_dtype or x.dtype, w_fmt, a_fmt, w_block_rows, segments)
    return y.reshape(*x.shape[:-1], w_q.shape[0])


class FP8LinearSTE(torch.autograd.Function):
    """FP8 forward (as :func:`fp8_linear`) with a straight-through backward to the input and the master weight."""

    @staticmethod
    def forward(ctx, x, weight, bias, w_q, w_row_scales, out_dtype, w_fmt, a_fmt, w_block_rows=0, segments=0):
        x2d = x.reshape(-1, x.shape[-1])
        # the registered fp8_linear (or its K-segment tree) of the device: on CPU dequantize + linear, on CUDA the FP8 GEMM
        y = _fp8_forward(x2d, w_q, w_row_scales, bias, out_dtype, w_fmt, a_fmt, w_block_rows, segments)
        ctx.save_for_backward(x2d, w_q, w_row_scales)  # dequantized operands are recomputed in the backward
        ctx.fmts = (w_fmt, a_fmt)
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.reshape(*x.shape[:-1], w_q.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x2d, w_q, w_row_scales = ctx.saved_tensors
        xd, wd = _dequantized_operands(x2d, w_q, w_row_scales, *ctx.fmts)
        # CUDA with bf16/fp16 activations: tensor-core matmuls in that dtype (float32 accumulation), as LinearFunction
        low = x2d.is_cuda and ctx.x_dtype in (torch.bfloat16, torch.float16)
        compute = ctx.x_dtype if low else torch.float32
        g32 = grad_out.reshape(-1, grad_out.shape[-1]).to(torch.float32)
        g = g32.to(compute)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ wd.to(compute)).to(ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = (g.t() @ xd.to(compute)).to(ctx.w_dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = g32.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None


def fp8_linear_ste(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, w_q: torch.Tensor, w_row_scales: torch.Tensor,
                   out_dtype: torch.dtype | None = None, *, w_fmt: QuantFormat = E4M3_WEIGHT_128,
                   a_fmt: QuantFormat = E4M3_ACT_1x128, w_block_rows: int = 0, segments: int = 0) -> torch.Tensor:
    """Training FP8 linear: forward bitwise :func:`fp8_linear` on ``(w_q, w_row_scales)`` (the quantized ``weight``);
    gradients flow to ``x``, the master ``weight`` and ``bias`` by the straight-through estimator (the same for the
    K-segment tree: a sum of the segments' linears); ``w_block_rows`` and ``segments`` as in :func:`fp8_linear`."""
    if x.shape[-1] != w_q.shape[-1] or tuple(weight.shape) != tuple(w_q.shape):
        raise ValueError(f"fp8_linear_ste: shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}, w_q {tuple(w_q.shape)} disagree")
    return FP8LinearSTE.apply(x, weight, bias, w_q, w_row_scales, out_dtype or x.dtype, w_fmt, a_fmt, w_block_rows,
                              segments)


# ------------------------------------------------------------------------------------------- FP8 MoE experts
@dataclass(frozen=True)
class FP8Weights:
    """A quantized weight (stacked per expert or single): ``q`` ``[..., N, K]``, per-row scales ``rows`` ``[..., N, ceil(K/bc)]``,
    and optionally the master weight ``[..., N, K]`` (training: gradients reach it by the STE; None: inference)."""

    q: torch.Tensor
    rows: torch.Tensor
    master: torch.Tensor | None = None
    block_rows: int = 0  # the rows' scale blocks, as fp8_linear's w_block_rows

    def expert(self, e: int) -> "FP8Weights":
        return FP8Weights(self.q[e], self.rows[e], None if self.master is None else self.master[e], self.block_rows)


def _fp8_apply(x, w: FP8Weights, w_fmt, a_fmt):
    if w.master is None:
        return fp8_linear(x, w.q, w.rows, w_fmt=w_fmt, a_fmt=a_fmt, w_block_rows=w.block_rows)
    return fp8_linear_ste(x, w.master, None, w.q, w.rows, w_fmt=w_fmt, a_fmt=a_fmt, w_block_rows=w.block_rows)


def fp8_expert_mlp(x: torch.Tensor, fc1: FP8Weights, fc2: FP8Weights, w_fmt: QuantFormat = E4M3_WEIGHT_128,
                   a_fmt: QuantFormat = E4M3_ACT_1x128) -> torch.Tensor:
    """One SwiGLU expert in FP8: ``fp8_linear(silu_and_mul(fp8_linear(x, fc1)), fc2)`` (gate rows first)."""
    return _fp8_apply(silu_and_mul(_fp8_apply(x, fc1, w_fmt, a_fmt)), fc2, w_fmt, a_fmt)


def fp8_moe_experts(hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, fc1: FP8Weights, fc2: FP8Weights,
                    shared: tuple | None = None, *, w_fmt: QuantFormat = E4M3_WEIGHT_128,
                    a_fmt: QuantFormat = E4M3_ACT_1x128) -> torch.Tensor:
    """:func:`kernels.moe.moe_experts` with block-FP8 expert linears: ``[T, H]`` in ``hidden.dtype``.

    ``fc1`` stacked ``[E, 2I, H]`` (gate rows first), ``fc2`` ``[E, H, I]``; ``shared`` =
    ``(FP8Weights fc1 [2Is, H], FP8Weights fc2 [H, Is], W_gate [1, H] model dtype or None)``.  The same contract as
    ``moe_experts`` — (token, slot) pairs grouped by ascending expert, one call per expert (the FP8 linear is
    row-invariant: per-token activation groups), the shared expert's sigmoid gate from the unquantized gate weight,
    float32 slot-order combine, one rounding — with every expert linear being :func:`fp8_linear` (forward bitwise
    equal with or without masters): :func:`fp8_combine_experts` of :func:`fp8_expert_outputs`."""
    if hidden.dim() != 2:
        raise ValueError(f"fp8_moe_experts: hidden must be [T, H], got {tuple(hidden.shape)}")
    return fp8_combine_experts(hidden, fp8_expert_outputs(hidden, experts, fc1, fc2, w_fmt, a_fmt), weights, shared,
                               w_fmt=w_fmt, a_fmt=a_fmt)


def fp8_expert_outputs(hidden: torch.Tensor, experts: torch.Tensor, fc1: FP8Weights, fc2: FP8Weights,
                       w_fmt: QuantFormat = E4M3_WEIGHT_128, a_fmt: QuantFormat = E4M3_ACT_1x128) -> torch.Tensor:
    """``[T, k, H]``: every (token, slot) pair through its block-FP8 expert (:func:`kernels.moe.expert_outputs`'s
    contract: a pair of expert ``-1`` is not computed).  Without masters (inference) the device's
    ``fp8_moe_expert_outputs``: on CPU the per-expert calls, on CUDA one grouped FP8 GEMM per projection with each
    row's arithmetic that of :func:`fp8_linear` (:mod:`.triton.moe`; no host read, so CUDA graphs capture it); with
    masters the per-expert STE linears (the same forward bits)."""
    if fc1.master is None and fc2.master is None:
        return implementation("fp8_moe_expert_outputs", hidden.device)(hidden, experts, fc1.q, fc1.rows, fc2.q, fc2.rows,
                                                                        w_fmt, a_fmt)
    return _per_expert_mlps(hidden, experts, fc1, fc2, w_fmt, a_fmt)


def fp8_owned_expert_outputs(hidden: torch.Tensor, experts: torch.Tensor, first: int, fc1: FP8Weights, fc2: FP8Weights,
                             w_fmt: QuantFormat = E4M3_WEIGHT_128, a_fmt: QuantFormat = E4M3_ACT_1x128,
                             fixed_shapes: bool = False) -> torch.Tensor:
    """``[T, k, H]``: a tensor-parallel rank's block-FP8 experts ``[first, first + E_local)`` (``fc1`` / ``fc2`` stacked
    over them, each expert quantized whole on its own grid: the values and scales of TP = 1) through
    :func:`fp8_expert_outputs`, ``+0.0`` for the other pairs -- :func:`kernels.moe.owned_pair_outputs`, so the ranks'
    results summed are the TP = 1 :func:`fp8_expert_outputs`."""
    return kmoe.owned_pair_outputs(hidden, experts, first, fc1.q.shape[0], fc2.q.shape[-2],
                                   lambda h, local: fp8_expert_outputs(h, local, fc1, fc2, w_fmt, a_fmt), fixed_shapes)


def fp8_combine_experts(hidden: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, shared: tuple | None = None, *,
                        w_fmt: QuantFormat = E4M3_WEIGHT_128, a_fmt: QuantFormat = E4M3_ACT_1x128) -> torch.Tensor:
    """:func:`fp8_moe_experts`' combine of the routed experts' outputs ``y [T, k, H]`` (:func:`fp8_expert_outputs`'s, or
    the same values summed over the ranks that hold the experts) with weights ``[T, k]`` float32, plus the optional
    block-FP8 shared expert of ``hidden`` (whole on every rank): ``[T, H]`` in ``hidden.dtype``."""
    if weights.dtype != torch.float32:
        raise ValueError(f"fp8_moe_experts: weights must be float32, got {weights.dtype}")
    ys = gate = None
    if shared is not None:
        s_fc1, s_fc2, s_gate = shared
        ys = fp8_expert_mlp(hidden, s_fc1, s_fc2, w_fmt, a_fmt)
        gate = None if s_gate is None else kmoe.shared_expert_gate(hidden, s_gate)
    return kmoe.CombineFunction.apply(y, weights, ys, gate)


@register("fp8_moe_expert_outputs", "cpu")
def per_expert_fp8_outputs(hidden: torch.Tensor, experts: torch.Tensor, fc1_q: torch.Tensor, fc1_rows: torch.Tensor,
                           fc2_q: torch.Tensor, fc2_rows: torch.Tensor, w_fmt: QuantFormat = E4M3_WEIGHT_128,
                           a_fmt: QuantFormat | None = E4M3_ACT_1x128) -> torch.Tensor:
    """``[T, k, H]``: one :func:`fp8_expert_mlp` call per routed expert (ascending index) on its pairs' rows."""
    return _per_expert_mlps(hidden, experts, FP8Weights(fc1_q, fc1_rows), FP8Weights(fc2_q, fc2_rows), w_fmt, a_fmt)


def _per_expert_mlps(hidden, experts, fc1: FP8Weights, fc2: FP8Weights, w_fmt, a_fmt) -> torch.Tensor:
    """``[T, k, H]``: :func:`fp8_expert_mlp` per routed expert on its pairs' rows (with or without masters)."""
    return kmoe.per_expert_outputs(hidden, experts, fc2.q.shape[-2],
                                   lambda e, x: fp8_expert_mlp(x, fc1.expert(e), fc2.expert(e), w_fmt, a_fmt))


# ------------------------------------------------------------------------------------------- FP8 KV cache
KV_SCALE = 1.0  # fixed per-tensor scale of the FP8 KV cache (vLLM's default k/v scale when a checkpoint has none)


def kv_quantize(x: torch.Tensor) -> torch.Tensor:
    """K or V -> ``float8_e4m3fn``: ``cast_e4m3(clamp(float32(x) / KV_SCALE, -448, 448))`` (round-to-nearest-even)."""
    return _encode_e4m3(x.to(torch.float32) / KV_SCALE)


def kv_dequantize(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``float8_e4m3fn`` K/V -> ``dtype``: ``float32(q) * KV_SCALE`` rounded to ``dtype`` (exact for bf16/fp16/fp32 with scale 1)."""
    return (q.to(torch.float32) * KV_SCALE).to(dtype)


def kv_round_trip(x: torch.Tensor) -> torch.Tensor:
    """What attention sees of K/V that went through the FP8 cache (the trainer applies it to a private copy)."""
    return kv_dequantize(kv_quantize(x), x.dtype)

"""NVFP4 (issue #9): E2M1 values, E4M3 block scales per 16 elements, one float32 global scale per tensor.

The value codec ``"e2m1"`` and the scale format ``"e4m3"`` of
:class:`megatron_consistent.kernels.fp8.QuantFormat` (``NVFP4_WEIGHT =
QuantFormat("e2m1", (1, 16), "e4m3")``), following NVIDIA's NVFP4 format as
TensorRT-Model-Optimizer writes it (``weight`` / ``weight_scale`` /
``weight_scale_2``).  Per 2-D tensor ``x [R, C]`` (blocks of 16 along C), in
float32 with IEEE operations, the exact order:

* global (dequantization) scale ``g = amax(|x|) / (6 * 448)`` (one division;
  ``g = 1`` for an all-zero tensor);
* block scale ``sb = cast_e4m3(clamp((amax_b / 6) / g, 0, 448))`` (two
  divisions, then torch's round-to-nearest-even cast; zero blocks: ``sb = 1``);
* effective block scale ``s = float32(sb) * g`` (one rounding); a block whose
  ``sb`` underflowed to 0 stores all-zero values;
* value ``q = rne_e2m1(float32(x) / s)``: the E2M1 grid ``{0, 0.5, 1, 1.5, 2, 3,
  4, 6}`` with sign, round to nearest, ties to the even code (the code whose
  last bit is 0: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4,
  5 -> 4), magnitudes above 5 saturate to 6 (explicit: E2M1 has no inf/NaN);
  decided by exact comparisons with the midpoints, so no float rounding is
  involved.  NaN input is refused.
* dequantize ``float32(decode(q)) * s`` (one rounding).

In memory a quantized tensor holds one 4-bit code per ``uint8`` (bit 3 the
sign, bits 0-2 the magnitude index), shaped like ``x``; checkpoints pack two
codes per byte (:func:`pack_e2m1`: element ``2j`` in the low nibble, ``2j+1`` in
the high nibble, the ModelOpt layout).

Activations: **W4A16** — only weights are NVFP4; activations enter the linear
unquantized (NVFP4 activations need a per-tensor global scale over the batch,
which would make a token's result depend on the batch; a static calibrated
input scale would be the batch-invariant W4A4 — not implemented).
"""

from __future__ import annotations

import torch

__all__ = ["E2M1_MAX", "E2M1_GRID", "decode_e2m1", "encode_e2m1", "nvfp4_effective_scales", "nvfp4_quantize", "pack_e2m1",
           "unpack_e2m1"]

E2M1_MAX = 6.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between magnitude codes i and i + 1
_E4M3_MAX = 448.0


def encode_e2m1(y: torch.Tensor) -> torch.Tensor:
    """float32 (already scaled) -> uint8 E2M1 codes, round to nearest, ties to even code, saturating at 6."""
    if torch.isnan(y).any():
        raise ValueError("e2m1: NaN input")
    a = y.to(torch.float32).abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for i, m in enumerate(_MIDPOINTS):
        up = a > m
        if i % 2 == 1:  # the upper code i + 1 is even: a tie rounds up
            up = up | (a == m)
        code += up.to(torch.uint8)
    return code | ((y < 0).to(torch.uint8) << 3)


def decode_e2m1(code: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes -> float32 values (exact): magnitude index ``i = 2e + m`` (exponent field e, mantissa bit m)
    is ``m / 2`` for e = 0, else ``(1 + m / 2) * 2^(e - 1)`` — :data:`E2M1_GRID`, computed on the device (no table
    copied from the host, so a CUDA graph can capture it)."""
    c = code.to(torch.int32)
    e = (c >> 1) & 3
    m = (c & 1).to(torch.float32)
    power = (torch.ones_like(e) << (e - 1).clamp(min=0)).to(torch.float32)  # 2^(e-1) by a shift: exact on every device
    mag = torch.where(e == 0, m * 0.5, (1.0 + m * 0.5) * power)
    return torch.where((c & 8) != 0, -mag, mag)


def pack_e2m1(code: torch.Tensor) -> torch.Tensor:
    """``[..., C]`` codes (C even) -> ``[..., C / 2]`` bytes: element ``2j`` low nibble, ``2j + 1`` high nibble."""
    if code.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: the last dimension must be even, got {code.shape[-1]}")
    return code[..., 0::2] | (code[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def nvfp4_effective_scales(block_scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """float32 ``float32(sb) * g``: the dequantization multiplier of each 16-block (what every path multiplies by)."""
    return block_scales.to(torch.float32) * global_scale.to(torch.float32)


def nvfp4_quantize(x: torch.Tensor, block: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """2-D ``x [R, C]`` -> ``(codes uint8 [R, C], block scales float8_e4m3fn [R, ceil(C/16)], global scale float32 [])``."""
    if x.dim() != 2:
        raise ValueError(f"nvfp4_quantize: needs a 2-D tensor, got {tuple(x.shape)}")
    xf = x.to(torch.float32)
    r, c = xf.shape
    cb = -(-c // block)
    padded = torch.nn.functional.pad(xf.abs(), (0, cb * block - c)) if cb * block != c else xf.abs()
    amax_b = padded.reshape(r, cb, block).amax(-1)
    amax = xf.abs().amax()
    # a divisor on the tensor's device: CUDA computes ``t / (CPU scalar)`` as ``t * (1 / scalar)`` (session 18: the
    # trainer's NVFP4 weights quantized on the H200 differed from the export's, quantized on the CPU)
    g = amax / torch.full_like(amax, E2M1_MAX * _E4M3_MAX)
    g = torch.where(g == 0, torch.ones_like(g), g)
    sb = (amax_b / torch.full_like(amax_b, E2M1_MAX)) / g
    sb = torch.where(amax_b == 0, torch.ones_like(sb), sb).clamp(0, _E4M3_MAX).to(torch.float8_e4m3fn)
    s = nvfp4_effective_scales(sb, g).repeat_interleave(block, dim=1)[:, :c]
    y = torch.where(s == 0, torch.zeros_like(xf), xf / torch.where(s == 0, torch.ones_like(s), s))
    return encode_e2m1(y), sb, g

"""Rotary position embedding (NeoX half-split and GPT-J interleaved styles).

Numerics contract:

* inverse frequencies ``1 / base**(2i/rotary_dim)`` (and llama3 ``rope_scaling``)
  are computed in Python float64; angles ``position * inv_freq`` in float64;
  ``cos``/``sin`` by :func:`numerics.sin_cos` and rounded once to float32.  The
  table depends on (position, i) only, so tables of any length agree on their
  common rows; it is built once per :class:`RopeConfig` and cached.
* application, in float32 with one rounding to the input dtype:
  ``o1 = x1*cos - x2*sin``, ``o2 = x2*cos + x1*sin`` (each product rounded to
  float32, then the sum); dims past ``rotary_dim`` pass through unchanged.

Backward: the inverse rotation, same formulas with ``-sin``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn

from .dispatch import implementation, register
from .numerics import sin_cos

ROPE_STYLES = ("neox", "gptj")


@dataclass(frozen=True)
class RopeConfig:
    """Everything that determines the cos/sin table."""

    rotary_dim: int
    max_positions: int
    base: float = 10000.0
    style: str = "neox"
    scaling: tuple[tuple[str, float], ...] | None = None  # sorted items of an HF rope_scaling dict

    def __post_init__(self):
        if self.style not in ROPE_STYLES:
            raise ValueError(f"unsupported rope style '{self.style}' (supported: {ROPE_STYLES})")
        if self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even, got {self.rotary_dim}")
        kind = self.scaling_kind
        if kind not in ("default", "llama3"):
            raise ValueError(f"unsupported rope_scaling type '{kind}' (supported: default, llama3)")

    @property
    def scaling_kind(self) -> str:
        if not self.scaling:
            return "default"
        d = dict(self.scaling)
        return str(d.get("rope_type", d.get("type", "default")))


def rope_scaling_items(scaling: dict | None) -> tuple[tuple[str, float], ...] | None:
    """An HF ``rope_scaling`` dict as the hashable form :class:`RopeConfig` stores."""
    if not scaling:
        return None
    return tuple(sorted((str(k), v) for k, v in scaling.items() if v is not None))


def inverse_frequencies(cfg: RopeConfig) -> list[float]:
    """float64 inverse frequencies, llama3 scaling applied where configured."""
    inv = [1.0 / (cfg.base ** (2 * i / cfg.rotary_dim)) for i in range(cfg.rotary_dim // 2)]
    if cfg.scaling_kind != "llama3":
        return inv
    s = dict(cfg.scaling)
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


@functools.lru_cache(maxsize=16)
def rope_cache(cfg: RopeConfig, device: torch.device = torch.device("cpu")) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(cos, sin)`` tables of shape ``[max_positions, rotary_dim // 2]``, built on CPU, cached per device."""
    if device.type != "cpu":
        cos, sin = rope_cache(cfg)
        return cos.to(device), sin.to(device)
    inv = torch.tensor(inverse_frequencies(cfg), dtype=torch.float64, device="cpu")  # CPU even under a device context
    pos = torch.arange(cfg.max_positions, dtype=torch.float64, device="cpu")
    sin, cos = sin_cos(pos[:, None] * inv[None, :])
    return cos, sin


def _halves(x: torch.Tensor, rot: int, style: str):
    if style == "neox":
        return x[..., : rot // 2], x[..., rot // 2 : rot]
    return x[..., 0:rot:2], x[..., 1:rot:2]


def _join(o1: torch.Tensor, o2: torch.Tensor, style: str) -> torch.Tensor:
    if style == "neox":
        return torch.cat([o1, o2], dim=-1)
    return torch.stack([o1, o2], dim=-1).flatten(-2)


@register("rope", "cpu")
def _rope_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    rot = 2 * cos.shape[-1]
    x1, x2 = _halves(x.to(torch.float32), rot, style)
    o = _join(x1 * cos - x2 * sin, x2 * cos + x1 * sin, style).to(x.dtype)
    return torch.cat([o, x[..., rot:]], dim=-1) if rot < x.shape[-1] else o


class RopeFunction(torch.autograd.Function):
    """Autograd wrapper: forward rotation, backward inverse rotation."""

    @staticmethod
    def forward(ctx, x, cos, sin, style):
        ctx.save_for_backward(cos, sin)
        ctx.style = style
        return implementation("rope", x.device)(x, cos, sin, style)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        rot = 2 * cos.shape[-1]
        g1, g2 = _halves(grad.to(torch.float32), rot, ctx.style)
        o = _join(g1 * cos + g2 * sin, g2 * cos - g1 * sin, ctx.style).to(grad.dtype)
        if rot < grad.shape[-1]:
            o = torch.cat([o, grad[..., rot:]], dim=-1)
        return o, None, None, None


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cfg: RopeConfig) -> torch.Tensor:
    """Rotate ``x`` of shape ``[..., T, heads, head_dim]`` by ``positions`` of shape ``[..., T]``."""
    if positions.numel() and int(positions.max()) >= cfg.max_positions:
        raise ValueError(f"position {int(positions.max())} >= max_positions {cfg.max_positions}")
    cos, sin = rope_cache(cfg, x.device)
    cos = cos[positions][..., None, :]
    sin = sin[positions][..., None, :]
    return RopeFunction.apply(x, cos, sin, cfg.style)


class RotaryEmbedding(nn.Module):
    """Thin module around :func:`apply_rope` for q and k."""

    def __init__(self, cfg: RopeConfig):
        super().__init__()
        self.cfg = cfg

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return apply_rope(q, positions, self.cfg), apply_rope(k, positions, self.cfg)

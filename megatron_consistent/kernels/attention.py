"""Causal attention with GQA/MQA: one algorithm for training, prefill, chunked prefill and decode.

Inputs: ``q [B, Tq, Hq, D]``, ``k, v [B, Tk, Hkv, D]`` (keys at absolute
positions ``0 .. Tk-1``), ``q_positions [B, Tq]`` (absolute position of each
query, ``-1`` for padding) and ``k_lengths [B]``.  Key ``j`` is visible to
query ``i`` iff ``j <= q_positions[i]`` and ``j < k_lengths``.  Query head
``h`` reads KV head ``h // (Hq // Hkv)``.

Numerics contract (CPU):

* keys are visited in blocks of ``KV_BLOCK`` (32) aligned at absolute position
  0, in increasing order — the same blocks whether the query comes from a whole
  training sequence, a prefill chunk over a cached prefix, or a decode step;
* score ``s = tree_sum(float32(q) * float32(k)) * scale`` (fixed tree over D);
  masked scores are ``-inf``;
* online softmax in float32: ``m' = max(m, max_j s)``, ``alpha = exp(m - m')``,
  ``p = exp(s - m')`` (deterministic :func:`numerics.exp`),
  ``l = l*alpha + tree_sum_j(p)``, ``acc = acc*alpha + tree_sum_j(p*v)``;
* ``out = round_to_dtype(acc / l)``; a query with no visible key gives 0.

A block with no visible key leaves ``(m, l, acc)`` bitwise unchanged
(``alpha = exp(0) = 1``, ``p = 0``), so extra trailing blocks, padding and
batch neighbours never change a row.  Backward: float32 materialised softmax
(deterministic, not batch-invariant); on CUDA the registered
``("attention_backward", "cuda")`` Triton kernel (flash-style, deterministic).
"""

from __future__ import annotations

import math

import torch

from .dispatch import NoConsistentKernelError, implementation, register
from .numerics import ceil_to, exp, log, tree_sum

KV_BLOCK = 32
# The widest head the CUDA kernel (kernels/triton/attention.py) serves: its tiles' shared memory bounds it.
CUDA_MAX_HEAD_DIM = 256
_CHUNK_ELEMENTS = 1 << 22


def _expand_heads(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """[B, T, Hkv, D] -> float32 [B, Hq, T, D] with query head h reading kv head h // group."""
    group = num_q_heads // x.shape[2]
    return x.to(torch.float32).repeat_interleave(group, dim=2).transpose(1, 2)


@register("attention", "cpu")
def _attention_cpu(q, k, v, q_positions, k_lengths, scale):
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    grp = hq // hkv
    tkp = ceil_to(max(tk, 1), KV_BLOCK)
    if tkp != tk:
        k = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, tkp - tk))
        v = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, tkp - tk))
    nblk = tkp // KV_BLOCK
    kb_all = k.view(b, nblk, KV_BLOCK, hkv, d)
    vb_all = v.view(b, nblk, KV_BLOCK, hkv, d)
    # query head h = kv_head * grp + g reads kv head h // grp
    qf = q.to(torch.float32).view(b, tq, hkv, grp, d).permute(0, 2, 3, 1, 4)  # [B, Hkv, grp, Tq, D]
    out = torch.empty(b, hkv, grp, tq, d, dtype=torch.float32)
    lse = torch.empty(b, hkv, grp, tq, dtype=torch.float32)
    rows = max(1, _CHUNK_ELEMENTS // max(1, b * hq * tkp * d))
    for r0 in range(0, tq, rows):
        qc = qf[:, :, :, r0 : r0 + rows]
        pos = q_positions[:, r0 : r0 + rows]
        needed = -(-min(tk, int(pos.max()) + 1) // KV_BLOCK) if pos.numel() else 0
        group = max(1, _CHUNK_ELEMENTS // max(1, b * hq * qc.shape[3] * KV_BLOCK * d))
        m = torch.full(qc.shape[:4], -math.inf)
        l = torch.zeros(qc.shape[:4])
        acc = torch.zeros(qc.shape)
        for g0 in range(0, needed, group):
            g1 = min(needed, g0 + group)
            kg = kb_all[:, g0:g1].to(torch.float32).permute(0, 3, 1, 2, 4)[:, :, None, None]  # [B,Hkv,1,1,G,KB,D]
            vg = vb_all[:, g0:g1].to(torch.float32).permute(0, 3, 1, 4, 2)[:, :, None, None]  # [B,Hkv,1,1,G,D,KB]
            # Everything below is elementwise per (query, block); only the l/acc recurrence is sequential.
            s = tree_sum(qc[:, :, :, :, None, None, :] * kg) * scale  # [B, Hkv, grp, Tq, G, KB]
            kpos = torch.arange(g0 * KV_BLOCK, g1 * KV_BLOCK).view(g1 - g0, KV_BLOCK)
            visible = (kpos[None, None] <= pos[:, :, None, None]) & (kpos[None, None] < k_lengths[:, None, None, None])
            s = torch.where(visible[:, None, None], s, -math.inf)
            m_blk = torch.cummax(torch.cat([m[..., None], s.amax(-1)], dim=-1), dim=-1).values  # running max, exact
            m_ref = torch.where(torch.isinf(m_blk), torch.zeros_like(m_blk), m_blk)
            alpha = exp(m_blk[..., :-1] - m_ref[..., 1:])
            p = exp(s - m_ref[..., 1:, None])
            p_sum = tree_sum(p)
            pv = tree_sum(p[..., None, :] * vg)  # [B, Hkv, grp, Tq, G, D]
            for j in range(g1 - g0):
                l = l * alpha[..., j] + p_sum[..., j]
                acc = acc * alpha[..., j, None] + pv[..., j, :]
            m = m_blk[..., -1]
        empty = l == 0
        out[:, :, :, r0 : r0 + rows] = torch.where(empty[..., None], 0.0, acc / torch.where(empty, 1.0, l)[..., None])
        lse[:, :, :, r0 : r0 + rows] = torch.where(empty, -math.inf, m + log(l))
    return out.reshape(b, hq, tq, d).transpose(1, 2).to(q.dtype), lse.reshape(b, hq, tq)


def _visible_mask(q_positions, k_lengths, tk):
    kpos = torch.arange(tk, device=q_positions.device)
    return (kpos[None, None, :] <= q_positions[:, :, None]) & (kpos[None, None, :] < k_lengths[:, None, None])


class AttentionFunction(torch.autograd.Function):
    """Autograd wrapper: consistent forward, float32 materialised-softmax backward."""

    @staticmethod
    def forward(ctx, q, k, v, q_positions, k_lengths, scale):
        out, lse = implementation("attention", q.device)(q, k, v, q_positions, k_lengths, scale)
        ctx.save_for_backward(q, k, v, q_positions, k_lengths, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, q_positions, k_lengths, out, lse = ctx.saved_tensors
        try:
            fused = implementation("attention_backward", q.device)
        except NoConsistentKernelError:
            fused = None
        if fused is not None:
            dq, dk, dv = fused(grad_out, q, k, v, out, lse, q_positions, k_lengths, ctx.scale)
            return dq, dk, dv, None, None, None
        hq, hkv = q.shape[2], k.shape[2]
        qf = q.to(torch.float32).transpose(1, 2)
        kf, vf = _expand_heads(k, hq), _expand_heads(v, hq)
        go = grad_out.to(torch.float32).transpose(1, 2)
        of = out.to(torch.float32).transpose(1, 2)
        visible = _visible_mask(q_positions, k_lengths, k.shape[1])[:, None]
        s = (qf @ kf.transpose(-1, -2)) * ctx.scale
        p = torch.where(visible, torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None]), 0.0)
        dv = p.transpose(-1, -2) @ go
        dp = go @ vf.transpose(-1, -2)
        ds = p * (dp - (go * of).sum(-1, keepdim=True))
        dq = (ds @ kf) * ctx.scale
        dk = (ds.transpose(-1, -2) @ qf) * ctx.scale
        group = hq // hkv

        def fold(x):  # [B, Hq, Tk, D] -> [B, Tk, Hkv, D], summing the heads that share a KV head
            bsz, _, t, dim = x.shape
            return x.reshape(bsz, hkv, group, t, dim).sum(2).transpose(1, 2)

        return (dq.transpose(1, 2).to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype), None, None, None)


def attention(q, k, v, q_positions, k_lengths=None, *, scale: float | None = None) -> torch.Tensor:
    """Causal attention under the contract above; returns ``[B, Tq, Hq, D]`` in q's dtype."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"attention: expected q [B,Tq,Hq,D], k/v [B,Tk,Hkv,D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] % k.shape[2] or q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0]:
        raise ValueError(f"attention: incompatible q {tuple(q.shape)} and k {tuple(k.shape)}")
    if q_positions.shape != q.shape[:2]:
        raise ValueError(f"attention: q_positions must be [B, Tq] = {tuple(q.shape[:2])}, got {tuple(q_positions.shape)}")
    if k_lengths is None:
        k_lengths = torch.full((q.shape[0],), k.shape[1], dtype=torch.int64, device=q.device)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return AttentionFunction.apply(q, k, v, q_positions.to(torch.int64), k_lengths.to(torch.int64), float(scale))


def causal_positions(batch: int, length: int, device=None) -> torch.Tensor:
    """``[batch, length]`` positions 0..length-1: the q_positions of whole training sequences."""
    return torch.arange(length, device=device).expand(batch, length)

"""Mamba-2 selective state space (SSD) — chunked scan with a decode/chunked-prefill replay.

Shapes: ``x [..., T, H, P]`` (model dtype), ``dt [..., T, H]`` float32, ``A [H]`` float32
(``= -exp(A_log)``, :func:`ssm_decay_rate`), ``B, C [..., T, G, N]`` (model dtype), ``D [H]``, state ``[..., H, P, N]``
float32.  Head ``h`` reads group ``g(h) = h // (H // G)``.  The recurrence is
``S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T``, ``y_t = C_t . S_t + D x_t``; it is evaluated
in chunks of ``L = chunk_size`` tokens aligned to absolute position 0 of the segment (the
segment must start on a chunk boundary; ``initial_state`` is the state at that boundary).

Numerics contract (CPU, every accumulation float32, every op elementwise IEEE or a
:func:`numerics.tree_sum` over a FIXED length — evaluated as :func:`_tree_sum0` with the reduced
axis outermost, same pairing, same bits):

1. ``a_i = dt_i * A`` (float32); within a chunk ``cum`` = inclusive prefix sum of ``a`` by the
   doubling scan: ``cum = a``; for ``k = 1, 2, 4, ... < L``: ``cum_i = cum_i + cum_{i-k}`` for all
   ``i >= k`` at once (:func:`_prefix_sum`) — ``cum_t`` is a fixed binary combination of the
   chunk's ``a_0..a_t`` only (log2(L) adds deep; a sequential sum would cost L dependent steps).
   Tokens past the end of a partial chunk are zero-padded (``dt = x = B = C = 0``).
2. Intra-chunk term of position ``t`` (row ``t`` of its chunk, ``s`` over ALL ``L`` rows):
   ``cb[t,s,g] = tree_sum_N(C_t[g,n] * B_s[g,n])``;
   ``w[t,s,h] = (cb[t,s,g(h)] * exp(cum_t - cum_s)) * dt_s`` for ``s <= t``, exactly ``+0`` for
   ``s > t`` (mask applied with ``where`` before and after the :func:`numerics.exp`);
   ``intra[t,h,p] = tree_sum_{s=0..L-1}(w[t,s,h] * x_s[h,p])`` — the tree is over the full
   chunk, so a partial chunk reduces exactly like a full one.
3. Inter-chunk term: ``inter[t,h,p] = tree_sum_N(C_t[g(h),n] * S_c[h,p,n]) * exp(cum_t)`` with
   ``S_c`` the state at the start of ``t``'s chunk.
4. ``y_t = round_to_dtype((intra + inter) + D[h] * x_t[h,p])`` — one rounding to ``x.dtype``.
5. State at the end of a COMPLETE chunk:
   ``u[s,h] = exp(cum_{L-1} - cum_s) * dt_s``;
   ``S_{c+1}[h,p,n] = exp(cum_{L-1}) * S_c[h,p,n] + tree_sum_{s=0..L-1}((u[s,h] * x_s[h,p]) * B_s[g(h),n])``.
   Only complete chunks update the state; ``boundary_state`` is the state after the last one.

So ``y_t`` depends only on (the boundary state of ``t``'s chunk, the tokens of ``t``'s
chunk up to ``t``): its bits do not depend on ``T``, on how the sequence was split into
prefill pieces / decode steps, on the other sequences of the batch or on the thread
count.  ``ssd_continue`` replays the partial chunk (pending tokens ++ new tokens) from the
last boundary state and evaluates exactly the same expressions, so decode gives the
whole-sequence bits.  Backward (not batch-invariant, only correct): float32 recompute of
the same math with differentiable torch ops (cumsum/einsum; segment sums ``a_{s+1} + .. + a_t``
as masked cumsums so ``grad A`` stays accurate when decays are tiny) + ``torch.autograd.grad``.
"""

from __future__ import annotations

import math
import os
from typing import Callable, NamedTuple

import torch

from .dispatch import implementation, register
from .numerics import exp, log

# Output positions (and complete chunks, x4) are evaluated in blocks whose float32 work tensors stay
# under about this many elements — a memory bound only: every element is computed by the same ops.
_WORK_ELEMENTS = 1 << 22


# --------------------------------------------------------------------------- mamba_dt


@register("mamba_dt", "cpu")
def _mamba_dt_cpu(dt_raw, dt_bias, dt_min: float, dt_max: float) -> torch.Tensor:
    v = dt_raw.to(torch.float32) + dt_bias.to(torch.float32)
    e = exp(v)
    sp = torch.where(v > 20.0, v, torch.where(v < -20.0, e, log(1.0 + e.to(torch.float64))))
    return torch.clamp(sp, min=dt_min, max=dt_max)


class MambaDtFunction(torch.autograd.Function):
    """Autograd wrapper for :func:`mamba_dt` (closed-form float32 backward)."""

    @staticmethod
    def forward(ctx, dt_raw, dt_bias, dt_min, dt_max):
        out = implementation("mamba_dt", dt_raw.device)(dt_raw, dt_bias, dt_min, dt_max)
        ctx.save_for_backward(dt_raw, dt_bias, out)
        ctx.dt_min, ctx.dt_max = dt_min, dt_max
        return out

    @staticmethod
    def backward(ctx, grad_out):
        dt_raw, dt_bias, out = ctx.saved_tensors
        v = dt_raw.to(torch.float32) + dt_bias.to(torch.float32)
        sig = torch.where(v > 20.0, torch.ones_like(v), torch.sigmoid(v))
        sp = _mamba_dt_cpu(dt_raw, dt_bias, -math.inf, math.inf)      # the forward's unclamped value
        inside = (sp >= ctx.dt_min) & (sp <= ctx.dt_max)
        g = torch.where(inside, grad_out.to(torch.float32) * sig, torch.zeros_like(v))
        grad_bias = g.reshape(-1, g.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        return g.to(dt_raw.dtype), None if grad_bias is None else grad_bias.to(dt_bias.dtype), None, None


def mamba_dt(dt_raw: torch.Tensor, dt_bias: torch.Tensor, dt_min: float = 0.0, dt_max: float = math.inf) -> torch.Tensor:
    """``clamp(softplus(dt_raw + dt_bias), dt_min, dt_max)`` in float32 ``[..., T, H]``.

    ``v = float32(dt_raw) + float32(dt_bias)``; softplus(v) = ``v`` for ``v > 20``, ``exp(v)`` for
    ``v < -20`` (relative difference < 1e-9), else ``log(1 + exp(v))`` with :func:`numerics.exp`
    (float32), the ``1 +`` in float64 and :func:`numerics.log` (one rounding); then the clamp.
    Elementwise, so position- and batch-independent.
    """
    if dt_bias.shape != (dt_raw.shape[-1],):
        raise ValueError(f"mamba_dt: dt_bias {tuple(dt_bias.shape)} does not match {dt_raw.shape[-1]} heads")
    if not dt_min <= dt_max:
        raise ValueError(f"mamba_dt: dt_min {dt_min} > dt_max {dt_max}")
    return MambaDtFunction.apply(dt_raw, dt_bias, float(dt_min), float(dt_max))


# --------------------------------------------------------------------------- ssm_decay_rate


class SSMDecayRateFunction(torch.autograd.Function):
    """Autograd wrapper for :func:`ssm_decay_rate` (closed-form backward ``g * A``)."""

    @staticmethod
    def forward(ctx, a_log):
        a = -exp(a_log.to(torch.float32))
        ctx.save_for_backward(a)
        ctx.dtype = a_log.dtype
        return a

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return (g * a).to(ctx.dtype)  # d(-exp(x))/dx = -exp(x) = A


def ssm_decay_rate(a_log: torch.Tensor) -> torch.Tensor:
    """``A = -exp(float32(A_log))`` with :func:`numerics.exp` (float32, one rounding), float32 ``[H]``; backward ``g * A``."""
    return SSMDecayRateFunction.apply(a_log)


# --------------------------------------------------------------------------- SSD forward


def _prefix_sum(a: torch.Tensor, dim: int) -> torch.Tensor:
    """Inclusive prefix sum along ``dim`` by the doubling (Hillis-Steele) scan.

    For ``k = 1, 2, 4, ... < n``: ``out[i] = out[i] + out[i - k]`` for every ``i >= k`` at once
    (one IEEE add each).  Position ``i``'s value is a fixed binary combination of ``a[0..i]``:
    it never reads a later element and its tree does not depend on ``n``.
    """
    out = a.movedim(dim, 0)
    k = 1
    while k < out.shape[0]:
        out = torch.cat([out[:k], out[k:] + out[:-k]])
        k *= 2
    return out.movedim(0, dim)


def _tree_sum0(x: torch.Tensor) -> torch.Tensor:
    """:func:`numerics.tree_sum` over axis 0 — the same zero padding and pairing (``i`` with ``i + n/2``),
    so the same bits — with the reduced axis outermost, where each tree level adds two contiguous halves."""
    n = x.shape[0]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = torch.cat([x, x.new_zeros(width - n, *x.shape[1:])])
    while width > 1:
        width //= 2
        x = x[:width] + x[width:]
    return x[0]


def _chunked(v, n_chunks: int, L: int, dtype: torch.dtype | None = None):
    """``[b, T, ...] -> [b, n_chunks, L, ...]`` in ``dtype`` (default ``v``'s, an exact conversion), zero rows
    appended up to ``n_chunks * L``: ``v`` read once, written once."""
    t_len = v.shape[1]
    if n_chunks * L == t_len:
        out = v.to(dtype or v.dtype)
    else:
        out = v.new_empty(v.shape[0], n_chunks * L, *v.shape[2:], dtype=dtype or v.dtype)
        out[:, :t_len] = v
        out[:, t_len:] = 0
    return out.reshape(v.shape[0], n_chunks, L, *v.shape[2:])


def _chunk_contributions(xc, dtc, bc, cum, n_complete: int, active=None):
    """Contract step 5's per-chunk term for the ``n_complete >= 1`` complete chunks, ``[b,k,H,P,N]`` (a view):
    ``tree_sum_{s=0..L-1}((u[s,h] * x_s[h,p]) * B_s[g(h),n])`` with ``u[s,h] = exp(cum_{L-1} - cum_s) * dt_s``, in
    blocks of chunks and heads (memory only: every element is computed by the same ops).  Every row is computed
    (``active``, the rows whose terms are used, is for kernels that skip the others)."""
    bsz, _, L, nh, hp = xc.shape
    ng, ns = bc.shape[-2:]
    heads = torch.arange(nh, device=xc.device) // (nh // ng)
    per_chunk = bsz * nh * hp * ns * L
    cblock = max(1, (4 * _WORK_ELEMENTS) // per_chunk)               # chunks per block (then heads per block)
    parts = []
    for c0 in range(0, n_complete, cblock):
        cs = slice(c0, min(n_complete, c0 + cblock))
        last = cum[:, cs, L - 1]                                      # [b,k,H]
        u = (exp(last[:, :, None, :] - cum[:, cs]) * dtc[:, cs]).permute(2, 0, 1, 3)   # [L,b,k,H]
        ux = u[..., None] * xc[:, cs].permute(2, 0, 1, 3, 4).contiguous()            # [L,b,k,H,P]
        bh = bc[:, cs][:, :, :, heads, :].permute(2, 4, 0, 1, 3).contiguous()      # [L,N,b,k,H]
        hblock = max(1, (_WORK_ELEMENTS // 4) // (per_chunk // nh * ux.shape[2]))   # heads per work tensor
        parts.append(torch.cat([_tree_sum0(ux[:, None, ..., h0:h0 + hblock, :] * bh[..., h0:h0 + hblock, None])
                                for h0 in range(0, nh, hblock)], dim=3))  # [N,b,k,H,P]
    return torch.cat(parts, dim=2).permute(1, 2, 3, 4, 0)


def _chunk_prefix_sums(dtc, A):
    """Contract step 1: ``cum [b,c,L,H]`` = the doubling-scan prefix sums of ``a = dt * A`` within each chunk."""
    return _prefix_sum(dtc * A.to(torch.float32), dim=2)


class SSDSteps(NamedTuple):
    """How the scan's bulk steps are evaluated (each the contract's operations in its order, so the same bits):
    ``prefix_sums`` (:func:`_chunk_prefix_sums`' signature), ``contributions`` (:func:`_chunk_contributions`'),
    ``outputs`` (:func:`_ssd_outputs`')."""

    prefix_sums: Callable
    contributions: Callable
    outputs: Callable


def _ssd_chunk_states(x, dt, A, B, C, chunk_size: int, state, steps: SSDSteps | None = None,
                      complete_chunks: int | None = None, active=None):
    """Contract steps 1 and 5.  Shapes flattened: x [b,T,H,P], dt [b,T,H], B/C [b,T,G,N], state [b,H,P,N] fp32;
    ``steps``: how steps 1 and 5's per-chunk terms are evaluated (default: :data:`TORCH_STEPS`);
    ``complete_chunks``: the end states formed (default: of every complete chunk; fewer when no output needs them);
    ``active`` ``[b]`` bool: the rows whose new states are used (the others' state terms may be skipped by a kernel:
    their new states are then not the contract's).

    Returns the chunked float32 operands ``xc [b,c,L,H,P]``, ``dtc [b,c,L,H]``, ``bc`` / ``cc [b,c,L,G,N]`` (zero rows
    past T), the prefix sums ``cum [b,c,L,H]``, the states at the chunk starts ``[b,k+1,H,P,N]`` (``k`` complete
    chunks: the last entry is the state after them; with none, a view of ``state``) and that last state again as
    ``[b,H,P,N]`` (the state layout throughout: no copies of it in another order).
    """
    t_len = x.shape[1]
    L = chunk_size
    n_chunks = -(-t_len // L)
    n_complete = t_len // L if complete_chunks is None else min(complete_chunks, t_len // L)

    def chunks(v):
        return _chunked(v, n_chunks, L, torch.float32)

    steps = steps or TORCH_STEPS
    xc, dtc, bc, cc = chunks(x), chunks(dt), chunks(B), chunks(C)   # [b,c,L,...]
    cum = steps.prefix_sums(dtc, A)                                  # [b,c,L,H]

    # 5. states at chunk boundaries: S_{c+1} = exp(cum_{L-1}) * S_c + contrib_c, in chunk order, as [b,H,P,N].
    s = state
    if not n_complete:
        return xc, dtc, bc, cc, cum, s[:, None], s
    states = [s]
    contrib = steps.contributions(xc, dtc, bc, cum, n_complete, active)   # [b,k,H,P,N]
    decay = exp(cum[:, :n_complete, L - 1])                           # [b,k,H]
    for j in range(n_complete):
        s = decay[:, j, :, None, None] * s + contrib[:, j]
        states.append(s)
    return xc, dtc, bc, cc, cum, torch.stack(states, dim=1), s


def output_positions(bsz: int, first_out: int, t_len: int, device) -> torch.Tensor:
    """``[b, t_len - first_out]`` int64: positions ``first_out .. t_len - 1`` for each of ``b`` sequences (the
    ``positions`` argument of :func:`_ssd_outputs` for a scan's outputs)."""
    return torch.arange(first_out, t_len, device=device).expand(bsz, t_len - first_out)


def _ssd_outputs(xc, dtc, bc, cc, cum, all_states, D, positions, out_dtype):
    """Contract steps 2-4 from :func:`_ssd_chunk_states`' tensors at ``positions [b, o]`` (int64: sequence ``i``'s
    outputs are those of its positions ``positions[i]``), in blocks of output columns; ``y [b, o, H, P]`` in
    ``out_dtype``.  Gathers move values only: an output's bits do not depend on which positions are asked beside it."""
    bsz, _, L, nh, hp = xc.shape
    ng, ns = bc.shape[-2:]
    dev = xc.device
    heads = torch.arange(nh, device=dev) // (nh // ng)
    d32 = D.to(torch.float32)
    ys = []
    per_pos = nh * hp * max(L, ns) + L * ng * ns                    # largest work tensors per position
    block = max(1, _WORK_ELEMENTS // (bsz * per_pos))
    rows = torch.arange(L, device=dev)
    seqs = torch.arange(bsz, device=dev)[:, None]
    for start in range(0, positions.shape[1], block):
        pos = positions[:, start:start + block]                       # [b,o]
        ci, ri = pos // L, pos % L
        cum_c = cum[seqs, ci]                                         # [b,o,L,H]
        cum_t = cum_c[seqs, torch.arange(pos.shape[1], device=dev)[None, :], ri]   # [b,o,H]
        c_t = cc[seqs, ci, ri].permute(3, 0, 1, 2)                    # [N,b,o,G]
        cb = _tree_sum0(c_t[:, :, :, None, :] * bc[seqs, ci].permute(4, 0, 1, 2, 3).contiguous())  # [b,o,L,G]
        mask = (rows[None, None, :] <= ri[:, :, None])[..., None]     # [b,o,L,1]
        seg = torch.where(mask, cum_t[:, :, None, :] - cum_c, 0.0)
        e = exp(torch.cat([seg, cum_t[:, :, None, :]], dim=2))        # [b,o,L+1,H]
        w = torch.where(mask, (cb[..., heads] * e[:, :, :L]) * dtc[seqs, ci], 0.0)   # [b,o,L,H]
        intra = _tree_sum0(w.permute(2, 0, 1, 3)[..., None] * xc[seqs, ci].permute(2, 0, 1, 3, 4).contiguous())  # [b,o,H,P]
        inter = _tree_sum0(c_t[..., heads][..., None] * all_states[seqs, ci].permute(4, 0, 1, 2, 3)) * e[:, :, L, :, None]
        x_t = xc[seqs, ci, ri]                                        # [b,o,H,P]
        ys.append(((intra + inter) + d32[:, None] * x_t).to(out_dtype))
    return torch.cat(ys, dim=1) if ys else xc.new_zeros(bsz, 0, nh, hp, dtype=out_dtype)


def ssd_scan_by(steps: SSDSteps):
    """The contract forward (``ssd_scan``'s signature after ``D``: ``chunk_size, state, first_out``) with its bulk
    steps evaluated by ``steps``: returns ``(y [b, T - first_out, H, P] in x.dtype, state after the last complete
    chunk)``."""

    def scan(x, dt, A, B, C, D, chunk_size: int, state, first_out: int):
        xc, dtc, bc, cc, cum, all_states, boundary = _ssd_chunk_states(x, dt, A, B, C, chunk_size, state, steps)
        positions = output_positions(x.shape[0], first_out, x.shape[1], x.device)
        return steps.outputs(xc, dtc, bc, cc, cum, all_states, D, positions, x.dtype), boundary

    return scan


TORCH_STEPS = SSDSteps(_chunk_prefix_sums, _chunk_contributions, _ssd_outputs)


def torch_ssd_evaluation() -> bool:
    """``MC_SSD_SCAN``: ``torch`` -- CUDA evaluates the SSD steps and the decode step's in-place outputs and end states
    with the torch reference (slow; its decode step reads ``max(p)`` and the closing rows on the host, so no CUDA
    graph can hold it), ``triton`` or unset -- the Triton kernels; anything else is refused by name."""
    choice = os.environ.get("MC_SSD_SCAN", "triton")
    if choice not in ("torch", "triton"):
        raise ValueError(f"MC_SSD_SCAN={choice!r}: expected 'torch' or 'triton'")
    return choice == "torch"
_ssd_cpu = ssd_scan_by(TORCH_STEPS)
register("ssd_steps", "cpu")(TORCH_STEPS)


def _ssd_autograd(x, dt, A, B, C, D, chunk_size: int, state):
    """Differentiable float32 chunked SSD (torch cumsum/einsum; for the backward only).

    Same mathematics as the contract, not the same bits.  Returns (y [b,T,H,P], boundary state).
    """
    bsz, t_len, nh, hp = x.shape
    ng = B.shape[-2]
    L = chunk_size
    dev = x.device
    rep = nh // ng
    n_chunks = -(-t_len // L)
    n_complete = t_len // L

    def chunks(v):
        return _chunked(v, n_chunks, L)

    def per_head(v):  # [b,c,L,G,N] -> [b,c,L,H,N], head h reads group h // rep; an expand, so its backward is a
        # fixed-shape sum over the rep heads of a group (no index_put / atomic scatter on CUDA)
        return v[..., None, :].expand(*v.shape[:-1], rep, v.shape[-1]).reshape(*v.shape[:-2], nh, v.shape[-1])

    xc, dtc = chunks(x), chunks(dt)
    bc, cc = per_head(chunks(B)), per_head(chunks(C))                 # [b,c,L,H,N]
    a = dtc * A                                                       # [b,c,L,H]
    cum = torch.cumsum(a, dim=2)
    # seg[t,s] = a_{s+1} + ... + a_t as a masked cumsum (not cum_t - cum_s): the diagonal is an empty sum, so
    # the gradient carries no O(1) pairs that cancel to a tiny grad A (decays far below 1).
    strict = torch.tril(torch.ones(L, L, dtype=torch.bool, device=dev), diagonal=-1)[None, None, :, :, None]   # k > s
    seg = torch.cumsum(torch.where(strict, a[:, :, :, None, :], torch.zeros((), dtype=a.dtype)), dim=2)  # [b,c,t,s,H]
    tri = torch.tril(torch.ones(L, L, dtype=torch.bool, device=dev))[None, None, :, :, None]
    decay = torch.where(tri, torch.exp(torch.where(tri, seg, torch.zeros((), dtype=a.dtype))), torch.zeros((), dtype=a.dtype))
    cb = torch.einsum("bcthn,bcshn->bctsh", cc, bc)
    intra = torch.einsum("bctsh,bcsh,bcshp->bcthp", cb * decay, dtc, xc)
    states = [state]
    s = state
    for c in range(n_complete):
        u = decay[:, c, -1] * dtc[:, c]                               # exp(a_{s+1} + ... + a_{L-1}) * dt_s
        s = torch.exp(cum[:, c, -1])[:, :, None, None] * s + torch.einsum("bsh,bshp,bshn->bhpn", u, xc[:, c], bc[:, c])
        states.append(s)
    s_c = torch.stack(states[:n_chunks], dim=1)                       # [b,c,H,P,N]
    inter = torch.einsum("bcthn,bchpn->bcthp", cc, s_c) * torch.exp(cum)[..., None]
    y = (intra + inter + D[:, None] * xc).reshape(bsz, n_chunks * L, nh, hp)[:, :t_len]
    return y, states[n_complete]


class SSDScanFunction(torch.autograd.Function):
    """Autograd wrapper for the chunked scan; returns outputs for positions ``first_out..T-1``."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, state, chunk_size, first_out):
        ctx.save_for_backward(x, dt, A, B, C, D, state)
        ctx.chunk_size, ctx.first_out = chunk_size, first_out
        return ssd_scan_by(implementation("ssd_steps", x.device))(x, dt, A, B, C, D, chunk_size, state, first_out)

    @staticmethod
    def backward(ctx, grad_y, grad_state):
        saved = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().to(torch.float32).requires_grad_(True) for t in saved]
            y, bstate = _ssd_autograd(*leaves[:6], ctx.chunk_size, leaves[6])
            outs = [y[:, ctx.first_out:]]
            gouts = [grad_y.to(torch.float32)]
            if grad_state is not None:
                outs.append(bstate)
                gouts.append(grad_state.to(torch.float32))
            grads = torch.autograd.grad(outs, leaves, gouts, allow_unused=True)
        return tuple(torch.zeros_like(t) if g is None else g.to(t.dtype) for g, t in zip(grads, saved)) + (None, None)


# --------------------------------------------------------------------------- public API


def _check(x, dt, A, B, C, D, chunk_size, state):
    if x.dim() < 3:
        raise ValueError(f"ssd: x must be [..., T, H, P], got {tuple(x.shape)}")
    lead, t_len, nh, hp = x.shape[:-3], x.shape[-3], x.shape[-2], x.shape[-1]
    if dt.shape != (*lead, t_len, nh):
        raise ValueError(f"ssd: dt {tuple(dt.shape)} is not {(*lead, t_len, nh)}")
    if B.dim() != x.dim() or B.shape[:-2] != (*lead, t_len) or C.shape != B.shape:
        raise ValueError(f"ssd: B {tuple(B.shape)} / C {tuple(C.shape)} are not [..., T={t_len}, G, N]")
    ng = B.shape[-2]
    if ng < 1 or nh % ng:
        raise ValueError(f"ssd: {nh} heads cannot be split over {ng} groups")
    if A.shape != (nh,) or (D is not None and D.shape != (nh,)):
        raise ValueError(f"ssd: A {tuple(A.shape)} and D {None if D is None else tuple(D.shape)} must be [H={nh}]")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"ssd: chunk_size must be a positive int, got {chunk_size!r}")
    if state is not None and state.shape != (*lead, nh, hp, B.shape[-1]):
        raise ValueError(f"ssd: state {tuple(state.shape)} is not {(*lead, nh, hp, B.shape[-1])}")
    if state is not None and state.dtype != torch.float32:
        raise ValueError(f"ssd: state must be float32, got {state.dtype}")


def _scan(x, dt, A, B, C, D, chunk_size, state, first_out):
    lead = x.shape[:-3]
    t_len, nh, hp = x.shape[-3:]
    ng, ns = B.shape[-2:]
    nb = 1
    for n in lead:
        nb *= n
    flat = lambda v, *tail: v.reshape(nb, *tail)  # noqa: E731
    if state is None:
        state = torch.zeros(*lead, nh, hp, ns, dtype=torch.float32, device=x.device)
    y, bstate = SSDScanFunction.apply(
        flat(x, t_len, nh, hp), flat(dt, t_len, nh), A, flat(B, t_len, ng, ns), flat(C, t_len, ng, ns), D,
        flat(state, nh, hp, ns), chunk_size, first_out,
    )
    return y.reshape(*lead, t_len - first_out, nh, hp), bstate.reshape(*lead, nh, hp, ns)


def ssd_scan(x, dt, A, B, C, D, chunk_size: int, initial_state=None):
    """Chunked SSD scan of a segment starting on a chunk boundary; returns ``(y, boundary_state)``.

    ``y [..., T, H, P]`` in ``x.dtype`` (D skip included, no z gating); ``boundary_state``
    float32 ``[..., H, P, N]`` = the state after the last COMPLETE chunk (``initial_state``
    or zeros if none completed).
    """
    _check(x, dt, A, B, C, D, chunk_size, initial_state)
    return _scan(x, dt, A, B, C, D, chunk_size, initial_state, 0)


def ssd_outputs_at(x, dt, A, B, C, D, chunk_size: int, initial_state, positions: torch.Tensor) -> torch.Tensor:
    """``y [..., H, P]``: the output :func:`ssd_scan` gives at position ``positions[i]`` of sequence ``i`` (same
    bits), and no other, for a segment of at most one chunk (``T <= chunk_size``: a decode step's replay) from the
    state at its start; no state is formed (:func:`ssd_chunk_end_state`).  ``positions`` ``[...]`` int64, each
    ``< T``.  Inference only (no backward)."""
    _check(x, dt, A, B, C, D, chunk_size, initial_state)
    lead, (t_len, nh, hp), (ng, ns) = x.shape[:-3], x.shape[-3:], B.shape[-2:]
    if positions.shape != lead:
        raise ValueError(f"ssd_outputs_at: positions {tuple(positions.shape)} is not {tuple(lead)}")
    if t_len > chunk_size:
        raise ValueError(f"ssd_outputs_at: {t_len} tokens, at most one chunk ({chunk_size})")
    nb = positions.numel()
    if initial_state is None:
        initial_state = torch.zeros(*lead, nh, hp, ns, dtype=torch.float32, device=x.device)
    steps = implementation("ssd_steps", x.device)
    with torch.no_grad():
        ops = _ssd_chunk_states(x.reshape(nb, t_len, nh, hp), dt.reshape(nb, t_len, nh), A,
                                B.reshape(nb, t_len, ng, ns), C.reshape(nb, t_len, ng, ns), chunk_size,
                                initial_state.reshape(nb, nh, hp, ns), steps, complete_chunks=0)[:6]
        y = steps.outputs(*ops, D, positions.reshape(nb, 1).to(torch.int64), x.dtype)
    return y.reshape(*lead, nh, hp)


def ssd_chunk_end_state(x, dt, A, B, C, chunk_size: int, state, closing: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 state ``[..., H, P, N]`` after one complete chunk (``T == chunk_size`` tokens) from ``state`` at its
    start: :func:`ssd_scan`'s boundary state, same bits.  ``closing`` ``[...]`` bool: only those rows' new states
    (the others get ``state`` back, and a kernel may skip their work); None: every row.  Inference only."""
    _check(x, dt, A, B, C, None, chunk_size, state)
    lead, (t_len, nh, hp), (ng, ns) = x.shape[:-3], x.shape[-3:], B.shape[-2:]
    if t_len != chunk_size:
        raise ValueError(f"ssd_chunk_end_state: {t_len} tokens, not one chunk ({chunk_size})")
    if state is None:
        raise ValueError("ssd_chunk_end_state: the state at the chunk's start is required")
    if closing is not None and closing.shape != lead:
        raise ValueError(f"ssd_chunk_end_state: closing {tuple(closing.shape)} is not {tuple(lead)}")
    nb = math.prod(lead)
    flat_state = state.reshape(nb, nh, hp, ns)
    active = None if closing is None else closing.reshape(nb)
    with torch.no_grad():
        end = _ssd_chunk_states(x.reshape(nb, t_len, nh, hp), dt.reshape(nb, t_len, nh), A,
                                B.reshape(nb, t_len, ng, ns), C.reshape(nb, t_len, ng, ns), chunk_size, flat_state,
                                implementation("ssd_steps", x.device), active=active)[6]
        if active is not None:
            end = torch.where(active[:, None, None, None], end, flat_state)
    return end.reshape(*lead, nh, hp, ns)


def empty_pending(x_like_shape, nh, hp, ng, ns, dtype, device=None):
    """An empty ``pending`` tuple ``(x, dt, B, C)`` with 0 tokens for leading dims ``x_like_shape``."""
    lead = tuple(x_like_shape)
    return (torch.zeros(*lead, 0, nh, hp, dtype=dtype, device=device),
            torch.zeros(*lead, 0, nh, dtype=torch.float32, device=device),
            torch.zeros(*lead, 0, ng, ns, dtype=dtype, device=device),
            torch.zeros(*lead, 0, ng, ns, dtype=dtype, device=device))


def ssd_continue(boundary_state, pending, x, dt, B, C, A, D, chunk_size: int):
    """Decode / chunked-prefill step: replay ``pending ++ new`` from the last chunk boundary.

    ``pending`` = ``(x, dt, B, C)`` of the tokens since the last boundary (fewer than
    ``chunk_size``; ``None`` = no tokens), ``boundary_state`` = the float32 state at that
    boundary (``None`` = zeros).  Returns ``(y_new, boundary_state', pending')``: the new
    tokens' outputs (same bits as a whole-sequence :func:`ssd_scan`), the state after the
    last complete chunk, and the tokens since that boundary.
    """
    lead = x.shape[:-3]
    if pending is None:
        pending = empty_pending(lead, x.shape[-2], x.shape[-1], B.shape[-2], B.shape[-1], x.dtype, x.device)
    px, pdt, pb, pc = pending
    n_pending = px.shape[-3]
    if n_pending >= chunk_size:
        raise ValueError(f"ssd_continue: {n_pending} pending tokens, must be fewer than chunk_size {chunk_size}")
    for name, p, v, tail in (("x", px, x, 2), ("dt", pdt, dt, 1), ("B", pb, B, 2), ("C", pc, C, 2)):
        if p.shape[:-1 - tail] != v.shape[:-1 - tail] or p.shape[-tail:] != v.shape[-tail:]:
            raise ValueError(f"ssd_continue: pending {name} {tuple(p.shape)} does not match new {name} {tuple(v.shape)}")
    xs = torch.cat([px.to(x.dtype), x], dim=-3)
    dts = torch.cat([pdt.to(torch.float32), dt.to(torch.float32)], dim=-2)
    bs = torch.cat([pb.to(B.dtype), B], dim=-3)
    cs = torch.cat([pc.to(C.dtype), C], dim=-3)
    _check(xs, dts, A, bs, cs, D, chunk_size, boundary_state)
    y, bstate = _scan(xs, dts, A, bs, cs, D, chunk_size, boundary_state, n_pending)
    keep = (xs.shape[-3] // chunk_size) * chunk_size
    new_pending = (xs[..., keep:, :, :], dts[..., keep:, :], bs[..., keep:, :, :], cs[..., keep:, :, :])
    return y, bstate, new_pending


# --------------------------------------------------------------------------- decode step, in place from the state cache


def _check_state_caches(op, xbc_cache, dt_cache, state_cache, chunk_size, n_groups, state_size, nh):
    """The mixer's state caches as ``op`` takes them (one-line ValueErrors naming the argument): ``xbc_cache [slots,
    L, H*P + 2*G*N]``, ``dt_cache [slots, L, H]`` and ``state_cache [slots, H, P, N]`` float32; returns ``P``."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{op}: chunk_size must be a positive int, got {chunk_size!r}")
    if xbc_cache.dim() != 3 or xbc_cache.shape[1] != chunk_size:
        raise ValueError(f"{op}: xbc_cache {tuple(xbc_cache.shape)} is not [slots, L={chunk_size}, conv_dim]")
    n_slots, conv_dim, gn = xbc_cache.shape[0], xbc_cache.shape[2], n_groups * state_size
    if n_groups < 1 or state_size < 1 or nh < 1 or nh % n_groups or conv_dim <= 2 * gn or (conv_dim - 2 * gn) % nh:
        raise ValueError(f"{op}: conv_dim {conv_dim} is not H*P + 2*G*N for H={nh}, G={n_groups}, N={state_size}")
    hp = (conv_dim - 2 * gn) // nh
    if dt_cache.shape != (n_slots, chunk_size, nh) or dt_cache.dtype != torch.float32:
        raise ValueError(f"{op}: dt_cache {tuple(dt_cache.shape)} {dt_cache.dtype} is not float32 {(n_slots, chunk_size, nh)}")
    if state_cache.shape != (n_slots, nh, hp, state_size) or state_cache.dtype != torch.float32:
        raise ValueError(f"{op}: state_cache {tuple(state_cache.shape)} {state_cache.dtype} is not float32 "
                         f"{(n_slots, nh, hp, state_size)}")
    return hp


def _check_step(xbc_cache, dt_cache, state_cache, slots, pending, new_xbc, new_dt, A, D, chunk_size, n_groups,
                state_size, fresh, out_dtype):
    """Shapes of :func:`ssd_step_outputs`' arguments (one-line ValueErrors)."""
    if new_dt.dim() != 2 or slots.dim() != 1 or new_dt.shape[0] != slots.shape[0]:
        raise ValueError(f"ssd_step_outputs: new_dt {tuple(new_dt.shape)} / slots {tuple(slots.shape)} are not [b, H] / [b]")
    bsz, nh = new_dt.shape
    _check_state_caches("ssd_step_outputs", xbc_cache, dt_cache, state_cache, chunk_size, n_groups, state_size, nh)
    conv_dim = xbc_cache.shape[2]
    if slots.dtype not in (torch.int32, torch.int64) or pending.shape != (bsz,) or pending.dtype != torch.int64:
        raise ValueError(f"ssd_step_outputs: slots {slots.dtype} / pending {tuple(pending.shape)} {pending.dtype} are not int [b] / int64 [b={bsz}]")
    if new_xbc.shape != (bsz, conv_dim) or new_xbc.dtype != xbc_cache.dtype:
        raise ValueError(f"ssd_step_outputs: new_xbc {tuple(new_xbc.shape)} {new_xbc.dtype} is not {xbc_cache.dtype} {(bsz, conv_dim)}")
    if A.shape != (nh,) or D.shape != (nh,):
        raise ValueError(f"ssd_step_outputs: A {tuple(A.shape)} and D {tuple(D.shape)} must be [H={nh}]")
    if fresh is not None and (fresh.shape != (bsz,) or fresh.dtype != torch.bool):
        raise ValueError(f"ssd_step_outputs: fresh {tuple(fresh.shape)} {fresh.dtype} is not bool [b={bsz}]")
    if out_dtype not in (None, torch.float32):
        raise ValueError(f"ssd_step_outputs: out_dtype must be None (the cache's dtype) or float32, got {out_dtype}")


def ssd_step_replay(xbc_cache, dt_cache, state_cache, slots, pending, new_xbc, new_dt, chunk_size: int, n_groups: int,
                    state_size: int, fresh=None, rows: int | None = None):
    """The decode step's replay as :func:`ssd_outputs_at` takes it, built with torch ops (the mixer's former
    ``_replay``): ``(x [b, t, H, P], dt [b, t, H] float32, B, C [b, t, G, N], state [b, H, P, N] float32)`` with
    ``t = rows`` (default ``chunk_size``; at least ``max(pending) + 1``: the scan zero-pads the chunk anyway, so ``t``
    changes no bits): row ``r < p_i`` from the cache, row ``p_i`` the new token, zeros after; the state
    ``state_cache[slots_i]`` (zeros where ``fresh``).  Arguments as :func:`ssd_step_outputs`."""
    t = chunk_size if rows is None else rows
    bsz, nh = new_dt.shape
    gn = n_groups * state_size
    d = xbc_cache.shape[2] - 2 * gn
    r = torch.arange(t, device=new_xbc.device)[None, :]
    p = pending[:, None]
    seg = torch.where((r < p)[..., None], xbc_cache[slots, :t], 0)
    seg = torch.where((r == p)[..., None], new_xbc[:, None], seg)
    seg_dt = torch.where((r < p)[..., None], dt_cache[slots, :t], 0.0)
    seg_dt = torch.where((r == p)[..., None], new_dt[:, None].to(torch.float32), seg_dt)
    state = state_cache[slots]
    if fresh is not None:
        state = torch.where(fresh[:, None, None, None], 0.0, state)
    x, B, C = seg.split([d, gn, gn], dim=-1)
    return (x.reshape(bsz, t, nh, d // nh), seg_dt, B.reshape(bsz, t, n_groups, state_size),
            C.reshape(bsz, t, n_groups, state_size), state)


@register("ssd_step_outputs", "cpu")
def _ssd_step_outputs_cpu(xbc_cache, dt_cache, state_cache, slots, pending, new_xbc, new_dt, A, D, chunk_size: int,
                          n_groups: int, state_size: int, fresh=None, out_dtype=None):
    """The reference: :func:`ssd_step_replay` of ``max(p) + 1`` rows (read on the host: this is the CPU's), then
    :func:`ssd_outputs_at` (float32 outputs: on the replay converted to float32, an exact conversion, as the scan's
    own ``_chunked`` does)."""
    rows = int(pending.max()) + 1 if pending.numel() else 1
    x, dt, B, C, state = ssd_step_replay(xbc_cache, dt_cache, state_cache, slots, pending, new_xbc, new_dt, chunk_size,
                                         n_groups, state_size, fresh, rows)
    if out_dtype is not None:
        x, B, C = x.to(out_dtype), B.to(out_dtype), C.to(out_dtype)
    return ssd_outputs_at(x, dt, A, B, C, D, chunk_size, state, pending)


def ssd_step_outputs(xbc_cache, dt_cache, state_cache, slots, pending, new_xbc, new_dt, A, D, chunk_size: int,
                     n_groups: int, state_size: int, fresh=None, out_dtype=None) -> torch.Tensor:
    """A decode step's outputs ``y [b, H, P]``, reading the replay in place from the mixer's state cache.

    ``xbc_cache [slots_total, L, conv_dim]`` (model dtype; ``conv_dim = H*P + 2*G*N``, each row packed ``x | B | C``),
    ``dt_cache [slots_total, L, H]`` float32, ``state_cache [slots_total, H, P, N]`` float32 (the state at the chunk's
    start), ``slots [b]`` int (distinct), ``pending [b]`` int64 (``p_i < L``: the new token's row), ``new_xbc [b,
    conv_dim]`` (the new token after the conv, model dtype), ``new_dt [b, H]`` float32, ``A`` / ``D [H]``, ``L =
    chunk_size``, ``G = n_groups``, ``N = state_size``; ``fresh [b]`` bool or None: rows whose state is taken as zeros;
    ``out_dtype``: None (the model dtype) or float32 (the same outputs before their rounding).

    Sequence ``i``'s replay is cache rows ``r < p_i`` of ``slots_i``, the new token at row ``p_i``, zeros after
    (nothing else of the caches is read into an output: rows ``>= p_i`` and other slots may hold anything); ``y_i``
    is the output at row ``p_i`` from ``state_cache[slots_i]`` (zeros if fresh): :func:`ssd_outputs_at` on that replay
    (:func:`ssd_step_replay`), same bits.  Nothing is written.  Inference only."""
    _check_step(xbc_cache, dt_cache, state_cache, slots, pending, new_xbc, new_dt, A, D, chunk_size, n_groups,
                state_size, fresh, out_dtype)
    with torch.no_grad():
        return implementation("ssd_step_outputs", new_xbc.device)(
            xbc_cache, dt_cache, state_cache, slots, pending, new_xbc, new_dt, A, D, chunk_size, n_groups, state_size,
            fresh, out_dtype)


# --------------------------------------------------------------------------- decode step's new boundary states, in place


def _check_end_states(xbc_cache, dt_cache, state_cache, slots, closing, fresh, A, chunk_size, n_groups, state_size):
    """Shapes of :func:`ssd_step_end_states`' arguments (one-line ValueErrors)."""
    if dt_cache.dim() != 3:
        raise ValueError(f"ssd_step_end_states: dt_cache {tuple(dt_cache.shape)} is not float32 [slots, L, H]")
    nh = dt_cache.shape[2]
    _check_state_caches("ssd_step_end_states", xbc_cache, dt_cache, state_cache, chunk_size, n_groups, state_size, nh)
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ssd_step_end_states: slots {tuple(slots.shape)} {slots.dtype} is not int [b]")
    bsz = slots.shape[0]
    if closing.shape != (bsz,) or closing.dtype != torch.bool:
        raise ValueError(f"ssd_step_end_states: closing {tuple(closing.shape)} {closing.dtype} is not bool [b={bsz}]")
    if fresh is not None and (fresh.shape != (bsz,) or fresh.dtype != torch.bool):
        raise ValueError(f"ssd_step_end_states: fresh {tuple(fresh.shape)} {fresh.dtype} is not bool [b={bsz}]")
    if A.shape != (nh,):
        raise ValueError(f"ssd_step_end_states: A {tuple(A.shape)} must be [H={nh}]")


@register("ssd_step_end_states", "cpu")
def _ssd_step_end_states_cpu(xbc_cache, dt_cache, state_cache, slots, closing, fresh, A, chunk_size: int,
                             n_groups: int, state_size: int) -> None:
    """The reference: the closing or fresh rows (read on the host: this is the CPU's), their whole chunks and states
    gathered with torch, :func:`ssd_chunk_end_state` with ``closing`` from their states (zeros where ``fresh``), and
    their slots written."""
    touched = closing if fresh is None else closing | fresh
    rows = touched.nonzero()[:, 0]
    if rows.numel() == 0:
        return
    bsz, (L, nh) = rows.shape[0], dt_cache.shape[1:]
    gn, hp = n_groups * state_size, state_cache.shape[2]
    slots = slots[rows].to(torch.int64)
    x, B, C = xbc_cache[slots].split([xbc_cache.shape[2] - 2 * gn, gn, gn], dim=-1)
    start = state_cache[slots]
    if fresh is not None:
        start = torch.where(fresh[rows][:, None, None, None], 0.0, start)
    state_cache[slots] = ssd_chunk_end_state(x.reshape(bsz, L, nh, hp), dt_cache[slots], A,
                                             B.reshape(bsz, L, n_groups, state_size),
                                             C.reshape(bsz, L, n_groups, state_size), L, start, closing[rows])


def ssd_step_end_states(xbc_cache, dt_cache, state_cache, slots, closing, fresh, A, chunk_size: int, n_groups: int,
                        state_size: int) -> None:
    """A decode step's new boundary states, formed IN PLACE in the mixer's state cache (after the new tokens were
    written to the xbc / dt caches).

    ``xbc_cache [slots_total, L, conv_dim]`` (model dtype; each row ``x | B | C``, ``conv_dim = H*P + 2*G*N``),
    ``dt_cache [slots_total, L, H]`` float32, ``state_cache [slots_total, H, P, N]`` float32 (the state at the
    chunk's start; written), ``slots [b]`` int (distinct, except rows whose slot is a scratch block, e.g. vLLM's null
    block 0: its contents are then undefined), ``closing [b]`` bool (the rows whose new token completed the chunk,
    ``p == L - 1``), ``fresh [b]`` bool or None (rows whose state at the chunk's start is zeros), ``A [H]`` float32,
    ``L = chunk_size``, ``G = n_groups``, ``N = state_size``.

    For each row ``i``: if ``closing[i]``, ``state_cache[slots_i]`` becomes :func:`ssd_chunk_end_state` (same bits)
    of the chunk held in rows ``0..L-1`` of that slot's xbc / dt caches from ``state_cache[slots_i]`` (zeros if
    ``fresh[i]``); else if ``fresh[i]``, zeros; else the slot is untouched.  Nothing of a non-closing row's caches is
    read into any state (its chunk rows and its state may hold anything, NaN included, and keep their bits).  Returns
    None.  Inference only."""
    _check_end_states(xbc_cache, dt_cache, state_cache, slots, closing, fresh, A, chunk_size, n_groups, state_size)
    with torch.no_grad():
        implementation("ssd_step_end_states", state_cache.device)(
            xbc_cache, dt_cache, state_cache, slots, closing, fresh, A, chunk_size, n_groups, state_size)

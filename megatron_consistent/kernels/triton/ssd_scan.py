"""Mamba-2 SSD scan on CUDA (Triton): the bulk of :mod:`megatron_consistent.kernels.ssd`'s contract in three kernels.

:data:`TRITON_STEPS` are :class:`kernels.ssd.SSDSteps`: :func:`kernels.ssd._ssd_chunk_states` keeps the chunk
padding and the sequential state recurrence ``S_{c+1} = exp(cum_{L-1}) * S_c + contrib_c`` as torch ops; three kernels
evaluate the rest -- the terms that make the work ``L x N x P`` a chunk and ``L x (N + P) + N x P`` an output, and the
prefix sums (one launch where the torch evaluation takes three ops a doubling level):

* :func:`chunk_prefix_sums` (step 1), one program a (chunk, block of heads): ``a = dt * A``, then
  ``cum_i = cum_i + cum_{i-k}`` for ``i >= k``, ``k = 1, 2, 4, ...`` (every row reads, a barrier, every row writes);
* :func:`chunk_contributions` (step 5's per-chunk term), one program a (complete chunk, head, block of the state's
  ``P x N``): ``contrib[n, p] = tree_L((u_s * x_s[p]) * B_s[n])`` with ``u_s = exp(cum_{L-1} - cum_s) * dt_s`` (formed
  beforehand by torch ops, as the torch evaluation forms it), the tree leaf by leaf (:func:`numerics.tree_leaves`:
  row ``s``'s products over the program's block formed on their own and added in the tree's order).  With
  ``FROM_CACHE`` (:func:`ssd_step_end_states`, a decode step's chunk closures) the same kernel reads a closing row's
  x / B in place from its slot of the mixer's xbc cache and, instead of storing the term, stores the recurrence's
  ``exp(cum_{L-1}) * S + contrib`` over the tile of the slot's state ``S`` it read (zeros where fresh), in place;
* :func:`ssd_outputs` (steps 2-4), one program a (sequence, asked position ``t``, heads of one group, :func:`heads_per_program`):
  ``cb[s] = tree_N(C_t[n] * B_s[n])`` for every row ``s`` of ``t``'s chunk (zero-padded rows included);
  ``e[s] = exp(cum_t - cum_s)`` for ``s <= t`` else ``exp(+0)``; ``w[s] = (cb[s] * e[s]) * dt_s`` for ``s <= t``
  else ``+0``; ``intra[p] = tree_L(w[s] * x_s[p])``; ``inter[p] = tree_N(C_t[n] * S_c[n, p]) * exp(cum_t)``;
  ``y_t[p] = round((intra + inter) + D * x_t[p])``.  With ``FROM_CACHE`` (:func:`ssd_step_outputs`, a decode step)
  the same kernel reads a sequence's x / B / C rows and state in place from the mixer's state cache (rows ``< p``
  from its slot, row ``p`` the new token, zeros after; the state zeros where fresh) instead of the chunked float32
  operands: the same float32 values (the model dtype converted in registers, exactly), the same operations.

``exp`` is :func:`numerics.exp`'s float64 arithmetic (clamp, range reduction, Horner order, one rounding), every tree
is :func:`numerics.tree_sum`'s (zero-padded to a power of two, element ``i`` paired with ``i + n/2``, level by level:
the halves of a register tile split apart with ``reshape`` / ``permute`` / ``split`` and added, or leaves and slices
formed one at a time and added in that order, :func:`numerics.tree_leaves` / ``tree_cols_split``), and each
operation is a separate IEEE operation (the launches disable Triton's mul-add fusion).  So these are not a new
contract but another evaluation of the torch one, with its bits on the same device: in Triton's interpreter on CPU
tensors they give ``_ssd_cpu``'s bits (tests/test_triton_interpret_ssd.py), on the GPU those of the torch evaluation
there (tests/test_gpu_ssm.py).  As there, an output depends on nothing but its chunk up to ``t`` and the state at the
chunk's start: not on the batch, on ``T`` or on how the sequence reached the kernel (prefill, chunked prefill,
decode replay).  The products stay in registers, where the torch evaluation materialises them in memory.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..numerics import exp
from ..ssd import SSDSteps
from .numerics import exp_f32, tree_cols_split, tree_leaves, tree_rows, tree_rows_split


# The trees of the outputs kernel -- over the state size N (C_t . B_s and C_t . S: tree_cols_split) and over the chunk's
# rows (the intra term: tree_rows_split) -- are evaluated with slices of this many columns / rows (a power of two);
# 0: the whole N / L, one tree over the tile.
# Scheduling only: the same additions in the same order whichever width (tests/test_triton_interpret_tree.py;
# benchmarks/offline_compile_tree.py: at 16, the outputs kernel's 16-byte spill and 16 KB staging tile go).  16 by
# default: the fastest on the H200 (session 28, bench_gpu_ssd.py, prefill 1 x 4 096 at the 8B widths: 5.18 ms against
# 6.58 whole, 5.44 at 32, 7.98 at 8; the decode step 0.204 ms against 0.217 whole).
OUTPUTS_TREE_WIDTH = int(os.environ.get("MC_SSD_TREE_WIDTH", "16") or "16")


# State columns a chunk-terms program takes (a power of two), beside up to 64 rows of the head dim.  A program sums
# its tree over the chunk's rows row by row (tree_leaves: each row's [BP, BN] outer product added into at most
# log2(L) partial sums in registers; no shared memory, no barriers).  Scheduling only: each (p, n) term is the same
# tree over the chunk's rows whichever program forms it.  16 by default: the fastest on the H200 (session 28,
# bench_gpu_ssd.py, prefill 1 x 4 096 at the 8B widths: 1.43 ms against 1.66 at 32 and 64; the former tree over the
# whole [rows, P x N] product tile, since removed, 4.44 ms, 2.28 at its fastest width).
TERMS_BN = int(os.environ.get("MC_SSD_TERMS_BN", "16") or "16")

# Leaves (chunk rows) a chunk-terms program forms unrolled in one step of its tree's runtime loop over residue classes
# (tree_leaves: the top levels in a loop of BL / TERMS_LEAVES steps, at most 16); 0 (the default): all of them, no loop.
# Scheduling only: the same tree whichever count (the H200's SSD suites passed at 16, session 29).  The loop bounds
# the program the compiler sees, for a faster first start (an engine compiles four such launches; Triton caches them
# after): sm_90a offline (Triton 3.6, benchmarks/offline_compile_ssd.py) the tree unrolled whole takes 8.2 s a launch
# at chunk 128 and 30 s at chunk 256, at 16 leaves a step 0.4-1.5 s, at 8: 0.5 s (32 and 64 spill).  Not the default:
# not yet timed on a GPU, and at 16 a leaf takes 65 static SASS instructions (181 registers; the counter's adds and
# selects, the leaves' addresses from a runtime index) where the unrolled tree takes 43 (130 registers) --
# bench_gpu_ssd.py times it.
TERMS_LEAVES = int(os.environ.get("MC_SSD_TERMS_LEAVES", "0") or "0")


def outputs_tree_width(bn: int) -> int:
    """The slice width of an outputs launch's trees over ``bn`` (padded) state columns or chunk rows
    (:data:`OUTPUTS_TREE_WIDTH`, 16 by default; ``TREE_W`` / ``TREE_W_ROWS``): the whole ``bn`` at 0."""
    w = OUTPUTS_TREE_WIDTH
    if w < 0 or w & (w - 1):
        raise ValueError(f"MC_SSD_TREE_WIDTH={w}: expected 0 or a power of two")
    return bn if w == 0 else min(w, bn)


def launch_warps(bl: int, bn: int) -> int:
    """Warps of an outputs program whose largest tile is ``bl x bn`` (chunk rows x state size): from the offline sm_90a
    compile (``benchmarks/offline_compile_ssd.py``) -- 128 x 128 on 4 warps (24 bytes spilled since the states are
    read in their own ``[P, N]`` layout; 8 warps spill 7.9 KB), 256 x 128 on 8 (none).  Scheduling only: the bits do
    not depend on it."""
    return 4 if bl * bn <= 16384 else 8


@triton.jit
def _cb_from_cache(args, n):
    """The outputs kernel's ``C_t[n] * B_s[n]`` products, ``[BL, len(n)]`` float32, for state columns ``n``, read from
    the state cache: row ``s`` of ``B`` from the slot's rows (``old``), the new token's (``is_new``) or zeros; ``C_t``
    the new token's (model dtype, converted exactly)."""
    b_rows, old, b_new_row, is_new, c_row, N = args
    n_in = n < N
    c_t = tl.load(c_row + n, mask=n_in, other=0.0).to(tl.float32)
    b_new = tl.load(b_new_row + n, mask=n_in, other=0.0)
    b_old = tl.load(b_rows[:, None] + n[None, :], mask=old[:, None] & n_in[None, :], other=0.0)
    return c_t[None, :] * tl.where(is_new, b_new[None, :], b_old).to(tl.float32)


@triton.jit
def _cb_from_chunks(args, n):
    """The outputs kernel's ``C_t[n] * B_s[n]`` products from the chunked float32 operands (rows past the chunk:
    zeros)."""
    b_rows, s_in, c_row, N = args
    n_in = n < N
    c_t = tl.load(c_row + n, mask=n_in, other=0.0)
    return c_t[None, :] * tl.load(b_rows[:, None] + n[None, :], mask=s_in[:, None] & n_in[None, :], other=0.0)


@triton.jit
def _cs_products(args, n):
    """The outputs kernel's state-term products ``C_t[n] * S[p, n]``, ``[BP, len(n)]`` float32 (the state's columns
    at or past ``n_state``: zeros, a fresh row's state)."""
    st_rows, p_in, n_state, c_row, N = args
    c_t = tl.load(c_row + n, mask=n < N, other=0.0).to(tl.float32)
    return c_t[None, :] * tl.load(st_rows[:, None] + n[None, :], mask=p_in[:, None] & (n < n_state)[None, :],
                                  other=0.0)


@triton.jit
def _intra_products(args, r):
    """The outputs kernel's intra-chunk products ``w_s * x_s[p]``, ``[len(r), BP]`` float32, of chunk rows ``r``:
    ``args = (w_row, x_args)``, ``w_s`` from the program's scratch row ``w_row``, ``x_s`` by :func:`_intra_rows`."""
    w_row, x_args = args
    return tl.load(w_row + r)[:, None] * _intra_rows(x_args, r)


@triton.jit
def _intra_rows(args, r):
    """The outputs kernel's ``x_s[p]`` of chunk rows ``r``, ``[len(r), BP]`` float32: of the rows below ``x_end``
    from ``x_rows`` (row ``s`` at ``+ s * x_stride``; model dtype converted exactly), zeros past them; a decode step's
    ``args`` add ``(new_row, x_new)``: row ``new_row`` is the new token's ``x_new``."""
    x_rows, x_stride, x_end, p, p_in = args[0], args[1], args[2], args[3], args[4]
    x = tl.load(x_rows + r[:, None].to(tl.int64) * x_stride + p[None, :], mask=(r < x_end)[:, None] & p_in[None, :],
                other=0.0)
    if len(args) == 7:
        x = tl.where((r == args[5])[:, None], args[6][None, :], x)
    return x.to(tl.float32)


@triton.jit
def _ssd_outputs_kernel(XC, DTC, BC, CC, CUM, STATES, D, POS, Y, W_SCRATCH, n_out, n_chunks, n_starts, L, H, P, G, N,
                        HEADS_PER_GROUP, HEADS_PER_PROGRAM, SLOTS, NEW, FRESH, XBC_SLOT_STRIDE, STATE_SLOT_STRIDE,
                        BL: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, FROM_CACHE: tl.constexpr,
                        HAS_FRESH: tl.constexpr, TREE_W: tl.constexpr, TREE_W_ROWS: tl.constexpr):
    # FROM_CACHE (ssd_step_outputs, a decode step: n_out = n_chunks = 1): XC is the mixer's xbc cache [slots, L,
    # H*P + 2*G*N] (model dtype, slot stride XBC_SLOT_STRIDE), BC / CC unused, STATES the state cache [slots, H, P, N]
    # (slot stride STATE_SLOT_STRIDE); sequence b's rows s < t are read from its slot SLOTS[b], row t from NEW[b]
    # (the new token), rows past t are zeros, each converted to float32 in registers (exact); its state is zeros where
    # FRESH[b] (HAS_FRESH).  Off: the chunked float32 operands of _ssd_chunk_states (SLOTS .. STATE_SLOT_STRIDE unused).
    # W_SCRATCH [programs, BL] float32: a head's weights w_s, stored and read back by the intra tree's slices of
    # TREE_W_ROWS rows (tree_rows_split; a barrier after the store and after the reads); unused with the whole tile's
    # tree (TREE_W_ROWS = BL, the default).
    o = tl.program_id(0)  # (sequence, output column)
    h0 = tl.program_id(1) * HEADS_PER_PROGRAM  # the program's heads h0 .., all of one group
    b = o // n_out
    t = tl.load(POS + o)  # the position of that output
    ci = t // L
    ri = t % L
    g = h0 // HEADS_PER_GROUP
    s = tl.arange(0, BL)
    p = tl.arange(0, BP)
    s_in, p_in = s < L, p < P
    chunk = (b * n_chunks + ci).to(tl.int64)  # row offsets of [b, c, L, ...] tensors
    rows = chunk * L + s  # [BL]: the chunk's rows

    # the group's C_t . B_s, once for the program's heads (column trees over the state size: tree_cols_split with
    # slices of TREE_W columns, the same tree as tree_cols over the whole tile)
    if FROM_CACHE:
        conv = H * P + 2 * G * N
        slot = tl.load(SLOTS + b).to(tl.int64)
        cached = slot * XBC_SLOT_STRIDE + s.to(tl.int64) * conv  # [BL]: the slot's rows of the xbc cache
        new = NEW + b.to(tl.int64) * conv  # the new token's x | B | C
        old = s < ri  # rows from the cache (row ri: the new token; rows past it: zeros)
        is_new = (s == ri)[:, None]
        c_row = new + H * P + G * N + g * N  # C_t (model dtype)
        cb = tree_cols_split(_cb_from_cache, (XC + cached + H * P + g * N, old, new + H * P + g * N, is_new, c_row, N),
                             BL, BN, TREE_W)
        n_state = N  # the state's columns read (a fresh row: none, its state is zeros)
        if HAS_FRESH:
            n_state = tl.where(tl.load(FRESH + b) != 0, 0, N)
    else:
        c_row = CC + ((chunk * L + ri) * G + g) * N  # C_t (float32)
        cb = tree_cols_split(_cb_from_chunks, (BC + (rows * G + g) * N, s_in, c_row, N), BL, BN, TREE_W)  # [BL]
        n_state = N
    causal = s <= ri
    scratch = W_SCRATCH + (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)).to(tl.int64) * BL
    for j in range(HEADS_PER_PROGRAM):
        h = h0 + j
        cum_s = tl.load(CUM + rows * H + h, mask=s_in, other=0.0)
        cum_t = tl.load(CUM + (chunk * L + ri) * H + h)
        dt_s = tl.load(DTC + rows * H + h, mask=s_in, other=0.0)
        e = exp_f32(tl.where(causal, cum_t - cum_s, 0.0))
        w = tl.where(causal, (cb * e) * dt_s, 0.0)
        if FROM_CACHE:  # rows < ri from the slot, row ri the new token
            x_new = tl.load(new + h * P + p, mask=p_in, other=0.0)
            x_args = (XC + slot * XBC_SLOT_STRIDE + h * P, conv, ri, p, p_in, ri, x_new)
        else:  # the chunk's rows
            x_args = (XC + (chunk * L * H + h) * P, H * P, L, p, p_in)
        if TREE_W_ROWS == BL:  # the whole tile's tree, w in registers
            intra = tree_rows(w[:, None] * _intra_rows(x_args, s), BL, BP)  # [BP]
        else:  # row slices, w through the scratch row
            tl.store(scratch + s, w)
            tl.debug_barrier()  # w seen by every thread of the program
            intra = tree_rows_split(_intra_products, (scratch, x_args), BL, BP, TREE_W_ROWS)
            tl.debug_barrier()  # every read of w done before the next head's
        if FROM_CACHE:  # the state cache's [P, N] tile of the slot (zeros: fresh)
            st_rows = STATES + slot * STATE_SLOT_STRIDE + (h * P + p) * N
        else:  # states [nb, n_starts, H, P, N]: chunk ci's starting state, a [P, N] tile
            st_rows = STATES + (((b.to(tl.int64) * n_starts + ci) * H + h) * P + p) * N
        inter = tree_cols_split(_cs_products, (st_rows, p_in, n_state, c_row, N), BP, BN, TREE_W) * exp_f32(cum_t)
        if FROM_CACHE:
            x_t = x_new.to(tl.float32)
        else:
            x_t = tl.load(XC + ((chunk * L + ri) * H + h) * P + p, mask=p_in, other=0.0)
        y = (intra + inter) + tl.load(D + h) * x_t
        tl.store(Y + (o.to(tl.int64) * H + h) * P + p, y.to(Y.dtype.element_ty), mask=p_in)


@triton.jit
def _chunk_prefix_sums_kernel(DTC, A, CUM, L, H, BL: tl.constexpr, BH: tl.constexpr):
    chunk = tl.program_id(0)  # (sequence, chunk)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    s = tl.arange(0, BL)
    mask = (s < L)[:, None] & (h < H)[None, :]
    at = CUM + chunk.to(tl.int64) * L * H + s[:, None] * H + h[None, :]
    a = tl.load(DTC + chunk.to(tl.int64) * L * H + s[:, None] * H + h[None, :], mask=mask, other=0.0)
    tl.store(at, a * tl.load(A + h, mask=h < H, other=0.0)[None, :], mask=mask)
    k = 1
    while k < L:  # the doubling scan through the output: every row reads, then every row writes
        tl.debug_barrier()
        later = s[:, None] >= k
        cur = tl.load(at, mask=mask, other=0.0)
        earlier = tl.load(at - k * H, mask=mask & later, other=0.0)
        tl.debug_barrier()
        tl.store(at, cur + earlier, mask=mask & later)
        k *= 2


def chunk_prefix_sums(dtc, A) -> torch.Tensor:
    """Step 1, ``cum [b, c, L, H]``: ``a = dt * A``, then the doubling scan (``cum_i + cum_{i-k}`` for ``i >= k``,
    ``k = 1, 2, 4, ...``) within each chunk, one program a (chunk, block of heads), the levels through the output
    (its :func:`kernels.ssd._chunk_prefix_sums` in one launch instead of three torch ops a level)."""
    nb, n_chunks, L, H = dtc.shape
    cum = torch.empty(nb, n_chunks, L, H, dtype=torch.float32, device=dtc.device)
    if nb * n_chunks == 0:
        return cum
    bh = min(32, triton.next_power_of_2(H))
    _chunk_prefix_sums_kernel[(nb * n_chunks, triton.cdiv(H, bh))](
        dtc.contiguous(), A.to(torch.float32).contiguous(), cum, L, H, BL=triton.next_power_of_2(L), BH=bh,
        num_warps=4, enable_fp_fusion=False)
    return cum


@triton.jit
def _state_term_leaf(args, s):
    """Row ``s``'s ``[BP, BN]`` products ``(u_s * x_s[p]) * B_s[n]`` of a chunk-terms program (rows past the chunk:
    ``+0``, the tree's zero padding): ``u_s`` from the decay weights, ``x_s`` / ``B_s`` converted to float32 (exact)."""
    u_row, u_stride, x_row, x_stride, b_row, b_stride, p, p_in, n, n_in, L = args
    u = tl.load(u_row + s * u_stride, mask=tl.zeros((), tl.int32) + s < L, other=0.0)
    x = tl.load(x_row + s * x_stride + p, mask=_row_in(p_in, s, L), other=0.0).to(tl.float32)
    b = tl.load(b_row + s * b_stride + n, mask=_row_in(n_in, s, L), other=0.0).to(tl.float32)
    return (u * x)[:, None] * b[None, :]


@triton.jit
def _state_term_leaf_tile(args, s):
    """:func:`_state_term_leaf` with ``B_s`` read as a ``[BP, BN]`` tile (each row the same ``BN`` values), for the
    tree in a runtime loop: the 2-D load gives the loop's tiles the store's layout (2 rows x 4 columns a thread;
    sm_90a offline at 16 leaves a step 181 registers and 65 static instructions a leaf, against 221 and 80 with
    Triton's default layout, a thread 8 rows of one column).  Unrolled whole, the tree keeps the vector (with the tile
    its loads are hoisted and spill 10 KB)."""
    u_row, u_stride, x_row, x_stride, b_row, b_stride, p, p_in, n, n_in, L = args
    u = tl.load(u_row + s * u_stride, mask=tl.zeros((), tl.int32) + s < L, other=0.0)
    x = tl.load(x_row + s * x_stride + p, mask=_row_in(p_in, s, L), other=0.0).to(tl.float32)
    b = tl.load(b_row + s * b_stride + (n[None, :] + p[:, None] * 0), mask=_row_in(n_in, s, L)[None, :],
                other=0.0).to(tl.float32)
    return (u * x)[:, None] * b


@triton.jit
def _row_in(cols_in, s, L):
    """``cols_in & (s < L)`` as a tensor of ``cols_in``'s shape, for leaf ``s`` (the interpreter cannot combine a
    scalar mask with a vector one; a splat compare: one scalar test in the compile)."""
    return cols_in & (tl.zeros(cols_in.shape, tl.int32) + s < L)


@triton.jit
def _chunk_contributions_kernel(XC, BC, CUM, U, ACTIVE, OUT, n_chunks, n_complete, L, H, P, G, N, HEADS_PER_GROUP,
                                SLOTS, FRESH, XBC_SLOT_STRIDE, STATE_SLOT_STRIDE,
                                BL: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, CLASSES: tl.constexpr,
                                HAS_ACTIVE: tl.constexpr, FROM_CACHE: tl.constexpr, HAS_FRESH: tl.constexpr):
    # FROM_CACHE (ssd_step_end_states, a decode step: n_chunks = n_complete = 1, HAS_ACTIVE = the closing rows): XC is
    # the mixer's xbc cache [slots, L, H*P + 2*G*N] (model dtype, slot stride XBC_SLOT_STRIDE; x and B read from row
    # b's slot SLOTS[b], converted to float32 in registers: exact), BC unused, OUT the state cache [slots, H, P, N]
    # (slot stride STATE_SLOT_STRIDE): instead of storing the term the program forms decay * S + contrib (decay =
    # exp(cum_{L-1}), S the slot's state, zeros where FRESH[b]) and stores it over the same [BP, BN] tile it read (the
    # only program that reads or writes that tile of the slot: in place is safe); a non-closing fresh row stores zeros
    # over its tile.  Off: the chunked float32 operands of _ssd_chunk_states (CUM and SLOTS .. STATE_SLOT_STRIDE
    # unused: the decay weights U carry the prefix sums).
    # The tree over the chunk's BL (padded) rows leaf by leaf, its top log2(CLASSES) levels in a runtime loop
    # (tree_leaves), u_s read from U [b, n_complete, L, H].
    chunk_id = tl.program_id(0)  # (sequence, complete chunk)
    h = tl.program_id(1)
    n_blocks = tl.cdiv(N, BN)
    p0 = (tl.program_id(2) // n_blocks) * BP
    n0 = (tl.program_id(2) % n_blocks) * BN
    b = chunk_id // n_complete
    k = chunk_id % n_complete
    if FROM_CACHE:
        p = p0 + tl.arange(0, BP)
        n = n0 + tl.arange(0, BN)
        slot = tl.load(SLOTS + b).to(tl.int64)
        tile = OUT + slot * STATE_SLOT_STRIDE + (h * P + p[:, None]) * N + n[None, :]  # the slot's [BP, BN] tile
        tile_in = (p < P)[:, None] & (n < N)[None, :]
        st_in = tile_in  # the state read (a fresh row: none, its state is zeros)
        if HAS_FRESH:
            is_fresh = tl.load(FRESH + b) != 0
            st_in = (p < P)[:, None] & (n < tl.where(is_fresh, 0, N))[None, :]
            if tl.load(ACTIVE + b) == 0:  # not closing: a fresh row's state becomes zeros, the others are untouched
                tl.store(tile, tl.zeros((BP, BN), dtype=tl.float32),
                         mask=(p < P)[:, None] & (n < tl.where(is_fresh, N, 0))[None, :])
                return
        else:
            if tl.load(ACTIVE + b) == 0:  # not closing: untouched
                return
    elif HAS_ACTIVE:
        if tl.load(ACTIVE + b) == 0:  # a row whose new state is not used: its terms are left unwritten
            return
    g = h // HEADS_PER_GROUP
    p = p0 + tl.arange(0, BP)
    n = n0 + tl.arange(0, BN)
    p_in, n_in = p < P, n < N
    row0 = (b * n_chunks + k).to(tl.int64) * L  # the chunk's first row of the [b, c, L, ...] tensors

    if FROM_CACHE:  # the slot's rows 0..L-1 of the xbc cache: row s at + s * x_stride
        x_row = XC + slot * XBC_SLOT_STRIDE + h * P
        b_row = XC + slot * XBC_SLOT_STRIDE + H * P + g * N
        x_stride = H * P + 2 * G * N
        b_stride = x_stride
    else:
        x_row = XC + (row0 * H + h) * P
        b_row = BC + (row0 * G + g) * N
        x_stride = H * P
        b_stride = G * N
    u_row = U + (b * n_complete + k).to(tl.int64) * L * H + h  # U [b, n_complete, L, H]
    leaf_args = (u_row, H, x_row, x_stride, b_row, b_stride, p, p_in, n, n_in, L)
    if CLASSES > 1:
        contrib = tree_leaves(_state_term_leaf_tile, leaf_args, BL, CLASSES, tl.zeros((BP, BN), dtype=tl.float32))
    else:
        contrib = tree_leaves(_state_term_leaf, leaf_args, BL, 1, tl.zeros((BP, BN), dtype=tl.float32))
    if FROM_CACHE:  # _ssd_chunk_states' recurrence: decay * S (a float32 multiply), then + contrib
        last = tl.load(CUM + (row0 + L - 1) * H + h)
        st = tl.load(tile, mask=st_in, other=0.0)
        tl.store(tile, exp_f32(last) * st + contrib, mask=tile_in)
    else:
        # OUT [nb, n_complete, H, P, N]
        out = OUT + (((b.to(tl.int64) * n_complete + k) * H + h) * P + p[:, None]) * N + n[None, :]
        tl.store(out, contrib, mask=p_in[:, None] & n_in[None, :])


def chunk_contributions(xc, dtc, bc, cum, n_complete: int, active=None) -> torch.Tensor:
    """Step 5's per-chunk terms ``[b, n_complete, H, P, N]`` of the first ``n_complete`` chunks (module docstring),
    from :func:`kernels.ssd._ssd_chunk_states`' chunked float32 operands (its ``contributions`` argument);
    ``active`` ``[b]`` bool: only those rows' terms (the others' are left unwritten, their programs return at once)."""
    nb, n_chunks, L, H, P = xc.shape
    G, N = bc.shape[-2:]
    out = torch.empty(nb, n_complete, H, P, N, dtype=torch.float32, device=xc.device)
    if n_complete == 0 or nb == 0:
        return out
    bl, bp, bn, classes, warps = _contributions_blocks(L, P, N)
    grid = (nb * n_complete, H, triton.cdiv(P, bp) * triton.cdiv(N, bn))
    _chunk_contributions_kernel[grid](xc.contiguous(), bc.contiguous(), out, _decay_weights(cum, dtc, n_complete),
                                      out if active is None else active.to(torch.int8).contiguous(), out, n_chunks,
                                      n_complete, L, H, P, G, N, H // G, out, out, 0, 0, BL=bl, BP=bp, BN=bn,
                                      CLASSES=classes, HAS_ACTIVE=active is not None, FROM_CACHE=False, HAS_FRESH=False,
                                      num_warps=warps, enable_fp_fusion=False)
    return out


def _decay_weights(cum, dtc, n_complete: int) -> torch.Tensor:
    """``u [b, n_complete, L, H] = exp(cum_{L-1} - cum_s) * dt_s`` of the first ``n_complete`` chunks (float32 torch
    ops and :func:`numerics.exp`, as :func:`kernels.ssd._chunk_contributions` forms them)."""
    return (exp(cum[:, :n_complete, -1:] - cum[:, :n_complete]) * dtc[:, :n_complete]).contiguous()


def _contributions_blocks(L: int, P: int, N: int) -> tuple[int, int, int, int, int]:
    """``(BL, BP, BN, CLASSES, warps)`` of a chunk-terms program (:func:`chunk_contributions`' choice): the chunk's
    rows padded to a power of two (the tree's leaves), ``[64, TERMS_BN]`` of ``P x N`` (fewer where ``P`` / ``N`` are
    smaller) on 4 warps (at the default 16 columns 8 terms a thread), the tree's loop over ``BL / TERMS_LEAVES``
    residue classes (1 to 16; :data:`TERMS_LEAVES`)."""
    if TERMS_BN <= 0 or TERMS_BN & (TERMS_BN - 1):
        raise ValueError(f"MC_SSD_TERMS_BN={TERMS_BN}: expected a power of two")
    if TERMS_LEAVES < 0 or TERMS_LEAVES & (TERMS_LEAVES - 1):
        raise ValueError(f"MC_SSD_TERMS_LEAVES={TERMS_LEAVES}: expected 0 or a power of two")
    bl = triton.next_power_of_2(L)
    classes = 1 if TERMS_LEAVES == 0 else min(16, max(1, bl // TERMS_LEAVES))
    return bl, min(64, triton.next_power_of_2(P)), min(TERMS_BN, triton.next_power_of_2(N)), classes, 4


def _check_slots_contiguous(op: str, xbc_cache, dt_cache, state_cache) -> None:
    """The in-place decode-step kernels address a slot's dims densely (any slot stride): one-line ValueError else."""
    for name, cache in (("xbc_cache", xbc_cache), ("dt_cache", dt_cache), ("state_cache", state_cache)):
        if cache.shape[0] and not cache[0].is_contiguous():
            raise ValueError(f"{op}: {name} strides {cache.stride()} are not contiguous within a slot")


def ssd_step_end_states(xbc_cache, dt_cache, state_cache, slots, closing, fresh, A, chunk_size: int, n_groups: int,
                        state_size: int) -> None:
    """:func:`kernels.ssd.ssd_step_end_states` (its signature and shapes; registered for ``"cuda"``): a decode step's
    new boundary states formed in place in the state cache.  The rows' cached ``dt`` are gathered with torch
    (``[b, 1, L, H]``) for :func:`chunk_prefix_sums`; then :func:`chunk_contributions`' kernel with ``FROM_CACHE`` and
    the closing rows active: each program reads x / B of its row's slot in place from the xbc cache (float32 in
    registers, exact), forms the chunk term as :func:`chunk_contributions` does and, in place of storing it, stores
    ``exp(cum_{L-1}) * S + contrib`` (the recurrence of :func:`kernels.ssd._ssd_chunk_states`: a float32 multiply,
    then the add) over the ``[BP, BN]`` tile of the slot's state ``S`` it read (zeros where fresh); programs of
    non-closing rows store zeros over their tile where fresh and else return at once.  So the same IEEE operations on
    the same float32 values as :func:`kernels.ssd.ssd_chunk_end_state`.  No host synchronisation (capturable in a
    CUDA graph).  The caches' slot strides may be any (vLLM's pages); the dims inside a slot must be contiguous."""
    bsz, (L, H) = slots.shape[0], dt_cache.shape[1:]
    G, N = n_groups, state_size
    P = (xbc_cache.shape[2] - 2 * G * N) // H
    _check_slots_contiguous("ssd_step_end_states", xbc_cache, dt_cache, state_cache)
    if bsz == 0:
        return
    slots = slots.to(torch.int64).contiguous()
    seg_dt = dt_cache[slots].contiguous()  # [b, L, H]
    cum = chunk_prefix_sums(seg_dt[:, None], A)  # [b, 1, L, H]
    bl, bp, bn, classes, warps = _contributions_blocks(L, P, N)
    active = closing.to(torch.int8).contiguous()
    grid = (bsz, H, triton.cdiv(P, bp) * triton.cdiv(N, bn))
    _chunk_contributions_kernel[grid](xbc_cache, xbc_cache, cum, _decay_weights(cum, seg_dt[:, None], 1), active,
                                      state_cache, 1, 1, L, H, P, G, N, H // G, slots,
                                      active if fresh is None else fresh.to(torch.int8).contiguous(),
                                      xbc_cache.stride(0), state_cache.stride(0), BL=bl, BP=bp, BN=bn,
                                      CLASSES=classes, HAS_ACTIVE=True, FROM_CACHE=True, HAS_FRESH=fresh is not None,
                                      num_warps=warps, enable_fp_fusion=False)


def ssd_outputs(xc, dtc, bc, cc, cum, states, D, positions, out_dtype) -> torch.Tensor:
    """``y [b, o, H, P]`` (``out_dtype``) at ``positions [b, o]`` (int64: sequence ``i``'s positions ``positions[i]``)
    from the chunked float32 operands ``xc [b, c, L, H, P]``, ``dtc`` / ``cum [b, c, L, H]``, ``bc`` / ``cc [b, c, L,
    G, N]``, the states at the chunk starts ``states [b, starts, H, P, N]`` (a state for every chunk start, and one
    after the last chunk when it is complete) and ``D [H]`` (module docstring; :func:`kernels.ssd._ssd_outputs`'
    signature)."""
    nb, n_chunks, L, H, P = xc.shape
    G, N = bc.shape[-2:]
    n_out = positions.shape[1]
    y = torch.empty(nb, n_out, H, P, dtype=out_dtype, device=xc.device)
    if n_out == 0 or nb == 0:
        return y
    ops = [v.contiguous() for v in (xc, dtc, bc, cc, cum, states)]
    bl, bn = triton.next_power_of_2(L), triton.next_power_of_2(N)
    hpp = heads_per_program(nb * n_out, H, G)
    grid = (nb * n_out, H // hpp)
    _ssd_outputs_kernel[grid](*ops, D.to(torch.float32).contiguous(), positions.to(torch.int64).contiguous(), y,
                              _w_scratch(grid, bl, xc.device), n_out, n_chunks, states.shape[1], L, H, P, G, N,
                              H // G, hpp, y, y, y, 0, 0, BL=bl, BP=triton.next_power_of_2(P), BN=bn,
                              FROM_CACHE=False, HAS_FRESH=False, TREE_W=outputs_tree_width(bn),
                              TREE_W_ROWS=outputs_tree_width(bl), num_warps=launch_warps(bl, bn),
                              enable_fp_fusion=False)
    return y


def ssd_step_outputs(xbc_cache, dt_cache, state_cache, slots, pending, new_xbc, new_dt, A, D, chunk_size: int,
                     n_groups: int, state_size: int, fresh=None, out_dtype=None) -> torch.Tensor:
    """:func:`kernels.ssd.ssd_step_outputs` (its signature and shapes; registered for ``"cuda"``): a decode step's
    outputs ``y [b, H, P]`` with the replay read in place from the state cache.  The replay's ``dt`` rows are built
    with torch (``[b, 1, L, H]``: rows ``< p`` from ``dt_cache``, row ``p`` the new ``dt``, zeros after, as
    :func:`kernels.ssd.ssd_step_replay`) for :func:`chunk_prefix_sums`; the outputs are :func:`ssd_outputs`' kernel
    with ``FROM_CACHE``: x / B / C rows and the state loaded from the caches (row ``p`` and ``x_t``: the new token;
    rows past ``p``: zeros; fresh rows' states: zeros), so the same IEEE operations on the same float32 values.  No
    host synchronisation (capturable in a CUDA graph).  The caches' slot strides may be any (vLLM's pages); the dims
    inside a slot must be contiguous."""
    bsz, H = new_dt.shape
    L, G, N = chunk_size, n_groups, state_size
    P = (xbc_cache.shape[2] - 2 * G * N) // H
    _check_slots_contiguous("ssd_step_outputs", xbc_cache, dt_cache, state_cache)
    y = torch.empty(bsz, H, P, dtype=out_dtype or xbc_cache.dtype, device=new_xbc.device)
    if bsz == 0:
        return y
    slots = slots.to(torch.int64)
    p = pending.to(torch.int64)[:, None, None]
    r = torch.arange(L, device=new_xbc.device)[None, :, None]
    seg_dt = torch.where(r < p, dt_cache[slots], 0.0)
    seg_dt = torch.where(r == p, new_dt[:, None].to(torch.float32), seg_dt).contiguous()  # [b, L, H]
    cum = chunk_prefix_sums(seg_dt[:, None], A)  # [b, 1, L, H]
    bl, bn = triton.next_power_of_2(L), triton.next_power_of_2(N)
    hpp = heads_per_program(bsz, H, G)
    grid = (bsz, H // hpp)
    _ssd_outputs_kernel[grid](xbc_cache, seg_dt, xbc_cache, xbc_cache, cum, state_cache, D.to(torch.float32).contiguous(),
                              pending.to(torch.int64).contiguous(), y, _w_scratch(grid, bl, new_xbc.device), 1, 1, 1,
                              L, H, P, G, N, H // G, hpp, slots.contiguous(), new_xbc.contiguous(),
                              y if fresh is None else fresh.to(torch.int8).contiguous(), xbc_cache.stride(0),
                              state_cache.stride(0), BL=bl, BP=triton.next_power_of_2(P), BN=bn, FROM_CACHE=True,
                              HAS_FRESH=fresh is not None, TREE_W=outputs_tree_width(bn),
                              TREE_W_ROWS=outputs_tree_width(bl), num_warps=launch_warps(bl, bn),
                              enable_fp_fusion=False)
    return y


def _w_scratch(grid: tuple[int, int], bl: int, device) -> torch.Tensor:
    """The outputs programs' scratch rows (``[programs, BL]`` float32): a head's weights ``w_s``, which its intra
    tree reads back a slice of rows at a time."""
    return torch.empty(grid[0] * grid[1] * bl, dtype=torch.float32, device=device)


def heads_per_program(positions: int, H: int, G: int, programs: int = 1024) -> int:
    """Heads an outputs program takes (all of one group, so ``C_t . B_s`` is formed once for them): the largest
    divisor of the group's heads that leaves at least ``programs`` programs (about 8 an SM), else 1.  Scheduling only:
    every head's arithmetic is the same whichever program runs it."""
    per_group = H // G
    for hpp in range(per_group, 0, -1):
        if per_group % hpp == 0 and positions * (H // hpp) >= programs:
            return hpp
    return 1


TRITON_STEPS = SSDSteps(chunk_prefix_sums, chunk_contributions, ssd_outputs)

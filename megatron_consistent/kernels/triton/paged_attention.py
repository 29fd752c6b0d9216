"""Paged varlen causal GQA attention over vLLM's paged KV cache, and the KV-cache write (CUDA, Triton).

:func:`paged_attention` runs the kernel of :mod:`.attention` (``_attn_kernel`` with ``PAGE`` =
page size): the same ``@triton.jit`` key-block / partition / merge / finalisation helpers, the
same fixed 512-key partitions and the same two paths, so a row (token, query head) has exactly
the bits of :func:`.attention.attention_fwd` on the same q/K/V laid out densely at the same
absolute positions — the numerics contract is :mod:`.attention`'s docstring.  Only the key
addressing differs: key ``j`` of sequence ``s`` lives at page ``block_table[s, j // page_size]``,
offset ``j % page_size``; given the step's new keys and values (``k_new``, ``v_new``: what the
engine has just written to the cache), key blocks made of new tokens only are read from those
dense tensors instead (the same values: prefill loads as the dense path's, the same bits).

Program -> work: grid axis 0 holds ``(T * G) // BLOCK_M + num_seqs`` virtual query tiles
(sequence ``s`` owns the ones from ``(query_start_loc[s] * G) // BLOCK_M + s``, found in-kernel by
binary search; tiles past a sequence's rows exit), axis 1 the kv heads, axis 2 (split path) the
partitions of ``max_seq_len``.  Grids therefore depend only on tensor shapes and the two Python
ints: no host synchronisation, capturable in a CUDA graph.

FP8 KV cache (``float8_e4m3fn``, per-tensor ``kv_scale``): loaded K/V are
``round_to_q_dtype(float32(k8) * kv_scale)`` (:func:`megatron_consistent.kernels.fp8.kv_dequantize`);
:func:`write_kv_cache` stores ``cast_e4m3(clamp(div_rn(float32(x), kv_scale), -448, 448))``
(:func:`megatron_consistent.kernels.fp8.kv_quantize`, round-to-nearest-even).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._common import GLUON, next_pow2, on_hopper, tma_ok
from .attention import (GLUON_ATTENTION_HEAD_DIMS, GLUON_ATTENTION_SCHEDULE, KV_BLOCK_GPU, PART_KEYS, ZERO_BLOCK_T,
                        _block_m_for, _launch, _part_blocks, _use_split, _zero_padding_rows)

PAGE_SIZES = (16, 32, 64, 128)
# Read key blocks of the step's new tokens from its K/V tensors when the caller passes them (``k_new``): loads
# only, never bits; ``MC_ATTN_NEW_KV=0`` reads every key from the cache (a rollout benchmark variant's A/B).
NEW_KV_FROM_STEP = os.environ.get("MC_ATTN_NEW_KV", "1") != "0"
# the padding rows written 0: by the Triton kernel's last launch (its programs past the query tiles), or by a launch of
# their own (``_zero_rows_kernel``) after the Gluon kernel or with no sequence; False only in bench_gpu_attention.py's
# variant that measures what the zeroing costs a decode step (its cases have no padding rows: the same bits)
ZERO_PADDING_ROWS = True

__all__ = ["PAGE_SIZES", "paged_attention", "paged_plan", "write_kv_cache"]


@triton.jit(do_not_specialize=["NSEQ", "T"])
def _zero_rows_kernel(O, QSL, NSEQ, T, sot, soh, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """``out[t] = 0`` for the padding tokens ``t >= query_start_loc[-1]``: the attention kernel's own zeroing
    (:func:`.attention._zero_padding_rows`) as a launch of its own, grid (row blocks, KV heads).  The counts are not
    specialised (Triton would compile a binary per ``== 1`` / ``% 16`` class of each: session 41's rollouts compiled
    one mid-rollout, after the warm-up pass)."""
    _zero_padding_rows(O, QSL, NSEQ, T, tl.program_id(0), tl.program_id(1), sot, soh, G, D, BLOCK_D)


def paged_plan(t_all: int, hq: int, hkv: int, nseq: int, max_query_len: int, max_seq_len: int,
               device: torch.device, split: bool | None = None, block_m: int = 0, head_dim: int = 128):
    """``(BLOCK_M, grid0, split, programs)`` of a :func:`paged_attention` call (shapes only): ``grid0`` bounds the
    query tiles (a program past a sequence's rows exits at once); ``programs`` counts those with rows, per kv head
    and all heads, from ``max_query_len``."""
    g = hq // hkv
    bm = _block_m_for(max(1, min(int(max_query_len), t_all)) * g, head_dim, block_m)
    grid0 = (t_all * g) // bm + nseq
    est = min(grid0, nseq * triton.cdiv(max(1, int(max_query_len)) * g, bm)) * hkv
    nparts = triton.cdiv(max(int(max_seq_len), 1), PART_KEYS)
    return bm, grid0, _use_split(split, est, nparts, device), est


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
                    max_query_len: int, max_seq_len: int, kv_scale: float | None = None,
                    *, k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                    split: bool | None = None, block_m: int = 0, decode_requests: int = -1,
                    gluon: str | None = None) -> torch.Tensor:
    """Causal GQA attention of varlen queries over a paged KV cache; writes and returns ``out``.

    * ``q [T, Hq, D]`` bf16/fp16, last dim contiguous; ``out [T, Hq, D]`` (or ``[T, Hq * D]``) in q's
      dtype, each token's ``Hq x D`` row contiguous (token stride free).
      Tokens ``t >= query_start_loc[-1]`` (padding) get ``out[t] = 0``.
    * ``k_cache, v_cache [num_blocks, page_size, Hkv, D]``: any strides with a contiguous last dim
      (e.g. ``kv_cache[0]``, ``kv_cache[1]`` of one ``[2, num_blocks, page_size, Hkv, D]`` tensor);
      ``page_size`` in :data:`PAGE_SIZES`; dtype = q's, or ``torch.float8_e4m3fn`` with ``kv_scale``.
    * ``block_table [num_seqs, max_pages]`` int32 (row stride free, last dim contiguous),
      ``query_start_loc [num_seqs + 1]`` int32, ``seq_lens [num_seqs]`` int32 (cached + new tokens),
      all contiguous on q's device.  Query ``i`` of sequence ``s`` sits at absolute position
      ``seq_lens[s] - q_len_s + i`` and sees keys ``0 .. position``.
    * ``max_query_len`` / ``max_seq_len``: Python ints, hints of the largest ``q_len_s`` /
      ``seq_lens[s]`` (e.g. the batch's values, or the engine's max_num_batched_tokens /
      max_model_len for a captured graph); they pick the tile size, the path and the split grid,
      never a bit, and a sequence exceeding them is still computed completely (same bits).
    * ``k_new, v_new [T, Hkv, D]`` (optional, last dim contiguous): the step's keys and values, token ``t`` the
      one the cache holds at query ``t``'s position (what :func:`write_kv_cache` stored before this call).  Key
      blocks made of new tokens only are then read from them with dense addresses instead of through the block
      table -- the same values, so the same bits; prefill at pages of 16 keys 12-14 % faster on the H200.  Ignored
      for an FP8 cache (the cache holds the quantized values), for pages of 64 keys or more (their blocks already
      load from one page each; measured 8-10 % slower with it) and for ``max_query_len`` 1 (decode: one new key).

    * ``decode_requests``: a Python int, the engine's host reading of the step (:func:`leading_decodes`): its first
      ``decode_requests`` sequences have one query token each and every later one more (-1: not known).  With
      the Gluon switch on (the default) the sequences after them run :mod:`.gluon_attention`'s paged kernel where
      :func:`gluon_paged_applies` says, and the one-token ones this kernel, in a launch of their own (a decode's few
      rows would idle a 128-row tile): the same rows, bit for bit, either way.  ``gluon``: a schedule of
      :data:`.gluon_attention.SCHEDULES` forces that kernel on the sequences after the first ``max(decode_requests,
      0)`` (Hopper; a cache in q's dtype, head dim 64 or 128, TMA-addressable K / V operands).

    No host synchronisation: grids come from tensor shapes and the two ints, so the call can be
    captured in a CUDA graph (the split path allocates its float32 workspace with ``torch.empty``
    inside the call, which capture supports).  ``split`` forces the path (``None``: by shapes)."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_attention: expected q [T,Hq,D], caches [blocks,page,Hkv,D]; got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    t_all, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    if page not in PAGE_SIZES:
        raise ValueError(f"paged_attention: page_size {page} not supported (supported: {PAGE_SIZES})")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"paged_attention: q must be bf16/fp16, got {q.dtype}")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8:
        if kv_scale is None:
            raise ValueError("paged_attention: a float8_e4m3fn KV cache needs kv_scale")
    elif k_cache.dtype != q.dtype:
        raise TypeError(f"paged_attention: cache dtype {k_cache.dtype} must be q's ({q.dtype}) or float8_e4m3fn")
    if v_cache.dtype != k_cache.dtype or k_cache.shape[3] != d or hq % hkv:
        raise ValueError("paged_attention: k/v caches must share dtype and head dim with q; Hq % Hkv == 0")
    if out.dim() == 2 and out.shape == (t_all, hq * d) and out.stride(-1) == 1:
        out3 = out.view(t_all, hq, d)
    else:
        out3 = out
    if out3.shape != q.shape or out3.dtype != q.dtype or out3.stride(-1) != 1:
        raise ValueError("paged_attention: out must be [T, Hq, D] (or [T, Hq*D]) in q's dtype, last dim contiguous")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or block_table.stride(-1) != 1:
        raise ValueError("paged_attention: q, caches and block_table need a contiguous last dim")
    if hq * d > 0 and out3.stride(1) != d:
        raise ValueError("paged_attention: out rows [Hq, D] must be contiguous")
    if (k_new is None) != (v_new is None):
        raise ValueError("paged_attention: pass both k_new and v_new, or neither")
    if k_new is not None and (k_new.shape != (t_all, hkv, d) or v_new.shape != k_new.shape or k_new.dtype != q.dtype
                              or v_new.dtype != q.dtype or k_new.stride(-1) != 1 or v_new.stride(-1) != 1):
        raise ValueError(f"paged_attention: k_new / v_new must be [T, Hkv, D] = {(t_all, hkv, d)} in q's dtype with a "
                         f"contiguous last dim; got {tuple(k_new.shape)} {k_new.dtype}, {tuple(v_new.shape)} {v_new.dtype}")
    if fp8 or page >= KV_BLOCK_GPU or max_query_len <= 1 or not NEW_KV_FROM_STEP:
        k_new = v_new = None
    nseq = seq_lens.shape[0]
    if t_all == 0:
        return out
    operands = (k_cache, v_cache) + ((k_new, v_new) if k_new is not None else ())
    if not -1 <= decode_requests <= nseq or (gluon is not None and decode_requests == nseq):
        raise ValueError(f"paged_attention: decode_requests={decode_requests} must be -1 .. {nseq} (the sequences), "
                         f"below it with gluon={gluon!r}")
    if gluon is not None and (fp8 or d not in GLUON_ATTENTION_HEAD_DIMS or not all(map(tma_ok, operands))):
        raise ValueError(f"paged_attention: the Gluon kernel takes a cache in q's dtype, head dims "
                         f"{GLUON_ATTENTION_HEAD_DIMS} and TMA-addressable K / V operands; got {k_cache.dtype}, "
                         f"head dim {d}")
    if gluon is None and gluon_paged_applies(q, k_cache, max_query_len, decode_requests, nseq) \
            and on_hopper(q) and all(map(tma_ok, operands)):
        gluon = GLUON_ATTENTION_SCHEDULE

    def committed(q, tab, qsl, seqs, out3, n, t, max_q, k_new, v_new, zero_padding=False):  # the Triton kernel
        bm, grid0, split_path, programs = paged_plan(t, hq, hkv, n, max_q, max_seq_len, q.device, split=split,
                                                     block_m=block_m, head_dim=d)
        _launch(q=q, k=k_cache, v=v_cache, tab=tab, qsl=qsl, seq=seqs, qpos=seqs, klen=seqs, out=out3, lse=None,
                scale=scale, kv_scale=kv_scale if fp8 else 1.0, nseq=n, tq=t, tk=0, hq=hq, hkv=hkv,
                qs=(0, q.stride(0), q.stride(1)), ks=(0, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)),
                vs=(0, v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)),
                os_=(0, out3.stride(0), out3.stride(1)), ps=(0, 0), stab=tab.stride(0),
                grid0=grid0, n1=hkv, max_kv=max_seq_len, page=page, fp8=fp8, split=split_path,
                bm=bm, d=d, k_new=k_new, v_new=v_new, programs=programs, zero_padding=zero_padding)

    if nseq > 0 and gluon is not None:
        from .gluon_attention import gluon_paged_attention

        nd = max(decode_requests, 0)  # one query token each: rows 0 .. nd - 1
        if nd:
            committed(q, block_table, query_start_loc, seq_lens, out3, nd, nd, 1, None, None)
        rest = slice(nd, None)
        gluon_paged_attention(q[rest], k_cache, v_cache, block_table[rest],
                              query_start_loc[rest] - nd if nd else query_start_loc, seq_lens[rest], scale, out3[rest],
                              *((k_new[rest], v_new[rest]) if k_new is not None else (None, None)),
                              kv_block=KV_BLOCK_GPU, part_blocks=_part_blocks(max_seq_len), schedule=gluon)
    elif nseq > 0:  # its last launch writes the padding rows 0 as well
        committed(q, block_table, query_start_loc, seq_lens, out3, nseq, t_all, max_query_len, k_new, v_new,
                  zero_padding=ZERO_PADDING_ROWS)
    if ZERO_PADDING_ROWS and (nseq == 0 or gluon is not None):
        _zero_rows_kernel[(triton.cdiv(t_all, ZERO_BLOCK_T.value), hkv)](
            out3, query_start_loc, nseq, t_all, out3.stride(0), out3.stride(1), G=hq // hkv, D=d,
            BLOCK_D=max(16, next_pow2(d)))
    return out


def gluon_paged_applies(q: torch.Tensor, k_cache: torch.Tensor, max_query_len: int, decode_requests: int,
                        nseq: int) -> bool:
    """Whether the Gluon paged kernel (:func:`.gluon_attention.gluon_paged_attention`, in
    ``attention.GLUON_ATTENTION_SCHEDULE``) takes a call's sequences after its one-token ones (the caller checks the
    device and TMA alignment): a cache in q's dtype (not FP8), head dim 64 or 128, the step's one-token sequences
    known to come first (``decode_requests >= 0``, the engine's hint: :func:`leading_decodes`), some sequences after
    them, and queries long enough to fill a tile (``max_query_len * G > 64``)."""
    g = q.shape[1] // k_cache.shape[2]
    return (GLUON and k_cache.dtype == q.dtype and q.shape[-1] in GLUON_ATTENTION_HEAD_DIMS
            and 0 <= decode_requests < nseq and max_query_len * g > 64)


def leading_decodes(query_lens: list[int]) -> int:
    """How many of a step's sequences, in order, come first with one query token each when every sequence after
    them has more than one (vLLM puts decodes first for a backend that asks: ``reorder_batch_threshold = 1``); -1
    when a one-token sequence follows a longer one (:func:`paged_attention`'s ``decode_requests``)."""
    nd = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
    return nd if all(n > 1 for n in query_lens[nd:]) else -1


# ----------------------------------------------------------------------------- KV-cache write


@triton.jit
def _write_kv_kernel(KEY, VAL, KC, VC, SLOT, kv_scale, HKV,
                     skt, skh, svt, svh, kcp, kct, kch, vcp, vct, vch,
                     D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     PAGE: tl.constexpr, FP8: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(SLOT + t).to(tl.int64)
    if slot < 0:
        return
    page = slot // PAGE
    off = slot % PAGE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    msk = (h < HKV)[:, None] & (d < D)[None, :]
    t64 = t.to(tl.int64)
    k = tl.load(KEY + t64 * skt + h[:, None] * skh + d[None, :], mask=msk, other=0.0)
    v = tl.load(VAL + t64 * svt + h[:, None] * svh + d[None, :], mask=msk, other=0.0)
    if FP8:
        k = tl.minimum(tl.maximum(tl.math.div_rn(k.to(tl.float32), kv_scale), -448.0), 448.0)
        v = tl.minimum(tl.maximum(tl.math.div_rn(v.to(tl.float32), kv_scale), -448.0), 448.0)
    tl.store(KC + page * kcp + off * kct + h[:, None] * kch + d[None, :], k.to(KC.dtype.element_ty), mask=msk)
    tl.store(VC + page * vcp + off * vct + h[:, None] * vch + d[None, :], v.to(VC.dtype.element_ty), mask=msk)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, kv_scale: float | None = None) -> None:
    """Store ``key, value [T, Hkv, D]`` (last dim contiguous) at ``slot_mapping [N]`` int64 (``N <= T``).

    Token ``i < N`` goes to page ``slot // page_size``, offset ``slot % page_size`` of
    ``k_cache, v_cache [num_blocks, page_size, Hkv, D]`` (any strides, contiguous last dim);
    ``slot < 0`` is skipped.  Same dtype: an exact copy (cast to the cache dtype); a
    ``float8_e4m3fn`` cache stores :func:`megatron_consistent.kernels.fp8.kv_quantize` of the values
    with ``kv_scale`` (required).  No host synchronisation (CUDA-graph capturable)."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    page, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    if page not in PAGE_SIZES:
        raise ValueError(f"write_kv_cache: page_size {page} not supported (supported: {PAGE_SIZES})")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 and kv_scale is None:
        raise ValueError("write_kv_cache: a float8_e4m3fn KV cache needs kv_scale")
    if key.shape[0] < n or key.shape[1:] != (hkv, d) or value.shape != key.shape:
        raise ValueError(f"write_kv_cache: key/value {tuple(key.shape)} do not match the cache {tuple(k_cache.shape)} / {n} slots")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("write_kv_cache: key, value and caches need a contiguous last dim")
    _write_kv_kernel[(n,)](
        key, value, k_cache, v_cache, slot_mapping, float(kv_scale) if fp8 else 1.0, hkv,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        D=d, BLOCK_H=next_pow2(hkv), BLOCK_D=next_pow2(d), PAGE=page, FP8=fp8, num_warps=4)

"""GPU attention benchmark: the consistent Triton kernels vs SDPA (flash) and vLLM's FA3, one run.

    python benchmarks/bench_gpu_attention.py --out /tmp/attn.json [--quick]
    python benchmarks/bench_gpu_attention.py --out /tmp/tiles.json --tiles   # launch shapes only
    python benchmarks/bench_gpu_attention.py --out /tmp/gluon.json --gluon   # the Gluon prefill kernels

* decode: B in {1, 4, 16, 64} x context in {4k, 8k, 32k}, and B = 8 at 16k (the long tail of the rollout
  benchmark's shape (c)); GQA 32/8, D 128, bf16:
  ``paged_attention`` (page 16; its shape-chosen path, plus the other path forced) vs
  ``scaled_dot_product_attention`` (flash backend, dense K/V, ``enable_gqa``) vs vLLM's FA3
  ``flash_attn_varlen_func`` with ``block_table`` on the same paged cache (when ``vllm.vllm_flash_attn`` imports);
  with the HBM floor = K+V bytes / device copy bandwidth measured in this run;
  the split path's two launches are also timed alone (eager, torch profiler): split and merge, so the rest of its
  time (launch gaps) shows; and the split path's scheduling variants (``SPLIT_VARIANTS``: the merge loop pipelined
  over 1-4 stages, ``attention.MERGE_STAGES``; the merge launch cut into 2-8 head-dimension slices, one program
  each, ``attention.MERGE_DSPLIT``; the split path's tile (warps / stages of both launches, ``attention.ATTN_TILES``
  at (16, split)); the merge as a programmatic dependent launch, ``attention.SPLIT_PDL``; the call
  without its padding rows' zeroing -- programs of the last launch since session 34, a launch of its own before --,
  ``paged_attention.ZERO_PADDING_ROWS``), each checked bitwise against the
  committed setting;
* prefill: one sequence of T in {4k, 16k}, GQA 32/8 and MHA 32/32: ``attention_fwd`` (dense, the
  trainer) and ``paged_attention`` (page 16, and page 64: one key block per page; called as the vLLM backend calls
  it, with the step's K/V, ``k_new``, read for pages of 16; page 16 also reading every key from the cache) vs SDPA
  (flash, causal) and FA3
  ``flash_attn_varlen_func``; TFLOP/s with causal FLOPs ``2 * T * (T + 1) * H * D``.

Every time is a CUDA-graph replay (``triton.testing.do_bench_cudagraph``) cycling through enough
input copies (separate pages / tensors) that the working set exceeds L2.  Writes JSON to ``--out``
and prints a table; ratios are ``time(reference) / time(ours)`` (> 1: ours faster).

``--contract-probe`` measures what a change of the contract's two constants would buy (measurement only; a
different key block or partition gives different bits, equally consistent across paths, and would be adopted
as one change with every GPU test re-run): dense prefill (T = 4k / 16k, GQA and MHA) and dense decode (B = 1 / 4)
with key blocks of 64 / 128 and partitions of 256 / 512 keys, against the committed (64, 512) in one run.

``--tiles`` times the candidate launch shapes of ``attention.ATTN_TILES`` (query tile, warps, stages, on
the path each case takes) on the prefill (dense and paged, T = 4k / 16k) and decode (B = 1 / 4 at 32k,
B = 8 at 16k: split; B = 64 at 8k: in-program) cases against FA3, each checked bitwise against the default
tile's output in the same run (a launch shape may only be adopted if it keeps every bit).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kernel_trace import profiled_kernels  # noqa: E402
from module_knobs import module_knobs  # noqa: E402
from megatron_consistent.kernels.triton import attention as tattn
from megatron_consistent.kernels.triton import paged_attention as tpa

DEV = torch.device("cuda")
HQ, HKV, D = 32, 8, 128
PAGE = 16
MAX_MODEL_LEN = 32768  # the max_seq_len bound every paged call of this benchmark passes (its longest context)
L2_FLUSH_BYTES = 256 << 20  # working set per timed graph (H200 L2 is 50 MB)

try:  # vLLM's FA3 build (paged decode goes through flash_attn_varlen_func + block_table, as vLLM's backend does)
    from vllm.vllm_flash_attn import flash_attn_varlen_func  # type: ignore

    _FA = True
except Exception as e:  # noqa: BLE001
    _FA = False
    _FA_ERR = repr(e)


def bench(fns, rep=40):
    """ms per call of ``fns`` (a list of closures over different input copies, cycled)."""
    state = {"i": 0}

    def step():
        fns[state["i"] % len(fns)]()
        state["i"] += 1

    for f in fns:
        f()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(step, rep=rep)


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write)."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench_cudagraph(lambda: dst.copy_(src), rep=50)
    return 2 * n / (ms * 1e-3)


def _sdpa(q, k, v, causal, gqa):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        kw = {"enable_gqa": True} if gqa else {}
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, **kw)


def _try(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        print(f"  (skipped: {type(e).__name__}: {str(e)[:160]})", flush=True)
        return float("nan")


# scheduling variants of the split decode path (module knobs of attention.py, and of paged_attention.py for the
# padding rows' zeroing, which these cases do not need; loads and launches only, never bits)
SPLIT_VARIANTS = ([(f"merge stages {n}", "attention", {"MERGE_STAGES": n, "MERGE_DSPLIT": 1}) for n in (1, 2, 3, 4)]
                  + [(f"merge stages 4, {k} head-dim slices", "attention", {"MERGE_STAGES": 4, "MERGE_DSPLIT": k})
                     for k in (2, 4, 8)]
                  + [(f"split tile {w} warps / {st} stages", "attention",
                      {"ATTN_TILES": {**tattn.ATTN_TILES, (16, True): (w, st)}}) for w, st in ((1, 2), (2, 3), (4, 2), (4, 3))]
                  + [("merge as a dependent launch (PDL)", "attention", {"SPLIT_PDL": True}),
                     ("without the padding rows' zeroing", "paged_attention", {"ZERO_PADDING_ROWS": False})])


def split_phases_ms(fn, iters: int = 20) -> tuple[float, float]:
    """Median device time (ms) of the split launch and of the merge launch of ``fn`` (one call on the split path,
    eager), from a torch-profiler trace: each call launches ``_attn_kernel`` twice, split then merge."""
    durs = [dur for name, _, dur in profiled_kernels(fn, iters) if "_attn_kernel" in name]
    if len(durs) != 2 * iters:
        raise RuntimeError(f"expected {2 * iters} attention launches in the trace, found {len(durs)}")
    return statistics.median(durs[0::2]) / 1e3, statistics.median(durs[1::2]) / 1e3


def decode_case(b, ctx, bw, rows):
    kv_bytes = 2 * b * ctx * HKV * D * 2
    copies = max(1, min(8, math.ceil(L2_FLUSH_BYTES / kv_bytes)))
    pages_per_seq = triton.cdiv(ctx, PAGE)
    nblocks = copies * b * pages_per_seq
    kv = torch.randn(2, nblocks, PAGE, HKV, D, device=DEV, dtype=torch.bfloat16)
    kc, vc = kv[0], kv[1]
    perm = torch.randperm(nblocks, device=DEV).to(torch.int32).view(copies, b, pages_per_seq)
    qs = [torch.randn(b, HQ, D, device=DEV, dtype=torch.bfloat16) for _ in range(copies)]
    outs = [torch.empty_like(x) for x in qs]
    qsl = torch.arange(b + 1, device=DEV, dtype=torch.int32)
    seq = torch.full((b,), ctx, device=DEV, dtype=torch.int32)
    scale = D ** -0.5

    def ours(split=None):
        return [lambda i=i: tpa.paged_attention(qs[i], kc, vc, perm[i], qsl, seq, scale, outs[i], 1, MAX_MODEL_LEN,
                                                  split=split) for i in range(copies)]

    r = {"kind": "decode", "B": b, "ctx": ctx, "kv_bytes": kv_bytes}
    r["hbm_floor_ms"] = kv_bytes / bw * 1e3
    r["ours_ms"] = bench(ours())
    est_split = tpa.paged_plan(b, HQ, HKV, b, 1, MAX_MODEL_LEN, DEV)[2]
    r["ours_path"] = "split" if est_split else "in-program"
    r["ours_other_path_ms"] = bench(ours(split=not est_split))
    # where the split path's time goes: its two launches alone (eager, profiled) and the rest of the graph replay
    phases = _try(lambda: split_phases_ms(ours(split=True)[0]))
    r["split_launch_ms"], r["merge_launch_ms"] = phases if isinstance(phases, tuple) else (phases, phases)
    if est_split:  # scheduling variants of the split path: time, and bits against the committed setting
        ours(split=True)[0]()
        ref = outs[0].clone()
        r["split_variants_ms"], r["split_variants_bits_equal"] = {}, {}
        for name, module, knobs in SPLIT_VARIANTS:
            with module_knobs({"attention": tattn, "paged_attention": tpa}[module], knobs):
                r["split_variants_ms"][name] = bench(ours(split=True))
                ours(split=True)[0]()
                r["split_variants_bits_equal"][name] = bool(torch.equal(outs[0], ref))
    # SDPA on dense copies of the same size
    dense = [(torch.randn(b, HKV, ctx, D, device=DEV, dtype=torch.bfloat16),
              torch.randn(b, HKV, ctx, D, device=DEV, dtype=torch.bfloat16)) for _ in range(min(copies, 4))]
    sq = [x.view(b, HQ, 1, D) for x in qs]
    r["sdpa_ms"] = _try(lambda: bench([lambda i=i: _sdpa(sq[i], *dense[i], False, True) for i in range(len(dense))]))
    if _FA:
        fo = [torch.empty_like(x) for x in qs]
        r["fa3_ms"] = _try(lambda: bench([lambda i=i: flash_attn_varlen_func(
            q=qs[i], k=kc, v=vc, out=fo[i], cu_seqlens_q=qsl, max_seqlen_q=1, seqused_k=seq, max_seqlen_k=ctx,
            softmax_scale=scale, causal=True, block_table=perm[i], fa_version=3) for i in range(copies)]))
    else:
        r["fa3_ms"] = float("nan")
    for k in ("sdpa", "fa3"):
        r[f"ratio_vs_{k}"] = r[f"{k}_ms"] / r["ours_ms"]
    r["ratio_vs_floor"] = r["hbm_floor_ms"] / r["ours_ms"]
    rows.append(r)
    print(f"decode B={b:3d} ctx={ctx:6d}  floor {r['hbm_floor_ms']:.4f}  ours {r['ours_ms']:.4f} ({r['ours_path']}; "
          f"other {r['ours_other_path_ms']:.4f})  sdpa {r['sdpa_ms']:.4f}  fa3 {r['fa3_ms']:.4f} ms   "
          f"ours/floor {r['ratio_vs_floor']:.2f}  x sdpa {r['ratio_vs_sdpa']:.2f}  x fa3 {r['ratio_vs_fa3']:.2f}"
          f"   split path: split launch {r['split_launch_ms']:.4f} + merge launch {r['merge_launch_ms']:.4f} ms",
          flush=True)
    for name, ms in r.get("split_variants_ms", {}).items():
        print(f"    split path, {name:36s} {ms:.4f} ms  bits {'equal' if r['split_variants_bits_equal'][name] else 'DIFFER'}",
              flush=True)


def paged_copy(ks, vs, page):
    """``ks[i], vs[i]`` (``[1, T, Hkv, D]``, one sequence each) written into one page-``page`` cache, pages shuffled
    -> ``(kv [2, pages, page, Hkv, D], block tables [copies, 1, pages of a copy])``."""
    t, hkv = ks[0].shape[1], ks[0].shape[2]
    npg = triton.cdiv(t, page)
    kv = torch.zeros(2, len(ks) * npg, page, hkv, D, device=DEV, dtype=ks[0].dtype)
    tab = torch.randperm(len(ks) * npg, device=DEV).to(torch.int32).view(len(ks), 1, npg)
    for i, (k, v) in enumerate(zip(ks, vs)):
        slots = (tab[i, 0].to(torch.int64)[:, None] * page + torch.arange(page, device=DEV)).flatten()[:t]
        tpa.write_kv_cache(k[0], v[0], kv[0], kv[1], slots)
    return kv, tab


def _prefill_inputs(t, hkv, d=D):
    """Input copies (enough to exceed L2) of one causal sequence of ``t`` tokens: ``(copies, qs, ks, vs, positions,
    key lengths, causal FLOPs)``."""
    per = 2 * t * (HQ + 2 * hkv) * d
    copies = max(1, min(4, math.ceil(L2_FLUSH_BYTES / per)))
    qs = [torch.randn(1, t, HQ, d, device=DEV, dtype=torch.bfloat16) for _ in range(copies)]
    ks = [torch.randn(1, t, hkv, d, device=DEV, dtype=torch.bfloat16) for _ in range(copies)]
    vs = [torch.randn(1, t, hkv, d, device=DEV, dtype=torch.bfloat16) for _ in range(copies)]
    return (copies, qs, ks, vs, torch.arange(t, device=DEV)[None], torch.full((1,), t, device=DEV),
            2.0 * t * (t + 1) * HQ * d)


def _fa3_prefill_ms(qs, ks, vs, t, scale, copies):
    """vLLM's FA3 on the same dense causal sequences (NaN without vLLM)."""
    if not _FA:
        return float("nan")
    cu = torch.tensor([0, t], device=DEV, dtype=torch.int32)
    return _try(lambda: bench([lambda i=i: flash_attn_varlen_func(
        q=qs[i][0], k=ks[i][0], v=vs[i][0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=t, max_seqlen_k=t,
        softmax_scale=scale, causal=True, fa_version=3) for i in range(copies)]))


def gluon_prefill_case(t, hkv, d, rows):
    """Dense prefill: each schedule of the Gluon kernel (``gluon_attention``) against the committed kernel (bits and
    time), SDPA and FA3, one run; then the paged prefill (:func:`paged_gluon_prefill`)."""
    from megatron_consistent.kernels.triton.gluon_attention import SCHEDULES

    scale = d ** -0.5
    copies, qs, ks, vs, pos, kl, flops = _prefill_inputs(t, hkv, d)
    ref = tattn.attention_fwd(qs[0], ks[0], vs[0], pos, kl, scale)
    ours_ms = bench([lambda i=i: tattn.attention_fwd(qs[i], ks[i], vs[i], pos, kl, scale) for i in range(copies)])
    sq, sk, sv = ([x.transpose(1, 2) for x in xs] for xs in (qs, ks, vs))
    sdpa_ms = _try(lambda: bench([lambda i=i: _sdpa(sq[i], sk[i], sv[i], True, hkv != HQ) for i in range(copies)]))
    fa3_ms = _fa3_prefill_ms(qs, ks, vs, t, scale, copies)
    for schedule in SCHEDULES:
        got = _try(lambda: tattn.attention_fwd(qs[0], ks[0], vs[0], pos, kl, scale, gluon=schedule))
        r = {"kind": "gluon prefill", "schedule": schedule, "T": t, "Hq": HQ, "Hkv": hkv, "D": d,
             "bits_equal": isinstance(got, tuple) and torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1]),
             "ours_dense_ms": ours_ms, "sdpa_ms": sdpa_ms, "fa3_ms": fa3_ms,
             "gluon_ms": _try(lambda: bench([lambda i=i: tattn.attention_fwd(qs[i], ks[i], vs[i], pos, kl, scale,
                                                                              gluon=schedule) for i in range(copies)]))}
        for k in ("ours_dense", "gluon", "sdpa", "fa3"):
            r[f"{k}_tflops"] = flops / r[f"{k}_ms"] * 1e-9
        r["gluon_vs_ours"] = ours_ms / r["gluon_ms"]
        r["gluon_vs_fa3"] = fa3_ms / r["gluon_ms"]
        r["ours_vs_fa3"] = fa3_ms / ours_ms
        rows.append(r)
        print(f"prefill T={t:6d} Hq/Hkv={HQ}/{hkv:2d} D={d:3d} {schedule:19s} TFLOP/s: committed "
              f"{r['ours_dense_tflops']:6.1f}  gluon {r['gluon_tflops']:6.1f}  sdpa {r['sdpa_tflops']:6.1f}  fa3 "
              f"{r['fa3_tflops']:6.1f}   gluon x committed {r['gluon_vs_ours']:.2f}  gluon x fa3 "
              f"{r['gluon_vs_fa3']:.2f}  committed x fa3 {r['ours_vs_fa3']:.2f}  "
              f"bits {'equal' if r['bits_equal'] else 'DIFFER'}", flush=True)
    if d == D:  # the engine's paged prefill (one sequence, its K / V as the step's tensors at pages under 64 keys)
        paged_gluon_prefill(t, hkv, qs, ks, vs, copies, flops, fa3_ms, rows)


def paged_gluon_prefill(t, hkv, qs, ks, vs, copies, flops, fa3_ms, rows):
    """Paged prefill as the engine calls it, pages of 16 and 64 keys: each schedule of the Gluon paged kernel against
    the committed ``paged_attention`` (bits and time) and FA3, one run."""
    from megatron_consistent.kernels.triton.gluon_attention import SCHEDULES

    scale = D ** -0.5
    qsl = torch.tensor([0, t], device=DEV, dtype=torch.int32)
    seq = torch.tensor([t], device=DEV, dtype=torch.int32)
    pq = [x[0] for x in qs]
    outs = [torch.empty_like(x) for x in pq]
    for page in (PAGE, 64):
        kv, tab = paged_copy(ks, vs, page)
        step = [(ks[i][0], vs[i][0]) if page < 64 else (None, None) for i in range(copies)]
        committed_ms = bench([lambda i=i, kv=kv, tab=tab: tpa.paged_attention(
            pq[i], kv[0], kv[1], tab[i], qsl, seq, scale, outs[i], t, MAX_MODEL_LEN, k_new=step[i][0], v_new=step[i][1])
            for i in range(copies)])
        ref = outs[0].clone()
        for schedule in SCHEDULES:
            outs[0].fill_(float("nan"))
            gluon_ms = _try(lambda kv=kv, tab=tab: bench([lambda i=i: tpa.paged_attention(
                pq[i], kv[0], kv[1], tab[i], qsl, seq, scale, outs[i], t, MAX_MODEL_LEN, k_new=step[i][0], v_new=step[i][1],
                gluon=schedule) for i in range(copies)]))
            r = {"kind": "gluon paged prefill", "schedule": schedule, "T": t, "Hq": HQ, "Hkv": hkv, "D": D,
                 "page": page, "bits_equal": bool(torch.equal(ref, outs[0])), "committed_ms": committed_ms,
                 "gluon_ms": gluon_ms, "fa3_ms": fa3_ms, "committed_tflops": flops / committed_ms * 1e-9,
                 "gluon_tflops": flops / gluon_ms * 1e-9, "gluon_vs_committed": committed_ms / gluon_ms,
                 "gluon_vs_fa3": fa3_ms / gluon_ms, "committed_vs_fa3": fa3_ms / committed_ms}
            rows.append(r)
            print(f"paged prefill T={t:6d} Hq/Hkv={HQ}/{hkv:2d} page {page:3d} {schedule:19s} TFLOP/s: committed "
                  f"{r['committed_tflops']:6.1f}  gluon {r['gluon_tflops']:6.1f}   gluon x committed "
                  f"{r['gluon_vs_committed']:.2f}  gluon x fa3 {r['gluon_vs_fa3']:.2f}  committed x fa3 "
                  f"{r['committed_vs_fa3']:.2f}  bits {'equal' if r['bits_equal'] else 'DIFFER'}", flush=True)
        del kv


def prefill_case(t, hkv, rows):
    scale = D ** -0.5
    copies, qs, ks, vs, pos, kl, flops = _prefill_inputs(t, hkv)
    r = {"kind": "prefill", "T": t, "Hq": HQ, "Hkv": hkv}
    r["ours_dense_ms"] = bench([lambda i=i: tattn.attention_fwd(qs[i], ks[i], vs[i], pos, kl, scale) for i in range(copies)])
    # paged: the same K/V in a page-16 cache and in a page-64 cache (one key block per page), pages shuffled; called
    # as the vLLM backend calls it (with the step's K/V: read for pages of 16), and at page 16 reading every key from
    # the cache as well (bits checked equal)
    qsl = torch.tensor([0, t], device=DEV, dtype=torch.int32)
    seq = torch.tensor([t], device=DEV, dtype=torch.int32)
    pq = [x[0] for x in qs]
    outs = [torch.empty_like(x) for x in pq]
    for page, key in ((PAGE, "ours_paged"), (64, "ours_paged64")):
        kv, tab = paged_copy(ks, vs, page)
        r[f"{key}_ms"] = bench([lambda i=i, kv=kv, tab=tab: tpa.paged_attention(
            pq[i], kv[0], kv[1], tab[i], qsl, seq, scale, outs[i], t, MAX_MODEL_LEN, k_new=ks[i][0], v_new=vs[i][0])
            for i in range(copies)])
        if page == PAGE:
            ref = outs[0].clone()
            r["ours_paged_cache_only_ms"] = bench([lambda i=i, kv=kv, tab=tab: tpa.paged_attention(
                pq[i], kv[0], kv[1], tab[i], qsl, seq, scale, outs[i], t, MAX_MODEL_LEN) for i in range(copies)])
            r["ours_paged_cache_only_bits_equal"] = bool(torch.equal(ref, outs[0]))
        del kv
    sq = [x.transpose(1, 2) for x in qs]
    sk = [x.transpose(1, 2) for x in ks]
    sv = [x.transpose(1, 2) for x in vs]
    r["sdpa_ms"] = _try(lambda: bench([lambda i=i: _sdpa(sq[i], sk[i], sv[i], True, hkv != HQ) for i in range(copies)]))
    r["fa3_ms"] = _fa3_prefill_ms(qs, ks, vs, t, scale, copies)
    for k in ("ours_dense", "ours_paged", "ours_paged64", "ours_paged_cache_only", "sdpa", "fa3"):
        r[f"{k}_tflops"] = flops / r[f"{k}_ms"] * 1e-9
    r["ratio_dense_vs_sdpa"] = r["sdpa_ms"] / r["ours_dense_ms"]
    r["ratio_dense_vs_fa3"] = r["fa3_ms"] / r["ours_dense_ms"]
    r["ratio_paged_vs_fa3"] = r["fa3_ms"] / r["ours_paged_ms"]
    rows.append(r)
    print(f"prefill T={t:6d} Hq/Hkv={HQ}/{hkv:2d}  TFLOP/s: ours dense {r['ours_dense_tflops']:6.1f}  ours paged "
          f"{r['ours_paged_tflops']:6.1f} (page 64: {r['ours_paged64_tflops']:6.1f})  sdpa {r['sdpa_tflops']:6.1f}  "
          f"fa3 {r['fa3_tflops']:6.1f}   "
          f"dense x sdpa {r['ratio_dense_vs_sdpa']:.2f}  dense x fa3 {r['ratio_dense_vs_fa3']:.2f}  "
          f"paged x fa3 {r['ratio_paged_vs_fa3']:.2f}", flush=True)
    print(f"    page 16 reading every key from the cache: {r['ours_paged_cache_only_tflops']:6.1f} TFLOP/s, bits "
          f"{'equal' if r['ours_paged_cache_only_bits_equal'] else 'DIFFER'}", flush=True)


# --tiles: launch shapes tried per query-tile class, (BLOCK_M, num_warps, num_stages), on the path each case takes
PREFILL_TILES = [(128, 8, s) for s in (2, 3, 4)] + [(128, 4, 2), (64, 4, 2), (64, 4, 3)]
DECODE_TILES = [(16, w, s) for w in (2, 4) for s in (2, 3, 4)] + [(16, 4, 5), (16, 8, 3)]
TILE_PREFILL_CASES = ((16384, 8, False), (16384, 8, True), (16384, 32, False), (4096, 8, False))  # (T, Hkv, paged)
TILE_DECODE_CASES = ((1, 4096), (4, 4096), (1, 32768), (4, 32768), (8, 16384), (64, 8192))  # (B, context)


def _with_tile(tile, split: bool, fn):
    """``fn(block_m)`` with ``attention.ATTN_TILES`` set to ``tile`` for its (query-tile class, path)."""
    bm, warps, stages = tile
    saved = dict(tattn.ATTN_TILES)
    tattn.ATTN_TILES[(bm, split)] = (warps, stages)
    try:
        return fn(bm)
    finally:
        tattn.ATTN_TILES.clear()
        tattn.ATTN_TILES.update(saved)


def _tile_rows(case: dict, run, fa3_ms: float, flops: float | None, tiles, rows):
    """Time ``run(block_m)`` (-> output tensors) under each tile; bits against the default tile's outputs."""
    ref = [x.clone() for x in run(0)]
    for tile in tiles:
        default = tuple(tile) == (case["block_m"], *tattn.ATTN_TILES[(case["block_m"], case["split"])])

        def timed(bm):
            same = all(torch.equal(a, b) for a, b in zip(run(bm), ref))
            return same, bench([lambda: run(bm)])
        try:
            same, ms = _with_tile(tile, case["split"], timed)
        except Exception as e:  # noqa: BLE001 (a tile that does not compile or fit is a row, not a stop)
            rows.append({**case, "tile": list(tile), "default": default, "error": f"{type(e).__name__}: {str(e)[:160]}"})
            print(f"  {case['case']:28s} tile {tile}  failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        r = {**case, "tile": list(tile), "default": default, "ms": ms, "bits_equal_default": same, "fa3_ms": fa3_ms,
             "ratio_vs_fa3": fa3_ms / ms}
        if flops:
            r["tflops"] = flops / ms * 1e-9
        if "hbm_floor_ms" in case:
            r["ratio_vs_floor"] = case["hbm_floor_ms"] / ms
        rows.append(r)
        print(f"  {case['case']:28s} tile {tile}{' (default)' if default else ''}  {ms:.4f} ms  "
              f"x fa3 {r['ratio_vs_fa3']:.2f}  bits {'equal' if same else 'DIFFER'}", flush=True)


def tile_sweep(bw, rows, decode_only: bool = False):
    """Launch shapes of the attention kernel (numerics-neutral: checked bitwise against the default tile here)."""
    scale = D ** -0.5
    for t, hkv, paged in () if decode_only else TILE_PREFILL_CASES:
        q = torch.randn(1, t, HQ, D, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(1, t, hkv, D, device=DEV, dtype=torch.bfloat16)
        v = torch.randn(1, t, hkv, D, device=DEV, dtype=torch.bfloat16)
        pos = torch.arange(t, device=DEV)[None]
        kl = torch.full((1,), t, device=DEV)
        cu = torch.tensor([0, t], device=DEV, dtype=torch.int32)
        fa3 = float("nan")
        if _FA:
            fa3 = _try(lambda: bench([lambda: flash_attn_varlen_func(
                q=q[0], k=k[0], v=v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=t, max_seqlen_k=t,
                softmax_scale=scale, causal=True, fa_version=3)]))
        if paged:  # the engine's prefill: the same K/V in a page-16 cache, pages shuffled
            kv, tab = paged_copy([k], [v], PAGE)
            seq = torch.tensor([t], device=DEV, dtype=torch.int32)
            out = torch.empty_like(q[0])

            def run(bm):
                return [tpa.paged_attention(q[0], kv[0], kv[1], tab[0], cu, seq, scale, out, t, MAX_MODEL_LEN, block_m=bm)]
        else:
            def run(bm):
                return list(tattn.attention_fwd(q, k, v, pos, kl, scale, block_m=bm))
        case = {"kind": "prefill", "case": f"prefill {'paged' if paged else 'dense'} T={t} {HQ}/{hkv}", "T": t,
                "Hkv": hkv, "paged": paged, "split": False, "block_m": tattn._block_m_for(t * (HQ // hkv))}
        _tile_rows(case, run, fa3, 2.0 * t * (t + 1) * HQ * D, PREFILL_TILES, rows)
    for b, ctx in TILE_DECODE_CASES:
        pages = triton.cdiv(ctx, PAGE)
        kv = torch.randn(2, b * pages, PAGE, HKV, D, device=DEV, dtype=torch.bfloat16)
        tab = torch.randperm(b * pages, device=DEV).to(torch.int32).view(b, pages)
        q = torch.randn(b, HQ, D, device=DEV, dtype=torch.bfloat16)
        out = torch.empty_like(q)
        qsl = torch.arange(b + 1, device=DEV, dtype=torch.int32)
        seq = torch.full((b,), ctx, device=DEV, dtype=torch.int32)
        fa3 = float("nan")
        if _FA:
            fo = torch.empty_like(q)
            fa3 = _try(lambda: bench([lambda: flash_attn_varlen_func(
                q=q, k=kv[0], v=kv[1], out=fo, cu_seqlens_q=qsl, max_seqlen_q=1, seqused_k=seq, max_seqlen_k=ctx,
                softmax_scale=scale, causal=True, block_table=tab, fa_version=3)]))

        def run(bm):
            return [tpa.paged_attention(q, kv[0], kv[1], tab, qsl, seq, scale, out, 1, MAX_MODEL_LEN, block_m=bm)]
        split = tpa.paged_plan(b, HQ, HKV, b, 1, MAX_MODEL_LEN, DEV)[2]
        case = {"kind": "decode", "case": f"decode B={b} ctx={ctx}", "B": b, "ctx": ctx, "split": split,
                "block_m": tattn._block_m_for(HQ // HKV), "hbm_floor_ms": 2 * b * ctx * HKV * D * 2 / bw * 1e3}
        _tile_rows(case, run, fa3, None, DECODE_TILES, rows)


# --contract-probe: (key block, blocks per partition, tiles for (BLOCK_M, split) -> (warps, stages) or None)
PROBE_CONTRACTS = [(64, 8, None), (128, 4, None), (128, 4, {(128, False): (8, 2), (64, False): (4, 2)}),
                   (64, 4, None), (128, 2, {(128, False): (8, 2), (64, False): (4, 2)})]
PROBE_PREFILL = ((4096, 8), (16384, 8), (16384, 32))  # (T, Hkv)
PROBE_DECODE = ((1, 4096), (1, 32768), (4, 8192), (4, 32768))  # (B, context)


def _with_contract(block_n: int, part_blocks: int, tiles, fn):
    """``fn()`` with the attention module's key block / partition constants (and tiles) set in this process."""
    saved = (tattn.KV_BLOCK_GPU, tattn.PART_BLOCKS, dict(tattn.ATTN_TILES))
    tattn.KV_BLOCK_GPU, tattn.PART_BLOCKS = block_n, part_blocks
    tattn.ATTN_TILES.update(tiles or {})
    try:
        return fn()
    finally:
        tattn.KV_BLOCK_GPU, tattn.PART_BLOCKS = saved[0], saved[1]
        tattn.ATTN_TILES.clear()
        tattn.ATTN_TILES.update(saved[2])


def contract_probe(bw, rows):
    """Dense attention under each (key block, partition) of PROBE_CONTRACTS; time and max |diff| to the committed."""
    scale = D ** -0.5
    cases = []
    for t, hkv in PROBE_PREFILL:
        per = 2 * t * (HQ + 2 * hkv) * D
        copies = max(1, min(4, math.ceil(L2_FLUSH_BYTES / per)))
        inp = [(torch.randn(1, t, HQ, D, device=DEV, dtype=torch.bfloat16),
                torch.randn(1, t, hkv, D, device=DEV, dtype=torch.bfloat16),
                torch.randn(1, t, hkv, D, device=DEV, dtype=torch.bfloat16)) for _ in range(copies)]
        pos, kl = torch.arange(t, device=DEV)[None], torch.full((1,), t, device=DEV)
        cases.append(({"kind": "probe prefill", "T": t, "Hkv": hkv}, inp, pos, kl, 2.0 * t * (t + 1) * HQ * D, None))
    for b, ctx in PROBE_DECODE:
        kv_bytes = 2 * b * ctx * HKV * D * 2
        copies = max(1, min(8, math.ceil(L2_FLUSH_BYTES / kv_bytes)))
        inp = [(torch.randn(b, 1, HQ, D, device=DEV, dtype=torch.bfloat16),
                torch.randn(b, ctx, HKV, D, device=DEV, dtype=torch.bfloat16),
                torch.randn(b, ctx, HKV, D, device=DEV, dtype=torch.bfloat16)) for _ in range(copies)]
        pos, kl = torch.full((b, 1), ctx - 1, device=DEV), torch.full((b,), ctx, device=DEV)
        cases.append(({"kind": "probe decode", "B": b, "ctx": ctx}, inp, pos, kl, None, kv_bytes / bw * 1e3))
    for case, inp, pos, kl, flops, floor in cases:
        ref, base_ms = None, None
        for block_n, part_blocks, tiles in PROBE_CONTRACTS:
            def run(inp=inp, pos=pos, kl=kl):
                out = tattn.attention_fwd(*inp[0], pos, kl, scale)[0].clone()
                return out, bench([lambda i=i: tattn.attention_fwd(*inp[i], pos, kl, scale) for i in range(len(inp))])
            r = {**case, "key_block": block_n, "part_keys": block_n * part_blocks,
                 "tiles": {str(k): v for k, v in (tiles or {}).items()}}
            try:
                out, ms = _with_contract(block_n, part_blocks, tiles, run)
            except Exception as e:  # noqa: BLE001 (a variant that does not fit is a row, not a stop)
                r["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                rows.append(r)
                print(f"  {case}  key block {block_n} part {block_n * part_blocks}: failed {r['error'][:100]}")
                continue
            if ref is None:
                ref, base_ms = out, ms
            r.update(ms=ms, ratio_vs_committed=base_ms / ms, max_abs_vs_committed=(out.float() - ref.float()).abs().max().item())
            if flops:
                r["tflops"] = flops / ms * 1e-9
            if floor:
                r["ratio_vs_floor"] = floor / ms
            rows.append(r)
            label = f"T={case['T']} {HQ}/{case['Hkv']}" if flops else f"B={case['B']} ctx={case['ctx']}"
            extra = f"{r['tflops']:6.1f} TFLOP/s" if flops else f"floor x {r['ratio_vs_floor']:.2f}"
            print(f"{case['kind']:13s} {label:16s} key block {block_n:3d} part {block_n * part_blocks:4d}"
                  f"{' tiles ' + str(tiles) if tiles else ''}: {ms:.4f} ms  {extra}  x committed "
                  f"{r['ratio_vs_committed']:.2f}  max|diff| {r['max_abs_vs_committed']:.2e}", flush=True)
        torch.cuda.empty_cache()


def best_tiles(rows, min_gain: float = 0.02) -> dict[tuple[int, bool], tuple[int, int]]:
    """Per (query-tile class, path) the tile with the lowest geometric-mean time over the cases of that class and
    path (a tile of another BLOCK_M forced on a case is reported, never adopted), among tiles whose bits equal the
    default's in every case; kept only if ``min_gain`` faster than the default."""
    chosen = {}
    own = [r for r in rows if r["tile"][0] == r["block_m"]]
    for key in {(r["block_m"], r["split"]) for r in own}:
        cases = {r["case"] for r in own if (r["block_m"], r["split"]) == key}
        by_tile: dict[tuple, list] = {}
        for r in own:
            if (r["block_m"], r["split"]) == key:
                by_tile.setdefault(tuple(r["tile"]), []).append(r)
        score = {t: sum(math.log(r["ms"]) for r in rs) / len(rs) for t, rs in by_tile.items()
                 if len(rs) == len(cases) and all(r.get("bits_equal_default") for r in rs)}
        default = next((t for t, rs in by_tile.items() if rs[0]["default"]), None)
        if not score or default not in score:
            continue
        best = min(score, key=score.get)
        if math.exp(score[default] - score[best]) >= 1 + min_gain:
            chosen[key] = best[1:]
    return chosen


def write_table(path: str, chosen: dict) -> None:
    """Rewrite the ``ATTN_TILES`` assignment of ``attention.py`` at ``path`` with the chosen entries."""
    import re

    tiles = dict(tattn.ATTN_TILES) | chosen
    src = open(path).read()
    body = "".join(f"    ({bm}, {sp}): ({w}, {s}),\n" for (bm, sp), (w, s) in sorted(tiles.items()))
    new, n = re.subn(r"^ATTN_TILES: (dict\[.*?\]) = \{.*?\n\}\n", lambda m: f"ATTN_TILES: {m.group(1)} = {{\n{body}}}\n",
                     src, count=1, flags=re.M | re.S)
    if n != 1:
        raise SystemExit(f"{path}: no ATTN_TILES assignment to rewrite")
    open(path, "w").write(new)
    print(f"wrote ATTN_TILES into {path}:\n{body}")


def decode_cases_arg(text: str) -> list[tuple[int, int]]:
    """``"B:CTX,..."`` -> ``[(B, CTX), ...]`` (positive integers; a context at most :data:`MAX_MODEL_LEN`)."""
    cases = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        parts = item.split(":")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts) or int(parts[1]) > MAX_MODEL_LEN:
            raise argparse.ArgumentTypeError(f"{item!r} is not B:CTX with positive integers and CTX <= {MAX_MODEL_LEN}")
        cases.append((int(parts[0]), int(parts[1])))
    if not cases:
        raise argparse.ArgumentTypeError("no decode case given")
    return cases


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--quick", action="store_true", help="a subset (smoke run)")
    ap.add_argument("--tiles", action="store_true", help="only the launch-shape sweep (ATTN_TILES candidates)")
    ap.add_argument("--decode-only", action="store_true", help="the decode cases only (also with --tiles)")
    ap.add_argument("--decode-cases", type=decode_cases_arg, metavar="B:CTX,...",
                    help="these decode cases in place of the default list (e.g. 48:4096,64:8192; both paths timed)")
    ap.add_argument("--contract-probe", action="store_true", help="only the key block / partition probe (dense)")
    ap.add_argument("--gluon", action="store_true", help="only prefill, dense and paged: the Gluon kernels against "
                    "the committed ones (bits, time), SDPA and FA3")
    ap.add_argument("--write-table", metavar="ATTENTION_PY", help="with --tiles: put the faster bit-equal tiles "
                    "into this copy of kernels/triton/attention.py")
    args = ap.parse_args()
    t0 = time.time()
    torch.manual_seed(0)
    if not _FA:
        print(f"vLLM FA3 not importable ({_FA_ERR}); FA3 columns are NaN")
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e9:.0f} GB/s  "
          f"(PART_KEYS={tattn.PART_KEYS}, page {PAGE})", flush=True)
    rows = []
    if args.contract_probe:
        contract_probe(bw, rows)
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_GBps": bw / 1e9, "fa3": _FA, "rows": rows,
                       "wall_s": time.time() - t0}, f, indent=1, default=float)
        print(f"wrote {args.out}  ({time.time() - t0:.0f} s)")
        return
    if args.gluon:
        for t in ((4096,) if args.quick else (4096, 16384)):
            for hkv, d in ((8, 128), (32, 128), (8, 64)):
                gluon_prefill_case(t, hkv, d, rows)
                torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "fa3": _FA, "rows": rows, "wall_s": time.time() - t0},
                      f, indent=1, default=float)
        print(f"wrote {args.out}  ({time.time() - t0:.0f} s)")
        return
    if args.tiles:
        tile_sweep(bw, rows, args.decode_only)
        chosen = best_tiles(rows)
        res = {"device": torch.cuda.get_device_name(), "fa3": _FA, "attn_tiles": {str(k): v for k, v in
               tattn.ATTN_TILES.items()}, "chosen": {str(k): v for k, v in chosen.items()}, "rows": rows,
               "wall_s": time.time() - t0}
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=float)
        print(f"chosen (>= 2 % faster, bits equal in every case of the class): {chosen or 'none'}")
        print(f"wrote {args.out}  ({res['wall_s']:.0f} s)")
        if args.write_table and chosen:
            write_table(args.write_table, chosen)
        return
    decode_cases = args.decode_cases or ([(b, ctx) for b in ((1, 64) if args.quick else (1, 4, 16, 64))
                                          for ctx in ((4096, 32768) if args.quick else (4096, 8192, 32768))]
                                         + [(8, 16384)])
    for b, ctx in decode_cases:
        decode_case(b, ctx, bw, rows)
        torch.cuda.empty_cache()
    for t in () if args.decode_only else (4096,) if args.quick else (4096, 16384):
        for hkv in (8, 32):
            prefill_case(t, hkv, rows)
            torch.cuda.empty_cache()
    res = {"device": torch.cuda.get_device_name(), "copy_GBps": bw / 1e9, "fa3": _FA, "part_keys": tattn.PART_KEYS,
           "page": PAGE, "rows": rows, "wall_s": time.time() - t0}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=float)
    print(f"wrote {args.out}  ({res['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()

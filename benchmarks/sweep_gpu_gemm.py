"""One-shot H200 sweep for issue #15 (items 2 and 4): GEMM tiles by M class with numerics fixed per (N, K), and
FP8 block-GEMM tiles.  Every candidate is checked for bit-identity *in the same run* as it is timed; only
bit-identical candidates are eligible for the recommendation.

    python benchmarks/sweep_gpu_gemm.py --out $OUT/sweep_gemm.json [--budget 300] [--no-fp8] [--quick]

bf16 part, for each shape (N, K) and each *numerics group* (BLOCK_K, SPLIT_STEPS) — the only things that enter an
element's arithmetic:

* bits: a reference tile (128x128, the group's numerics) computes 2048 rows in float32; every candidate tile of the
  group computes the first ``m`` rows for m in 1, 7, 16, 64, 300, 2048 and row 1000 alone; a candidate is
  ``bit_identical`` when all of them equal the reference rows (``torch.equal`` on the int32 view).  So a row's bits
  do not depend on M nor on which candidate (M class) computed it;
* time: cuBLAS (``torch.nn.functional.linear``) and each candidate at the M of its class (1 .. 4096), CUDA-graph
  replay, weights cycled through enough copies (>= 256 MB) that they do not stay in L2;
* recommendation: per group, the fastest bit-identical candidate at each M; per shape, the group that meets the
  most issue targets (>= 1.0x at M=1, >= 0.90x at 16..256, >= 0.95x at >= 1024), then the best geometric mean.
  Written as ``gemm_tables.py`` (``--tables-out``, default next to ``--out``): copy it over
  ``megatron_consistent/kernels/triton/gemm_tables.py`` to adopt it, then run tests/test_gpu_kernels.py
  (which re-checks every table entry across M classes bitwise).

Row-parallel trees (``"... tree"`` shapes, issue #18): the same, with the whole 8-segment tree of
``segment_tree.segment_tree_gemm`` as the timed and checked call (no split inside a segment), against cuBLAS over the
whole K; the entry is keyed by the segment's (N, K / 8), the key the tree's ``segment_config`` looks up.  Entries
of the installed table for shapes not swept are carried over into the written file.

FP8 part (``fp8_gemm`` on pre-quantized operands vs cuBLAS block-scaled ``torch._scaled_mm``): tile candidates
(with and without one weight scale per tile, ``SWS``), each checked bitwise against the current table's tile at
1, 7, 300, 2048 rows, timed at M = 256, 1024, 4096; the fastest bit-identical tile per (N, K) goes to
``FP8_TILE_OVERRIDES``.  ``--gluon`` adds the Gluon kernel (``kernels/triton/gluon_fp8_gemm.py``, every schedule) to the FP8 part, checked and
timed the same way (never recommended for the table: it is another kernel, not a tile).

Triton compiles all candidates first in parallel worker processes (same on-disk cache), so the timed process only
loads binaries.  ``--budget`` (seconds, whole script) stops timing new candidates when spent; what was skipped is
listed in the JSON.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime as _dt
import json
import math
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

NOSPLIT = 1 << 20
SHAPES = {"4096x4096": (4096, 4096), "qkv 4096->6144": (6144, 4096), "gate/up 4096->28672": (28672, 4096),
          "down 14336->4096": (4096, 14336),
          # the row-parallel K-segment tree (issue #18) of o_proj / down, 8 segments: swept as the whole tree, its
          # entry keyed by the segment's (N, K / 8), which is what segment_tree.segment_config looks up
          "8B o_proj tree": (4096, 4096, 8), "8B down tree": (4096, 14336, 8),
          "1B o_proj tree": (2048, 2048, 8), "1B down tree": (2048, 8192, 8),
          # Qwen3-30B-A3B's dense GEMMs (rollout shape d): qkv, the o_proj tree, the router (float32 logits; at M = 1
          # its one 128-wide tile streams the whole weight through one SM); swept in session 21 (H200)
          "A3B qkv 2048->5120": (5120, 2048), "A3B o_proj tree": (2048, 4096, 8), "A3B router 2048->128": (128, 2048),
          # a model's smaller tree widths (consistent_row_parallel_segments 2 / 4): swept in session 40 (H100; S = 2
          # at M = 256 0.72 -> 1.04 of the pre-tree GEMM); the 1B down at S = 2 (segment 2048 x 4096) not yet: 0.46-0.64
          # of cuBLAS in session 40
          "8B o_proj tree S2": (4096, 4096, 2), "8B o_proj tree S4": (4096, 4096, 4),
          "8B down tree S2": (4096, 14336, 2), "8B down tree S4": (4096, 14336, 4), "1B down tree S2": (2048, 8192, 2),
          "1B o_proj tree S2": (2048, 2048, 2),
          # the 1B Llama's own GEMMs (rollout shape a; o_proj / down at S = 1 run the plain GEMM): swept in session 40
          # (H100; o_proj 2048 x 2048 0.74-1.06 of cuBLAS, down 0.69-1.04, qkv 0.81-1.05, gate/up 0.94-1.03)
          "1B qkv 2048->3072": (3072, 2048), "1B gate/up 2048->16384": (16384, 2048),
          "1B o_proj 2048x2048": (2048, 2048), "1B down 8192->2048": (2048, 8192)}
MS = [1, 16, 64, 256, 1024, 4096]
BITS_MS = [1, 7, 16, 64, 300, 2048]
SMALL, MID, LARGE = (1, 16, 64), (64, 256, 1024), (256, 1024, 4096)
FP8_MS = [256, 1024, 4096]
ODD_SHAPES = [(1000, 300), (256, 1024), (2050, 4096)]  # bits only (no timing): does a candidate tile keep the bits?
DEV = "cuda"  # "cpu" with --cpu-smoke (TRITON_INTERPRET=1: plumbing only, no meaningful bits or times)
FP8_BITS_MS = [1, 7, 300, 2048]
BITS_ROWS = 2048


def target(m: int) -> float:
    return 1.0 if m == 1 else (0.90 if m <= 256 else 0.95)


# ---------------------------------------------------------------------------------------------- candidates
def shape_dims(dims):
    """(N, K, segments): K is the whole reduction; segments 1 = the plain GEMM."""
    return (*dims, 1) if len(dims) == 2 else tuple(dims)


def numerics_groups(n: int, k: int, quick: bool = False, segments: int = 1):
    """(name, BK, SPLIT_STEPS): no split; a fixed 2-way split where N alone gives few tiles; also 4-way for long K.
    A segment tree: no split (its 8 segments already give the parallelism a split would)."""
    steps = k // 64
    groups = [("bk64 nosplit", 64, NOSPLIT)]
    if n <= 8192 and segments == 1:
        groups.append(("bk64 split2", 64, max(1, steps // 2)))
        if k >= 8192 and not quick:
            groups.append(("bk64 split4", 64, max(1, steps // 4)))
    return groups


TREE_SCHEDULE_KEYS = ("TREE_PATH", "TREE_REG", "TREE_LANES", "TREE_PROGS")  # segment_tree.plan reads them from a table class


def tile_candidates(splits: int, quick: bool = False, tree: bool = False):
    """(name, tile dict, Ms to time).  The first one is the group's bit reference.  A tree also tries schedules
    (``TREE_*``: path, segments per register group, chains per K loop), which no more change its bits than a tile."""
    split = splits > 1
    par = {"PATH": "parallel"} if split else {}
    c = [("128x128 w8 s4", {"BM": 128, "BN": 128, "W": 8, "S": 4}, MID + LARGE[1:]),
         ("128x256 w8 s3" + (" spill" if split else ""), {"BM": 128, "BN": 256, "W": 8, "S": 3, "SPILL": split}, LARGE),
         ("64x128 w4 s6", {"BM": 64, "BN": 128, "W": 4, "S": 6}, MID),
         ("64x64 w4 s8", {"BM": 64, "BN": 64, "W": 4, "S": 8}, (16, 64, 256)),
         ("swap 16x64 w4 s8", {"BM": 16, "BN": 64, "W": 4, "S": 8, "SWAP": True, **par}, SMALL),
         ("swap 16x128 w4 s6", {"BM": 16, "BN": 128, "W": 4, "S": 6, "SWAP": True, **par}, SMALL),
         ("swap 32x128 w4 s6", {"BM": 32, "BN": 128, "W": 4, "S": 6, "SWAP": True, **par}, (16, 64)),
         ("swap 64x128 w4 s4", {"BM": 64, "BN": 128, "W": 4, "S": 4, "SWAP": True}, (64, 256)),
         # BN < 64 / BM = 16 without swap: mma.sync instead of wgmma -- the bits check says whether that is allowed
         ("swap 16x32 w4 s8 (mma.sync)", {"BM": 16, "BN": 32, "W": 4, "S": 8, "SWAP": True, **par}, SMALL),
         ("16x128 w4 s6 (mma.sync)", {"BM": 16, "BN": 128, "W": 4, "S": 6}, (1, 16))]
    if quick:
        c = c[:1] + [x for x in c if x[0].startswith(("128x256", "swap 16x64", "swap 64x128", "swap 16x32"))]
    if tree:
        big, mid = {"BM": 128, "BN": 128, "W": 8, "S": 4}, {"BM": 64, "BN": 128, "W": 4, "S": 6}
        for tname, tile, ms in (("128x128 w8 s4", big, MID + LARGE[1:]), ("64x128 w4 s6", mid, MID)):
            c += [(f"{tname} serial r4", {**tile, "TREE_PATH": "serial", "TREE_REG": 4, "TREE_LANES": 2}, ms),
                  (f"{tname} parallel r4", {**tile, "TREE_PATH": "parallel", "TREE_REG": 4}, ms),
                  (f"{tname} parallel r2", {**tile, "TREE_PATH": "parallel", "TREE_REG": 2}, ms),
                  (f"{tname} serial lanes1", {**tile, "TREE_PATH": "serial", "TREE_LANES": 1}, ms)]
        # two programs per SM (tiles that leave half the registers and shared memory free; offline sm_90a compile:
        # 243-249 registers, 98 KB, no spills): one program's slot traffic overlaps the other's MMAs
        two = {"BM": 64, "BN": 128, "W": 4, "TREE_PROGS": 2}
        c += [("64x128 w4 s2 serial r4 p2", {**two, "S": 2, "TREE_PATH": "serial", "TREE_REG": 4, "TREE_LANES": 2},
               MID + LARGE[1:]),
              ("64x128 w4 s2 serial r2 p2", {**two, "S": 2, "TREE_PATH": "serial", "TREE_REG": 2, "TREE_LANES": 2},
               MID + LARGE[1:]),
              ("64x128 w4 s4 parallel r4 p2", {**two, "S": 4, "TREE_PATH": "parallel", "TREE_REG": 4},
               MID + LARGE[1:])]
        # four chains per K loop (a quad fills the pipeline once; with r8 the whole tree stays in registers, no
        # slot): half-size tiles on 8 warps (offline sm_90a compile: 166-191 registers, 197 KB, no spills)
        wide, tall = {"BM": 64, "BN": 128, "W": 8, "S": 2}, {"BM": 128, "BN": 64, "W": 8, "S": 2}
        for tname, tile, path, reg in (("64x128 w8 s2", wide, "serial", 4), ("64x128 w8 s2", wide, "serial", 8),
                                       ("128x64 w8 s2", tall, "serial", 4), ("128x64 w8 s2", tall, "serial", 8),
                                       ("64x128 w8 s2", wide, "parallel", 4)):
            c.append((f"{tname} {path} r{reg} lanes4", {**tile, "TREE_PATH": path, "TREE_REG": reg, "TREE_LANES": 4},
                      MID + LARGE[1:]))
    return c


def make_cfg(bk: int, sps: int, tile: dict) -> dict:
    from megatron_consistent.kernels.triton import linear as tlin

    cfg = tlin._cfg(tile["BM"], tile["BN"], bk, sps, tile["W"], tile["S"], tile.get("G", 8),
                    swap=tile.get("SWAP", False), spill=tile.get("SPILL", False), path=tile.get("PATH", ""))
    return cfg | {key: tile[key] for key in TREE_SCHEDULE_KEYS if key in tile}


FP8_CANDS = [  # (name, (BM, BN, warps, stages, progs/SM, SWS[, FLAT]))
    ("128x64 w4 s4 p3", (128, 64, 4, 4, 3, False)),
    ("128x64 w4 s4 p3 sws", (128, 64, 4, 4, 3, True)),
    ("128x64 w4 s3 p3 sws", (128, 64, 4, 3, 3, True)),
    ("64x128 w4 s4 p2 sws", (64, 128, 4, 4, 2, True)),
    ("128x128 w8 s4 p1 sws", (128, 128, 8, 4, 1, True)),
    ("128x128 w8 s3 p2 sws", (128, 128, 8, 3, 2, True)),
    ("256x64 w8 s3 p1 sws", (256, 64, 8, 3, 1, True)),
    ("64x64 w4 s6 p4 sws", (64, 64, 4, 6, 4, True)),
    # the splits of a tile walked by one pipelined loop (fp8_linear._serial_fp8_splits, FLAT)
    ("64x128 w4 s4 p2 sws flat", (64, 128, 4, 4, 2, True, True)),
    ("128x64 w4 s4 p3 sws flat", (128, 64, 4, 4, 3, True, True)),
    ("128x128 w8 s4 p1 sws flat", (128, 128, 8, 4, 1, True, True)),
    ("128x128 w8 s3 p2 sws flat", (128, 128, 8, 3, 2, True, True)),
]


def fp8_cfg(t):
    from megatron_consistent.kernels.triton import fp8_linear as tf8

    return tf8._fp8_cfg(*t)


def matmul(x, w, bias, out_dtype, cfg, segments: int = 1):
    """The kernel a shape is swept for: the GEMM (``segments`` 1) or the row-parallel segment tree."""
    from megatron_consistent.kernels.triton import linear as tlin
    from megatron_consistent.kernels.triton import segment_tree as ttree

    if segments == 1:
        return tlin.gemm(x, w, bias, out_dtype, cfg=cfg)
    return ttree.segment_tree_gemm(x, w, segments, bias, out_dtype, cfg=cfg)


# ---------------------------------------------------------------------------------------------- compile workers
def _warm(jobs):
    """Compile (and run once) each job's kernels in this worker: fills the shared Triton cache."""
    import torch

    from megatron_consistent.kernels.triton import fp8_linear as tf8

    dev = torch.device("cuda")
    errors = []
    cache = {}
    for kind, n, k, cfg, segments in jobs:
        try:
            if kind in ("bf16", "bf16b"):  # bf16b: the odd shapes, with bias, fp32 out
                key = ("bf16", n, k)
                if key not in cache:
                    cache.clear()
                    cache[key] = (torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02,
                                  torch.randn(4096, k, device=dev, dtype=torch.bfloat16),
                                  torch.randn(n, device=dev, dtype=torch.bfloat16))
                w, x, b = cache[key]
                for m in (1, 4096):
                    for od in ((torch.float32,) if kind == "bf16b" else (torch.bfloat16, torch.float32)):
                        matmul(x[:m], w, b if kind == "bf16b" else None, od, cfg, segments)
            else:
                key = ("fp8", n, k)
                if key not in cache:
                    cache.clear()
                    from megatron_consistent.kernels import fp8

                    wq, s = fp8.quantize(torch.randn(n, k, device=dev) * 0.02, fp8.E4M3_WEIGHT_128)
                    xq, xs = tf8.quantize_activations(torch.randn(4096, k, device=dev, dtype=torch.bfloat16))
                    cache[key] = (wq, fp8.weight_row_scales(s, n).contiguous(), xq, xs)
                wq, rows, xq, xs = cache[key]
                for m in (1, 4096):
                    for od in (torch.bfloat16, torch.float32):
                        tf8.fp8_gemm(xq[:m], xs[:m], wq, rows, None, od, cfg=cfg, w_block_rows=128)
        except Exception as e:  # noqa: BLE001
            errors.append(f"{kind} {n}x{k} {cfg}: {type(e).__name__}: {str(e)[:200]}")
    torch.cuda.synchronize()
    return errors


def precompile(jobs, workers):
    t0 = time.time()
    chunks = [jobs[i::workers] for i in range(workers)]
    errors = []
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as ex:
        for errs in ex.map(_warm, [c for c in chunks if c]):
            errors += errs
    print(f"precompiled {len(jobs)} configs in {time.time() - t0:.0f} s with {workers} workers; "
          f"{len(errors)} errors", flush=True)
    for e in errors[:20]:
        print("  compile error:", e, flush=True)
    return errors


# ---------------------------------------------------------------------------------------------- timing / bits
def bench(fn, rep):
    import triton.testing

    if DEV == "cpu":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def n_copies(nbytes):
    return max(1, min(8, math.ceil(256e6 / nbytes)))


def bits_int(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def rows_equal(a, b):
    return a.shape == b.shape and torch.equal(bits_int(a), bits_int(b))


def check_rows(run, ref, ms):
    """``run(row_slice) -> y`` of those rows: the first m rows for every m in ``ms``, and row 1000 alone, equal
    ``ref``'s rows bitwise.  Returns the failing cases."""
    bad = []
    for m in ms:
        if not rows_equal(run(slice(0, m)), ref[:m]):
            bad.append(m)
    if ref.shape[0] > 1000 and not rows_equal(run(slice(1000, 1001)), ref[1000:1001]):
        bad.append("row1000")
    return bad


def sweep_bf16(args, deadline, log):
    dev = torch.device(DEV)
    results = []
    for sname, dims in SHAPES.items():
        n, k, seg = shape_dims(dims)
        torch.manual_seed(0)
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(n_copies(n * k * 2))]
        xb = torch.randn(BITS_ROWS, k, device=dev, dtype=torch.bfloat16)
        xs = {m: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for m in MS}
        # K: the table key's (the segment's, for a tree); the reduction of the timed call is k
        shape_res = {"shape": sname, "N": n, "K": k // seg, "segments": seg, "cublas_ms": {}, "default_ms": {},
                     "groups": []}
        for m in MS:
            x = xs[m]
            shape_res["cublas_ms"][m] = bench(lambda x=x: [torch.nn.functional.linear(x, w) for w in ws], args.rep) / len(ws)
            shape_res["default_ms"][m] = bench(lambda x=x: [matmul(x, w, None, torch.bfloat16, None, seg) for w in ws],
                                               args.rep) / len(ws)
            log(f"{sname:22s} M={m:5d} cuBLAS {shape_res['cublas_ms'][m] * 1e3:8.1f} us   default table "
                f"{shape_res['default_ms'][m] * 1e3:8.1f} us  ratio {shape_res['cublas_ms'][m] / shape_res['default_ms'][m]:.3f}")
        for gname, bk, sps in numerics_groups(n, k, args.quick, seg):
            splits = 1 if sps >= NOSPLIT else math.ceil(k // bk / sps)
            cands = tile_candidates(splits, args.quick, tree=seg > 1)
            ref_cfg = make_cfg(bk, sps, cands[0][1])
            ref = matmul(xb, ws[0], None, torch.float32, ref_cfg, seg)
            refb = matmul(xb, ws[0], None, torch.bfloat16, ref_cfg, seg)
            group = {"group": gname, "BK": bk, "SPLIT_STEPS": sps, "splits": splits, "reference": cands[0][0],
                     "candidates": []}
            for cname, tile, cms in cands:
                cfg = make_cfg(bk, sps, tile)
                rec = {"name": cname, "tile": tile, "cfg": cfg, "ms": {}}
                try:
                    rec["bits_bad_ms"] = check_rows(lambda sl: matmul(xb[sl], ws[0], None, torch.float32, cfg, seg),
                                                    ref, BITS_MS)
                    # bf16 output too (what the model sees), with the bf16 reference of the same numerics
                    rec["bits_bad_ms_bf16"] = check_rows(
                        lambda sl: matmul(xb[sl], ws[0], None, torch.bfloat16, cfg, seg), refb, (1, 16, 300))
                    rec["bit_identical"] = not rec["bits_bad_ms"] and not rec["bits_bad_ms_bf16"]
                except Exception as e:  # noqa: BLE001
                    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    rec["bit_identical"] = False
                    group["candidates"].append(rec)
                    log(f"  {gname:14s} {cname:30s} ERROR {rec['error'][:120]}")
                    continue
                for m in cms:
                    if time.time() > deadline:
                        rec.setdefault("skipped_ms", []).append(m)
                        continue
                    x = xs[m]
                    rec["ms"][m] = bench(lambda x=x, cfg=cfg: [matmul(x, w, None, torch.bfloat16, cfg, seg)
                                                               for w in ws], args.rep) / len(ws)
                ratios = {m: shape_res["cublas_ms"][m] / t for m, t in rec["ms"].items()}
                rec["ratio"] = ratios
                log(f"  {gname:14s} {cname:30s} bits {'SAME' if rec['bit_identical'] else 'DIFF ' + str(rec['bits_bad_ms'])}"
                    "  " + "  ".join(f"M={m}: {r:.3f}" for m, r in ratios.items()))
                group["candidates"].append(rec)
            shape_res["groups"].append(group)
        results.append(shape_res)
        ws = xs = None
        torch.cuda.empty_cache()
    return results


def odd_shape_bits(args, log):
    """Bits only, no split: every candidate tile vs the 128x128 reference on odd (N, K) (masks, partial tiles)."""
    from megatron_consistent.kernels.triton import linear as tlin

    dev = torch.device(DEV)
    res = []
    for n, k in ODD_SHAPES:
        torch.manual_seed(1)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.05
        b = torch.randn(n, device=dev, dtype=torch.bfloat16)
        xb = torch.randn(BITS_ROWS, k, device=dev, dtype=torch.bfloat16)
        cands = tile_candidates(1, args.quick)
        ref = tlin.gemm(xb, w, b, torch.float32, cfg=make_cfg(64, NOSPLIT, cands[0][1]))
        for cname, tile, _ in cands:
            cfg = make_cfg(64, NOSPLIT, tile)
            try:
                bad = check_rows(lambda sl: tlin.gemm(xb[sl], w, b, torch.float32, cfg=cfg), ref, BITS_MS)
                res.append({"N": n, "K": k, "name": cname, "bits_bad_ms": bad, "bit_identical": not bad})
            except Exception as e:  # noqa: BLE001
                res.append({"N": n, "K": k, "name": cname, "error": f"{type(e).__name__}: {str(e)[:200]}",
                            "bit_identical": False})
            bits = "SAME" if res[-1]["bit_identical"] else "DIFF " + str(res[-1].get("bits_bad_ms", res[-1].get("error")))
            log(f"  odd {n}x{k} {cname:30s} bits {bits}")
    return res


def recommend_bf16(results):
    """Per shape: the best numerics group and its per-M-class tiles (bit-identical candidates only)."""
    recs = {}
    for sr in results:
        best = None
        for g in sr["groups"]:
            per_m = {}
            for m in MS:
                opts = [(c["ms"][m], c) for c in g["candidates"] if c.get("bit_identical") and m in c["ms"]]
                if opts:
                    t, c = min(opts, key=lambda o: o[0])
                    per_m[m] = (sr["cublas_ms"][m] / t, c)
            if len(per_m) < len(MS):
                continue
            met = sum(r >= target(m) for m, (r, _) in per_m.items())
            gm = math.exp(sum(math.log(r) for r, _ in per_m.values()) / len(per_m))
            score = (met, gm)
            if best is None or score > best[0]:
                best = (score, g, per_m)
        if best is None:
            continue
        (met, gm), g, per_m = best
        classes = []
        for i, m in enumerate(MS):
            tile = per_m[m][1]["tile"]
            tile = {kk: v for kk, v in tile.items() if v not in (False, "")}
            max_m = None if i == len(MS) - 1 else m
            if classes and classes[-1][1] == tile:
                classes[-1] = (max_m, tile)
            else:
                classes.append((max_m, tile))
        recs[(sr["N"], sr["K"])] = {"group": g["group"], "BK": g["BK"], "SPLIT_STEPS": g["SPLIT_STEPS"],
                                    "classes": classes, "targets_met": met, "geomean_ratio": gm,
                                    "ratio_by_m": {m: r for m, (r, _) in per_m.items()},
                                    "config_by_m": {m: c["name"] for m, (_, c) in per_m.items()},
                                    "default_ratio_by_m": {m: sr["cublas_ms"][m] / sr["default_ms"][m] for m in MS}}
    return recs


# ---------------------------------------------------------------------------------------------- fp8
def sweep_fp8(args, deadline, log):
    from bench_gpu_fp8 import _scaled_mm_block

    from megatron_consistent.kernels import fp8
    from megatron_consistent.kernels.triton import fp8_linear as tf8

    dev = torch.device(DEV)
    results = []
    for sname, dims in SHAPES.items():
        n, k, seg = shape_dims(dims)
        if seg > 1:
            continue  # FP8 has no segment tree
        torch.manual_seed(0)
        wf = []
        for _ in range(n_copies(n * k)):
            q, s = fp8.quantize(torch.randn(n, k, device=dev) * 0.02, fp8.E4M3_WEIGHT_128)
            wf.append((q, fp8.weight_row_scales(s, n).contiguous(), s))
        xb = torch.randn(BITS_ROWS, k, device=dev, dtype=torch.bfloat16)
        xqb, xsb = tf8.quantize_activations(xb)
        wq0, rows0, _ = wf[0]
        ref = tf8.fp8_gemm(xqb, xsb, wq0, rows0, None, torch.float32)  # today's table tile
        sr = {"shape": sname, "N": n, "K": k, "current_tile": tf8.fp8_config(n, k), "scaled_mm_ms": {}, "candidates": []}
        xq, xsc = {}, {}
        for m in FP8_MS:
            xq[m], xsc[m] = tf8.quantize_activations(torch.randn(m, k, device=dev, dtype=torch.bfloat16))
            try:
                fns = [_scaled_mm_block(xq[m], xsc[m], q, blk)[0] for q, _, blk in wf]
                sr["scaled_mm_ms"][m] = bench(lambda fns=fns: [f() for f in fns], args.rep) / len(wf)
            except Exception as e:  # noqa: BLE001
                sr["scaled_mm_ms"][m] = None
                sr["scaled_mm_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        runners = [(cname, fp8_cfg(t), lambda xq_, xs_, q, r, dt, cfg=fp8_cfg(t): tf8.fp8_gemm(
            xq_, xs_, q, r, None, dt, cfg=cfg, w_block_rows=128)) for cname, t in FP8_CANDS]
        if args.gluon:  # a candidate kernel, not a table entry (cfg None: never recommended)
            from megatron_consistent.kernels.triton.gluon_fp8_gemm import gluon_fp8_gemm

            split = tf8.fp8_config(n, k)["SPLIT_GROUPS"]
            for cname, block_rows, schedule in (("gluon ws", 128, "ws"), ("gluon ws column scales", 0, "ws"),
                                                ("gluon ws grouped", 128, "ws grouped"),
                                                ("gluon ws regs", 128, "ws regs"),
                                                ("gluon ws smem sums", 128, "ws smem sums")):
                runners.append((cname, None, lambda xq_, xs_, q, r, dt, br=block_rows, sch=schedule: gluon_fp8_gemm(
                    xq_, xs_, q, r, None, dt, split, w_block_rows=br, schedule=sch)))
        for cname, cfg, run in runners:
            rec = {"name": cname, "cfg": cfg, "ms": {}}
            try:
                rec["bits_bad_ms"] = check_rows(lambda sl: run(xqb[sl], xsb[sl], wq0, rows0, torch.float32), ref,
                                                FP8_BITS_MS)
                rec["bit_identical"] = not rec["bits_bad_ms"]
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rec["bit_identical"] = False
                sr["candidates"].append(rec)
                log(f"  fp8 {sname:22s} {cname:24s} ERROR {rec['error'][:120]}")
                continue
            for m in FP8_MS:
                if time.time() > deadline:
                    rec.setdefault("skipped_ms", []).append(m)
                    continue
                rec["ms"][m] = bench(lambda m=m, run=run: [run(xq[m], xsc[m], q, r, torch.bfloat16) for q, r, _ in wf],
                                     args.rep) / len(wf)
            rec["ratio"] = {m: (sr["scaled_mm_ms"][m] / v if sr["scaled_mm_ms"].get(m) else None)
                            for m, v in rec["ms"].items()}
            log(f"  fp8 {sname:22s} {cname:24s} bits {'SAME' if rec['bit_identical'] else 'DIFF ' + str(rec['bits_bad_ms'])}  "
                + "  ".join(f"M={m}: {r:.3f}" if r else f"M={m}: -" for m, r in rec["ratio"].items()))
            sr["candidates"].append(rec)
        results.append(sr)
        wf = None
        torch.cuda.empty_cache()
    return results


def recommend_fp8(results):
    recs = {}
    for sr in results:
        opts = [c for c in sr["candidates"] if c.get("bit_identical") and 4096 in c["ms"] and c["cfg"] is not None]
        if not opts:
            continue
        best = min(opts, key=lambda c: c["ms"][4096])
        recs[(sr["N"], sr["K"])] = {"name": best["name"], "cfg": best["cfg"], "ratio": best["ratio"]}
    return recs


# ---------------------------------------------------------------------------------------------- output
def installed_comments(path: Path) -> dict[str, str]:
    """The measurement comment above each entry of a ``gemm_tables.py``, by the entry's key source."""
    import re

    src = path.read_text()
    return {m.group(2): m.group(1).removeprefix("kept: ")
            for m in re.finditer(r"^    # (.*)\n    (\([^)]*\)): ", src, flags=re.M)}


def _classes_source(classes) -> str:
    return ",\n                    ".join(f"({mm!r}, {t!r})" for mm, t in classes)


def tables_source(bf16_recs, fp8_recs, meta, kept_bf16=None, kept_fp8=None, comments=None):
    """``gemm_tables.py``: this run's recommendations, then the installed entries of shapes it did not sweep
    (with ``comments``: the comment of the run that measured them, by key source)."""
    comments = comments or {}
    lines = ['"""M-class GEMM table (issue #15), written by benchmarks/sweep_gpu_gemm.py on ' + meta + '.',
             "",
             "Only configs that were bit-identical row for row (M = 1 .. 2048, float32 and bf16 out) to the other tiles",
             "of the same numerics (BK, SPLIT_STEPS) in that run.  See linear.m_class_config / fp8_linear.FP8_TILE_TABLE.",
             "Entries marked 'kept' were not swept in this run and come from the table it replaced.",
             '"""', "", "import torch", "", "GEMM_M_CLASS_TABLE: dict = {"]

    def bf16_entry(key_src, bk, split_steps, classes):
        lines.append(f"    {key_src}: {{\"BK\": {bk}, \"SPLIT_STEPS\": {split_steps}, "
                     f"\"classes\": [\n                    {_classes_source(classes)}]}},")

    for (n, k), r in bf16_recs.items():
        lines.append(f"    # {r['group']}: ratio vs cuBLAS by M " +
                     ", ".join(f"{m}: {v:.2f}" for m, v in r["ratio_by_m"].items()) +
                     f" (targets met {r['targets_met']}/{len(MS)})")
        bf16_entry(f"({n}, {k}, torch.bfloat16)", r["BK"], r["SPLIT_STEPS"], r["classes"])
    for key, entry in (kept_bf16 or {}).items():
        key_src = f"({key[0]}, {key[1]}, torch.{str(key[2]).replace('torch.', '')})"
        lines.append(f"    # kept: {comments.get(key_src, 'not swept in this run')}")
        bf16_entry(key_src, entry["BK"], entry["SPLIT_STEPS"], entry["classes"])
    lines += ["}", "", "FP8_TILE_OVERRIDES: dict = {"]
    for (n, k), r in fp8_recs.items():
        lines.append(f"    # {r['name']}: ratio vs _scaled_mm by M " +
                     ", ".join(f"{m}: {v:.2f}" for m, v in r["ratio"].items() if v))
        lines.append(f"    ({n}, {k}): {r['cfg']!r},")
    for key, cfg in (kept_fp8 or {}).items():
        lines.append(f"    # kept: {comments.get(repr(key), 'not swept in this run')}")
        lines.append(f"    {key!r}: {cfg!r},")
    lines += ["}", ""]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="JSON path")
    ap.add_argument("--tables-out", default=None, help="gemm_tables.py path (default: next to --out)")
    ap.add_argument("--budget", type=float, default=290.0, help="seconds for the whole script (timing stops after)")
    ap.add_argument("--rep", type=int, default=10, help="ms of CUDA-graph replay per measurement")
    ap.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--no-fp8", action="store_true")
    ap.add_argument("--only-fp8", action="store_true", help="the FP8 part alone (no bf16 tiles, no trees)")
    ap.add_argument("--no-odd", action="store_true", help="skip the bits-only odd-shape check")
    ap.add_argument("--gluon", action="store_true",
                    help="FP8 part: also the Gluon kernel (kernels/triton/gluon_fp8_gemm.py): bits vs the table tile, time")
    ap.add_argument("--quick", action="store_true", help="fewer groups / candidates")
    ap.add_argument("--shapes", default="", help="comma-separated subset of shape names (default all)")
    ap.add_argument("--cpu-smoke", action="store_true", help="TRITON_INTERPRET=1 plumbing test on tiny CPU shapes")
    args = ap.parse_args()
    global DEV, MS, BITS_MS, SMALL, MID, LARGE, FP8_MS, FP8_BITS_MS, BITS_ROWS
    if args.cpu_smoke:
        DEV = "cpu"
        SHAPES.clear()
        SHAPES["smoke 192x256"] = (192, 256)
        SHAPES["smoke tree 192x512"] = (192, 512, 8)
        ODD_SHAPES[:] = [(100, 80)]
        MS, BITS_MS, FP8_MS, FP8_BITS_MS, BITS_ROWS = [1, 16, 64, 256], [1, 7, 16, 64], [16, 64], [1, 7], 256
        SMALL, MID, LARGE = (1, 16), (16, 64, 256), (64, 256)
    t0 = time.time()
    deadline = t0 + args.budget
    if args.shapes:
        keep = set(args.shapes.split(","))
        for s in list(SHAPES):
            if s not in keep:
                del SHAPES[s]
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    tables_out = args.tables_out or os.path.join(out_dir, "gemm_tables.py")
    log_lines = []

    def log(msg):
        msg = f"[{time.time() - t0:6.1f}s] {msg}"
        print(msg, flush=True)
        log_lines.append(msg)

    import triton

    from megatron_consistent.kernels.triton import linear as tlin

    if tlin.M_CLASS_TABLE:
        log("note: an M-class table is installed; the 'default' column is that table")
    if args.only_fp8:
        args.no_odd = True
    jobs = []
    for dims in SHAPES.values():
        n, k, seg = shape_dims(dims)
        for _, bk, sps in ([] if args.only_fp8 else numerics_groups(n, k, args.quick, seg)):
            splits = 1 if sps >= NOSPLIT else math.ceil(k // bk / sps)
            for _, tile, _ in tile_candidates(splits, args.quick, tree=seg > 1):
                jobs.append(("bf16", n, k, make_cfg(bk, sps, tile), seg))
        if seg == 1 and not args.only_fp8:  # the installed default (M-class table if any, else CONFIG_TABLE); a tree compiles its own
            for m in MS:
                jobs.append(("bf16", n, k, tlin.config_for(n, k, torch.bfloat16, m), 1))
        if not args.no_fp8 and seg == 1:
            for _, t in FP8_CANDS:
                jobs.append(("fp8", n, k, fp8_cfg(t), 1))
    if not args.no_odd:
        for n, k in ODD_SHAPES:
            for _, tile, _ in tile_candidates(1, args.quick):
                jobs.append(("bf16b", n, k, make_cfg(64, NOSPLIT, tile), 1))
    compile_errors = precompile(jobs, args.workers) if DEV == "cuda" else []

    meta = {"gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu-smoke", "date": _dt.date.today().isoformat(), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda, "budget_s": args.budget, "rep_ms": args.rep}
    out = {**meta, "compile_errors": compile_errors}

    def dump():
        out["elapsed_s"] = time.time() - t0
        out["log"] = log_lines
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)

    fp8_share = 0.0 if args.no_fp8 else 1.0 if args.only_fp8 else 0.25  # of the time left after compiling
    bf16_deadline = time.time() + (deadline - time.time()) * (1 - fp8_share)
    out["bf16"] = [] if args.only_fp8 else sweep_bf16(args, bf16_deadline, log)
    if not args.no_odd:
        out["odd_shapes_bits"] = odd_shape_bits(args, log)
        # a tile that changed bits on an odd shape is not trusted on the table shapes either
        distrust = {r["name"] for r in out["odd_shapes_bits"] if not r["bit_identical"]}
        for sr in out["bf16"]:
            for g in sr["groups"]:
                for c in g["candidates"]:
                    if c["name"].replace(" spill", "") in distrust or c["name"] in distrust:
                        c["bit_identical_on_odd_shapes"] = False
                        c["bit_identical"] = False
    bf16_recs = recommend_bf16(out["bf16"])
    out["bf16_recommended"] = {f"{n}x{k}": r for (n, k), r in bf16_recs.items()}
    dump()
    fp8_recs = {}
    if not args.no_fp8:
        out["fp8"] = sweep_fp8(args, deadline, log)
        fp8_recs = recommend_fp8(out["fp8"])
        out["fp8_recommended"] = {f"{n}x{k}": r for (n, k), r in fp8_recs.items()}
    from megatron_consistent.kernels.triton import gemm_tables

    kept_bf16 = {key: e for key, e in tlin.M_CLASS_TABLE.items() if key[2] != torch.bfloat16 or key[:2] not in bf16_recs}
    kept_fp8 = {key: c for key, c in gemm_tables.FP8_TILE_OVERRIDES.items() if key not in fp8_recs}
    src = tables_source(bf16_recs, fp8_recs, f"{meta['gpu']} {meta['date']} (torch {meta['torch']}, triton {meta['triton']})",
                        kept_bf16, kept_fp8, installed_comments(Path(gemm_tables.__file__)))
    with open(tables_out, "w") as f:
        f.write(src)
    dump()

    print("\n==== recommended bf16 M-class entries (ratio vs cuBLAS; default table in brackets) ====")
    for (n, k), r in bf16_recs.items():
        print(f"N={n} K={k} {r['group']}: targets met {r['targets_met']}/{len(MS)}")
        for m in MS:
            print(f"   M={m:5d}  {r['ratio_by_m'][m]:.3f}  [{r['default_ratio_by_m'][m]:.3f}]  {r['config_by_m'][m]}")
    if fp8_recs:
        print("\n==== recommended FP8 tiles (ratio vs _scaled_mm block) ====")
        for (n, k), r in fp8_recs.items():
            print(f"N={n} K={k} {r['name']}: " + "  ".join(f"M={m}: {v:.3f}" for m, v in r["ratio"].items() if v))
    print(f"\nwrote {args.out} and {tables_out} in {time.time() - t0:.0f} s")
    print("\n" + src)


if __name__ == "__main__":
    main()

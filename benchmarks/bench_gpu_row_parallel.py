"""Row-parallel GEMM benchmark (issue #18): the K-segment tree in one launch vs cuBLAS, the pre-tree GEMM and the loop.

    python benchmarks/bench_gpu_row_parallel.py [--out $OUT/row_parallel.json] [--quick] [--no-variants]

For Llama-3-8B o_proj (N x K = 4096 x 4096) and down (4096 x 14336), Llama-3.2-1B o_proj (2048 x 2048) and down
(2048 x 8192), bf16 in / bf16 out, M in {1, 16, 64, 256, 1024, 4096}, all in one run:

* ``cublas``: ``torch.nn.functional.linear`` (no tree; the speed reference);
* ``gemm``: the consistent GEMM before the tree, ``linear.gemm`` over the whole K (its fixed split per (N, K));
* ``naive``: the row-parallel contract as it was: one ``gemm`` per K segment (float32 out), ``torch.stack``, the torch
  ``adjacent_tree_sum``, the rounding;
* ``tree``: ``segment_tree.segment_tree_gemm(x, w, 8, None, bf16)`` -- one launch, the schedule the planner picks;
* ``default``: the registered ``linear_segment_tree`` op's CUDA evaluation -- what the model runs: ``tree``, or on
  Hopper from ``GLUON_TREE_MIN_M`` rows the Gluon tree (on by default since session 31; ``MC_GLUON=0``: ``tree``),
  checked bit for bit against ``tree``; its ratio to ``gemm`` is issue #18's figure (>= 0.97);
* variants (unless ``--no-variants``): the same kernel with each schedule forced (serial, parallel, flat; REG 1 / 2;
  some with another tile shape: BM, BN, warps, stages -- BK and the split stay the segment's),
  to choose the per-M-class default (``TREE_PATH`` / ``TREE_REG`` in a table entry).  Schedules do not change bits.

Timing: CUDA-graph replay (``triton.testing.do_bench_cudagraph``, median), weights cycled through enough copies
(>= 256 MB) that they do not stay in L2, as ``bench_gpu.py``.  Ratios: ``cublas_ms / ms`` and ``gemm_ms / ms``
(> 1: faster).  Every ``tree`` output is also checked bit for bit against ``naive`` (``bits_ok``).  Triton compiles
every kernel first in parallel worker processes (shared on-disk cache), so the timed process only loads binaries.
Runtime on an H200: about 2-3 minutes (``--quick``: two shapes, four M, no variants: well under 90 s).
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

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

SHAPES = {"8B o_proj 4096x4096": (4096, 4096), "8B down 4096x14336": (4096, 14336),
          "1B o_proj 2048x2048": (2048, 2048), "1B down 2048x8192": (2048, 8192)}
MS = [1, 16, 64, 256, 1024, 4096]
QUICK_SHAPES = ["8B o_proj 4096x4096", "8B down 4096x14336"]
QUICK_MS = [1, 64, 1024, 4096]
SEGMENTS = [8]  # the contract's K segments S (--segments: each S in one run; 8 = the default model's)
# forced schedules (path, REG); "parallel" only where the tiles are few enough to matter
# (path, REG[, tile[, lanes]]): a tile overrides the segment config's BM / BN / warps / stages (never BK or the split: the numerics)
VARIANTS = {"serial r1": ("serial", 1), "serial r2": ("serial", 2), "flat r1": ("flat", 1), "flat r2": ("flat", 2),
            "parallel r1": ("parallel", 1), "parallel r2": ("parallel", 2),
            "flat r1 128x256 w8 s2": ("flat", 1, (128, 256, 8, 2)), "flat r1 256x128 w8 s2": ("flat", 1, (256, 128, 8, 2)),
            "flat r2 128x128 w8 s3": ("flat", 2, (128, 128, 8, 3)), "flat r2 128x128 w8 s5": ("flat", 2, (128, 128, 8, 5)),
            "flat r2 64x256 w8 s4": ("flat", 2, (64, 256, 8, 4)), "serial r1 128x256 w8 s2": ("serial", 1, (128, 256, 8, 2)),
            "serial r2 lanes2": ("serial", 2, None, 2), "serial r4 lanes2": ("serial", 4, None, 2),
            "serial r2 lanes2 s3": ("serial", 2, (128, 128, 8, 3), 2), "parallel r2 lanes2": ("parallel", 2, None, 2)}
PARALLEL_MAX_M = 256
GLUON_MIN_M = 256  # the Gluon tree (kernels/triton/gluon_segment_tree.py) is for prefill sizes: 128-row tiles, one program an SM
GLUON_NAMES = ("gluon ws", "gluon ws deep", "gluon ws grouped")  # "gluon <schedule>": gluon_segment_tree.SCHEDULES
DEV = torch.device("cuda")  # "cpu" with --cpu-smoke (TRITON_INTERPRET=1: plumbing only, no meaningful times)


def _variants_for(m, enabled):
    if not enabled:
        return {}
    return {k: v for k, v in VARIANTS.items() if v[0] != "parallel" or m <= PARALLEL_MAX_M}


def _fns(x, w, variants, gluon=False, segments=8):
    """name -> callable(x, w) returning the bf16 output of the ``segments``-segment tree (``gluon``: also the Gluon
    candidates, from GLUON_MIN_M rows)."""
    from megatron_consistent.kernels.numerics import adjacent_tree_sum
    from megatron_consistent.kernels.triton import linear as tlin
    from megatron_consistent.kernels.triton import segment_tree as tst

    fns = {
        "cublas": lambda xx, ww: torch.nn.functional.linear(xx, ww),
        "gemm": lambda xx, ww: tlin.gemm(xx, ww, None, torch.bfloat16),
        "naive": lambda xx, ww: adjacent_tree_sum(tst.linear_segments_naive(xx, ww, segments), dim=0).to(torch.bfloat16),
        "tree": lambda xx, ww: tst.segment_tree_gemm(xx, ww, segments, None, torch.bfloat16),
        "default": lambda xx, ww: tst._linear_segment_tree_cuda(xx, ww, segments, None, torch.bfloat16),
    }
    for name, (path, reg, *extra) in variants.items():
        tile, lanes = (extra + [None, None])[:2]
        cfg = None
        if tile:
            bm, bn, warps, stages = tile
            cfg = {**tst.segment_config(w.shape[0], w.shape[1], segments, w.dtype, x.shape[0]),
                   "BM": bm, "BN": bn, "W": warps, "S": stages}
        fns[name] = (lambda p, r, c, ln: lambda xx, ww: tst.segment_tree_gemm(
            xx, ww, segments, None, torch.bfloat16, cfg=c, path=p, reg_segments=r, lanes=ln))(path, reg, cfg, lanes)
    if gluon and x.shape[0] >= GLUON_MIN_M:
        from megatron_consistent.kernels.triton.gluon_segment_tree import gluon_segment_tree

        for name in GLUON_NAMES:
            fns[name] = (lambda sch: lambda xx, ww: gluon_segment_tree(xx, ww, segments, None, torch.bfloat16, sch))(
                name.split(maxsplit=1)[1])
    return fns


def _warm(job):
    """Compile (and run once) one kernel family ``(n, k, [m...], variants_enabled, name, segments)`` in this worker."""
    n, k, ms, variants, name, segments = job
    dev = DEV
    errors = []
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    x = torch.randn(max(ms), k, device=dev, dtype=torch.bfloat16)
    for m in ms:
        fn = _fns(x[:m], w, _variants_for(m, variants), gluon=name in GLUON_NAMES, segments=segments).get(name)
        if fn is None:
            continue
        try:
            fn(x[:m], w)
        except Exception as e:  # noqa: BLE001
            errors.append(f"{n}x{k} M={m} S={segments} {name}: {type(e).__name__}: {str(e)[:200]}")
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return errors


def precompile(jobs, workers):
    t0 = time.time()
    ctx = mp.get_context("spawn")
    errors = []
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as ex:
        for errs in ex.map(_warm, jobs):
            errors += errs
    print(f"precompiled {len(jobs)} jobs in {time.time() - t0:.0f} s with {workers} workers; {len(errors)} errors",
          flush=True)
    for e in errors[:20]:
        print("  compile error:", e, flush=True)
    return errors


def bench(fn, rep):
    import triton.testing

    if DEV.type == "cpu":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def run(shapes, ms, variants, rep, gluon=False, segments=8):
    from megatron_consistent.kernels.numerics import adjacent_tree_sum
    from megatron_consistent.kernels.triton import segment_tree as tst
    from megatron_consistent.kernels.triton._common import num_sms

    dev = DEV
    sms = num_sms(torch.cuda.current_device()) if dev.type == "cuda" else 4
    rows = []
    for shape in shapes:
        n, k = SHAPES[shape]
        copies = max(1, min(8, math.ceil(256e6 / (n * k * 2))))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        xs = torch.randn(max(ms), k, device=dev, dtype=torch.bfloat16)
        for m in ms:
            x = xs[:m]
            fns = _fns(x, ws[0], _variants_for(m, variants), gluon, segments)
            times = {}
            for name, fn in list(fns.items()):
                try:
                    times[name] = bench(lambda f=fn: [f(x, w) for w in ws], rep) / len(ws)
                except Exception as e:  # noqa: BLE001 -- a forced variant that does not fit this GPU (resources)
                    if name not in VARIANTS and name not in GLUON_NAMES:
                        raise
                    print(f"  {shape} M={m} {name}: skipped ({type(e).__name__}: {str(e)[:120]})", flush=True)
                    del fns[name]
            tree = fns["tree"](x, ws[0])
            # the contract in float32 (one launch = loop + adjacent_tree_sum), then the bf16 outputs (the interpreter of
            # --cpu-smoke truncates to bf16 where torch rounds: bf16 compared on the GPU only)
            naive32 = adjacent_tree_sum(tst.linear_segments_naive(x, ws[0], segments), dim=0)
            bits_ok = torch.equal(tst.segment_tree_gemm(x, ws[0], segments).view(torch.int32), naive32.view(torch.int32))
            if DEV.type == "cuda":
                bits_ok = bits_ok and torch.equal(tree.view(torch.int16), fns["naive"](x, ws[0]).view(torch.int16))
            for name in fns:
                if name in VARIANTS or name == "default":
                    bits_ok = bits_ok and torch.equal(fns[name](x, ws[0]).view(torch.int16), tree.view(torch.int16))
            gluon_bits = {}
            for name in (n for n in GLUON_NAMES if n in fns):  # TP = 1 (bf16) and a TP = 2 rank's float32 subtree
                from megatron_consistent.kernels.triton.gluon_segment_tree import gluon_segment_tree

                xh, wh = x[:, : k // 2].contiguous(), ws[0][:, : k // 2].contiguous()
                gluon_bits[name] = (torch.equal(fns[name](x, ws[0]).view(torch.int16), tree.view(torch.int16))
                                    and (segments < 2 or torch.equal(
                                        gluon_segment_tree(xh, wh, segments // 2, None, torch.float32, name.split(maxsplit=1)[1]),
                                        tst.segment_tree_gemm(xh, wh, segments // 2, None, torch.float32))))
            p = tst.plan(m, n, k, segments, torch.bfloat16, sms=sms)
            flops = 2.0 * m * n * k
            best = min((t, nm) for nm, t in times.items() if nm == "tree" or nm in VARIANTS)
            r = {"shape": shape, "segments": segments, "M": m, "N": n, "K": k, "ms": times,
                 "tflops": {nm: flops / t * 1e-9 for nm, t in times.items()},
                 "tree_vs_cublas": times["cublas"] / times["tree"], "tree_vs_gemm": times["gemm"] / times["tree"],
                 "default_vs_cublas": times["cublas"] / times["default"], "default_vs_gemm": times["gemm"] / times["default"],
                 "naive_vs_gemm": times["gemm"] / times["naive"], "gemm_vs_cublas": times["cublas"] / times["gemm"],
                 "best_variant": best[1], "best_vs_gemm": times["gemm"] / best[0],
                 "plan": {"path": p["path"], "REG": p["REG"], "cfg": p["cfg"]}, "bits_ok": bits_ok}
            r["gluon"] = {name: {"vs_cublas": times["cublas"] / times[name], "vs_gemm": times["gemm"] / times[name],
                                 "vs_tree": times["tree"] / times[name], "bits_ok": gluon_bits[name]}
                          for name in GLUON_NAMES if name in times}
            rows.append(r)
            var = "  ".join(f"{nm} {times['gemm'] / t:.3f}" for nm, t in times.items() if nm in VARIANTS)
            print(f"{shape:22s} S={segments} M={m:5d}  cuBLAS {times['cublas'] * 1e3:8.1f} us  gemm {times['gemm'] * 1e3:8.1f}  "
                  f"naive {times['naive'] * 1e3:8.1f}  tree {times['tree'] * 1e3:8.1f} us [{p['path']} r{p['REG']}]  "
                  f"tree/cuBLAS {r['tree_vs_cublas']:.3f}  tree/gemm {r['tree_vs_gemm']:.3f}  "
                  f"default/gemm {r['default_vs_gemm']:.3f}  bits {'ok' if bits_ok else 'DIFFER'}"
                  + (f"  | vs gemm: {var}" if var else "")
                  + "".join(f"  | {nm} {times[nm] * 1e3:8.1f} us /cuBLAS {g['vs_cublas']:.3f} /gemm {g['vs_gemm']:.3f} "
                            f"bits {'ok' if g['bits_ok'] else 'DIFFER'}" for nm, g in r["gluon"].items()),
                  flush=True)
        ws = xs = None
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def table(rows) -> str:
    lines = ["| shape | S | M | cuBLAS us | gemm us | naive us | tree us | schedule | tree/cuBLAS | tree/gemm | naive/gemm |"
             " best variant (vs gemm) | default/cuBLAS | default/gemm | bits |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | --- |"]
    for r in rows:
        t = r["ms"]
        lines.append(f"| {r['shape']} | {r['segments']} | {r['M']} | {t['cublas'] * 1e3:.1f} | {t['gemm'] * 1e3:.1f} | "
                     f"{t['naive'] * 1e3:.1f} | {t['tree'] * 1e3:.1f} | {r['plan']['path']} r{r['plan']['REG']} | "
                     f"{r['tree_vs_cublas']:.3f} | {r['tree_vs_gemm']:.3f} | {r['naive_vs_gemm']:.3f} | "
                     f"{r['best_variant']} ({r['best_vs_gemm']:.3f}) | {r['default_vs_cublas']:.3f} | "
                     f"{r['default_vs_gemm']:.3f} | {'ok' if r['bits_ok'] else 'DIFFER'} |")
    for r in rows:
        for nm, g in r.get("gluon", {}).items():
            lines.append(f"| {r['shape']} | {r['segments']} | {r['M']} | {nm} candidate | | | {r['ms'][nm] * 1e3:.1f} | | "
                         f"{g['vs_cublas']:.3f} | {g['vs_gemm']:.3f} | | | | | {'ok' if g['bits_ok'] else 'DIFFER'} (vs tree) |")
    lines.append("")
    for s in sorted({r["segments"] for r in rows}):
        worst = min((r for r in rows if r["segments"] == s), key=lambda r: r["default_vs_gemm"])
        lines.append(f"S = {s}: worst default/gemm {worst['default_vs_gemm']:.3f} ({worst['shape']}, M={worst['M']}); "
                     f"target >= 0.97 everywhere: {'met' if worst['default_vs_gemm'] >= 0.97 else 'NOT met'}")
    lines.append(f"bits: {'all equal to the per-segment loop' if all(r['bits_ok'] for r in rows) else 'SOME DIFFER'}")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "results", "row_parallel.json"))
    ap.add_argument("--quick", action="store_true", help="two shapes, four M, no forced variants (< 90 s)")
    ap.add_argument("--no-variants", action="store_true", help="only the planner's schedule")
    ap.add_argument("--variants", default="", help="comma-separated forced variants to run (default: all of VARIANTS)")
    ap.add_argument("--rep", type=int, default=20, help="ms of CUDA-graph replays per timing")
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    ap.add_argument("--gluon", action="store_true",
                    help="also the Gluon tree (kernels/triton/gluon_segment_tree.py) at M >= GLUON_MIN_M: bits vs the tree, time")
    ap.add_argument("--segments", default="8",
                    help="comma-separated segment counts S of the contract (a model's consistent_row_parallel_segments)")
    ap.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    global DEV
    if args.cpu_smoke:  # TRITON_INTERPRET=1, tiny shapes: the script's plumbing only
        DEV = torch.device("cpu")
        SHAPES.clear()
        SHAPES.update({"smoke 40x128": (40, 128)})
        QUICK_SHAPES[:] = list(SHAPES)
        MS[:] = QUICK_MS[:] = [1, 20]
    t0 = time.time()
    shapes = QUICK_SHAPES if args.quick else list(SHAPES)
    ms = QUICK_MS if args.quick else MS
    variants = not (args.quick or args.no_variants)
    if args.variants:
        keep = [v.strip() for v in args.variants.split(",")]
        unknown = [v for v in keep if v not in VARIANTS]
        if unknown:
            ap.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
        for v in list(VARIANTS):
            if v not in keep:
                del VARIANTS[v]
    names = ["gemm", "naive", "tree", "default"] + (list(VARIANTS) if variants else []) + (list(GLUON_NAMES) if args.gluon else [])
    SEGMENTS[:] = [int(v) for v in args.segments.split(",")]
    jobs = [(*SHAPES[s], ms, variants, nm, seg) for seg in SEGMENTS for s in shapes for nm in names]
    errors = [] if args.cpu_smoke else precompile(jobs, max(1, min(args.workers, len(jobs))))
    import triton

    rows = [r for seg in SEGMENTS for r in run(shapes, ms, variants, args.rep, args.gluon, seg)]
    res = {"gpu": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu (interpreter smoke)",
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(),
           "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
           "segments": SEGMENTS, "rows": rows, "compile_errors": errors, "seconds": time.time() - t0}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print()
    print(table(rows))
    print(f"wrote {args.out} in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()

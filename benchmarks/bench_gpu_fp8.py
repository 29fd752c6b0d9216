"""GPU benchmarks of the block-FP8 Triton linear (issue #9); the CUDA MoE layer is ``bench_gpu_moe.py``'s.

    python benchmarks/bench_gpu_fp8.py [--out benchmarks/results] [--quick]

* FP8 linear, Llama-3-8B shapes (4096x4096, qkv 4096->6144, gate/up 4096->28672, down 14336->4096) at
  M in {1,16,64,256,1024,4096,8192}, all timed in one run with CUDA-graph replay, weights cycled through
  more than L2:  our FP8 linear (dynamic 1x128 activation quantization + FP8 GEMM), our FP8 GEMM alone
  (pre-quantized), our BF16 Triton linear, cuBLAS bf16 (``torch.mm``), and ``torch._scaled_mm`` FP8 with
  rowwise scales and with DeepSeek block scales (1x128 activations / 128x128 weights) where this torch
  build supports them (M padded to 16 where cuBLASLt needs it).
* accuracy of our FP8 GEMM and of ``_scaled_mm`` block-scaled vs a float64 reference of the same
  dequantized operands (max error relative to sum |x_k w_k|);

Writes ``gpu_fp8_<date>.json`` and ``gpu_fp8_<date>.md`` to ``--out`` and prints the tables.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import sys
import traceback

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from megatron_consistent.kernels import fp8  # noqa: E402
from megatron_consistent.kernels.dispatch import implementation  # noqa: E402
from megatron_consistent.kernels.triton import fp8_linear as tf8  # noqa: E402
from megatron_consistent.kernels.triton import linear as tlin  # noqa: E402

DEV = torch.device("cuda")
SHAPES = {"4096x4096": (4096, 4096), "qkv 4096->6144": (6144, 4096), "gate/up 4096->28672": (28672, 4096),
          "down 14336->4096": (4096, 14336)}
MS = [1, 16, 64, 256, 1024, 4096, 8192]


def bench(fn, rep=50):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep)


def _copies(nbytes):
    return max(1, min(8, math.ceil(256e6 / nbytes)))


def _scaled_mm_rowwise(xq, wq):
    m = xq.shape[0]
    pad = (-m) % 16
    a = torch.cat([xq, xq.new_zeros(pad, xq.shape[1])]) if pad else xq
    sa = torch.ones(a.shape[0], 1, device=DEV)
    sb = torch.ones(1, wq.shape[0], device=DEV)
    return lambda: torch._scaled_mm(a, wq.t(), sa, sb, out_dtype=torch.bfloat16)


def _scaled_mm_block(xq, xs, wq, wblk):
    """DeepSeek block scales: a [M, K] with scale [M, K/128] outer-dim-major; b = wq.t() [K, N] with [K/128, N/128]."""
    m = xq.shape[0]
    pad = (-m) % 16
    a = torch.cat([xq, xq.new_zeros(pad, xq.shape[1])]) if pad else xq
    sa = torch.cat([xs, xs.new_ones(pad, xs.shape[1])]) if pad else xs
    sa = sa.t().contiguous().t()
    errors = []
    for sb in (wblk.t(), wblk.t().contiguous()):
        try:
            fn = lambda sb=sb: torch._scaled_mm(a, wq.t(), sa, sb, out_dtype=torch.bfloat16)  # noqa: E731
            out = fn()
            return fn, out[:m]
        except Exception as e:  # noqa: BLE001
            errors.append(f"{type(e).__name__}: {str(e)[:160]}")
    raise RuntimeError(" | ".join(errors))


def run_fp8(ms):
    rows = []
    impl = implementation("fp8_linear", DEV)
    for name, (n, k) in SHAPES.items():
        nb = _copies(n * k * 2)
        nf = _copies(n * k)
        wb = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(nb)]
        wf = []
        for i in range(nf):
            q, s = fp8.quantize(wb[i % nb], fp8.E4M3_WEIGHT_128)
            wf.append((q, fp8.weight_row_scales(s, n), s))
        for m in ms:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            xq, xs = tf8.quantize_activations(x)
            outs = [torch.empty(m, n, device=DEV, dtype=torch.bfloat16) for _ in wb]
            r = {"shape": name, "M": m, "N": n, "K": k, "fp8_config": tf8.fp8_config(n, k),
                 "bf16_config": tlin.config_for(n, k, torch.bfloat16)}
            cases = {
                "cublas_bf16": (lambda: [torch.mm(x, w.T, out=o) for w, o in zip(wb, outs)], nb),
                "ours_bf16": (lambda: [tlin.gemm(x, w, None, torch.bfloat16) for w in wb], nb),
                # each weight quantized as one tensor: its scales are constant over aligned 128-row blocks
                "ours_fp8": (lambda: [impl(x, q, rs, None, torch.bfloat16, w_block_rows=128) for q, rs, _ in wf], nf),
                "ours_fp8_gemm_only": (lambda: [tf8.fp8_gemm(xq, xs, q, rs, None, torch.bfloat16, w_block_rows=128)
                                                for q, rs, _ in wf], nf),
                "act_quant_only": (lambda: [tf8.quantize_activations(x) for _ in wf], nf),
            }
            try:
                fns = [_scaled_mm_rowwise(xq, q) for q, _, _ in wf]
                cases["scaled_mm_rowwise"] = (lambda: [f() for f in fns], nf)
            except Exception as e:  # noqa: BLE001
                r["scaled_mm_rowwise_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            try:
                fb = [_scaled_mm_block(xq, xs, q, s)[0] for q, _, s in wf]
                cases["scaled_mm_block"] = (lambda: [f() for f in fb], nf)
            except Exception as e:  # noqa: BLE001
                r["scaled_mm_block_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            for cname, (fn, cnt) in cases.items():
                try:
                    r[cname + "_ms"] = bench(fn) / cnt
                except Exception as e:  # noqa: BLE001
                    r[cname + "_ms"] = float("nan")
                    r[cname + "_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            flops = 2.0 * m * n * k
            for cname in cases:
                r[cname + "_tflops"] = flops / r[cname + "_ms"] * 1e-9
            t = r["ours_fp8_ms"]
            r["ratio_cublas_bf16_over_ours_fp8"] = r["cublas_bf16_ms"] / t
            r["ratio_ours_bf16_over_ours_fp8"] = r["ours_bf16_ms"] / t
            r["ratio_scaled_mm_rowwise_over_ours_fp8_gemm"] = r.get("scaled_mm_rowwise_ms", float("nan")) / r["ours_fp8_gemm_only_ms"]
            r["ratio_scaled_mm_block_over_ours_fp8_gemm"] = r.get("scaled_mm_block_ms", float("nan")) / r["ours_fp8_gemm_only_ms"]
            rows.append(r)
            print(f"FP8 {name:22s} M={m:5d}  cuBLAS-bf16 {r['cublas_bf16_tflops']:6.1f}  ours-bf16 {r['ours_bf16_tflops']:6.1f}"
                  f"  ours-fp8 {r['ours_fp8_tflops']:6.1f} (gemm {r['ours_fp8_gemm_only_tflops']:6.1f})"
                  f"  scaled_mm row {r.get('scaled_mm_rowwise_tflops', float('nan')):6.1f}"
                  f" block {r.get('scaled_mm_block_tflops', float('nan')):6.1f} TFLOP/s"
                  f"  | cuBLAS-bf16/ours-fp8 {r['ratio_cublas_bf16_over_ours_fp8']:.2f}x", flush=True)
        wb = wf = outs = None  # free before the next shape
        torch.cuda.empty_cache()
    return rows


def run_accuracy():
    out = []
    for n, k in [(4096, 4096), (4096, 14336)]:
        w = torch.randn(n, k, device=DEV) * 0.02
        x = torch.randn(256, k, device=DEV).to(torch.bfloat16)
        wq, ws = fp8.quantize(w, fp8.E4M3_WEIGHT_128)
        rows = fp8.weight_row_scales(ws, n)
        xq, xs = tf8.quantize_activations(x)
        xd = fp8.dequantize(xq, xs, fp8.E4M3_ACT_1x128).double()
        wd = fp8.dequantize_rows(wq, rows).double()
        ref, mag = xd @ wd.T, xd.abs() @ wd.abs().T
        r = {"N": n, "K": k, "M": 256}
        y = tf8.fp8_gemm(xq, xs, wq, rows, None, torch.float32)
        r["ours_fp8_max_rel_err"] = ((y.double() - ref).abs() / mag).max().item()
        try:
            _, yb = _scaled_mm_block(xq, xs, wq, ws)
            r["scaled_mm_block_bf16_out_max_rel_err"] = ((yb.double() - ref).abs() / mag).max().item()
        except Exception as e:  # noqa: BLE001
            r["scaled_mm_block_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        yb16 = tf8.fp8_gemm(xq, xs, wq, rows, None, torch.bfloat16)
        r["ours_fp8_bf16_out_max_rel_err"] = ((yb16.double() - ref).abs() / mag).max().item()
        out.append(r)
        print("ACC", json.dumps(r), flush=True)
    return out


SWEEP = {  # (BM, BN, warps, stages, programs per SM); BLOCK_K = 128, splits from the (N, K) table
    "128x128 w8 s4 p1": (128, 128, 8, 4, 1), "128x128 w8 s3 p2": (128, 128, 8, 3, 2), "64x128 w4 s3 p3": (64, 128, 4, 3, 3),
    "64x128 w4 s4 p2": (64, 128, 4, 4, 2), "128x128 w4 s3 p2": (128, 128, 4, 3, 2), "64x256 w4 s3 p2": (64, 256, 4, 3, 2),
    "128x256 w8 s3 p1": (128, 256, 8, 3, 1), "64x128 w4 s3 p8": (64, 128, 4, 3, 8), "128x64 w4 s4 p3": (128, 64, 4, 4, 3),
}


def run_sweep():
    """FP8 GEMM tile configs (numerics-neutral: checked bitwise against the default config)."""
    out = []
    for n, k in [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336)]:
        w = torch.randn(n, k, device=DEV) * 0.02
        wq, ws = fp8.quantize(w, fp8.E4M3_WEIGHT_128)
        rows = fp8.weight_row_scales(ws, n)
        for m in (64, 256, 4096):
            x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
            xq, xs = tf8.quantize_activations(x)
            ref = tf8.fp8_gemm(xq, xs, wq, rows, None, torch.float32)
            for name, (bm, bn, w_, st, p) in SWEEP.items():
                cfg = {"BM": bm, "BN": bn, "W": w_, "S": st, "P": p}
                r = {"N": n, "K": k, "M": m, "config": name}
                try:
                    y = tf8.fp8_gemm(xq, xs, wq, rows, None, torch.float32, cfg=cfg)
                    r["bitwise_equal_default"] = bool(torch.equal(y, ref))
                    r["ms"] = bench(lambda cfg=cfg: tf8.fp8_gemm(xq, xs, wq, rows, None, torch.bfloat16, cfg=cfg))
                    r["tflops"] = 2.0 * m * n * k / r["ms"] * 1e-9
                except Exception as e:  # noqa: BLE001
                    r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                out.append(r)
                print("SWEEP", json.dumps(r), flush=True)
    return out


def to_markdown(res):
    lines = ["### FP8 linear (TFLOP/s; ratio = reference time / our FP8 time)", "",
             "| shape | M | cuBLAS bf16 | ours bf16 | ours FP8 (quant+GEMM) | ours FP8 GEMM | _scaled_mm rowwise | _scaled_mm block | "
             "cuBLAS bf16 / ours FP8 | ours bf16 / ours FP8 | block _scaled_mm / ours FP8 GEMM |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["fp8"]:
        f = lambda key: f"{r.get(key, float('nan')):.1f}"  # noqa: E731
        lines.append(f"| {r['shape']} | {r['M']} | {f('cublas_bf16_tflops')} | {f('ours_bf16_tflops')} | {f('ours_fp8_tflops')} | "
                     f"{f('ours_fp8_gemm_only_tflops')} | {f('scaled_mm_rowwise_tflops')} | {f('scaled_mm_block_tflops')} | "
                     f"{r['ratio_cublas_bf16_over_ours_fp8']:.2f} | {r['ratio_ours_bf16_over_ours_fp8']:.2f} | "
                     f"{r['ratio_scaled_mm_block_over_ours_fp8_gemm']:.2f} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="only the FP8 tile sweep")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": _dt.date.today().isoformat()}
    if args.sweep:
        res["sweep"] = run_sweep()
        with open(os.path.join(args.out, f"gpu_fp8_sweep_{res['date']}.json"), "w") as f:
            json.dump(res, f, indent=1)
        return
    for key, fn in (("accuracy", run_accuracy), ("fp8", lambda: run_fp8([1, 256, 4096] if args.quick else MS))):
        try:
            res[key] = fn()
        except Exception:  # noqa: BLE001
            res[key + "_error"] = traceback.format_exc()[-2000:]
            res.setdefault(key, [])
            print(res[key + "_error"], flush=True)
        with open(os.path.join(args.out, f"gpu_fp8_{res['date']}.json"), "w") as f:
            json.dump(res, f, indent=1)
    md = to_markdown(res)
    with open(os.path.join(args.out, f"gpu_fp8_{res['date']}.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()

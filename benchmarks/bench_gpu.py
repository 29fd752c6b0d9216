"""GPU benchmarks of the consistent Triton kernels against cuBLAS / SDPA (issue #6).

    python benchmarks/bench_gpu.py [--out benchmarks/results] [--sweep] [--quick]

* GEMM TFLOP/s vs ``torch.mm`` (cuBLAS) for M in {1,16,64,256,1024,4096,8192}
  at K=N=4096 and at Llama-3-8B's qkv (4096->6144) and gate/up (4096->28672)
  shapes, bf16 in/out.  Both sides are timed in one run with CUDA-graph replay
  (``triton.testing.do_bench_cudagraph``), cycling through enough weight copies
  that the weights do not stay in L2 (a real model streams its weights).
* attention prefill vs SDPA (flash backend): B=1, T=4096, H=32, D=128, bf16, causal;
* decode attention vs SDPA: batch 256, context 2048, H=32, D=128 (and GQA 32/8);
* memory-bound small ops (RMSNorm, SiLU-and-mul, log-softmax) vs torch eager, GB/s.

Writes ``gpu_<date>.json`` and ``gpu_<date>.md`` to ``--out`` and prints the table.
``--sweep`` times a few GEMM tile configs per (N, K) (offline tuning of the table).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from megatron_consistent.kernels.dispatch import implementation  # noqa: E402
from megatron_consistent.kernels.logprobs import VOCAB_SEGMENTS  # noqa: E402
from megatron_consistent.kernels.triton import attention as tattn  # noqa: E402
from megatron_consistent.kernels.triton import linear as tlin  # noqa: E402

DEV = torch.device("cuda")
GEMM_SHAPES = {"4096x4096": (4096, 4096), "llama3-8b qkv 4096->6144": (6144, 4096),
               "llama3-8b gate/up 4096->28672": (28672, 4096)}
GEMM_MS = [1, 16, 64, 256, 1024, 4096, 8192]


def bench(fn, rep=60):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep)


def _weights(n, k, dtype=torch.bfloat16):
    nbytes = n * k * 2
    copies = max(1, min(8, math.ceil(256e6 / nbytes)))
    return [torch.randn(n, k, device=DEV, dtype=dtype) * 0.02 for _ in range(copies)]


def time_gemm_pair(m, n, k, cfg=None, path=None, tiles_by_m=None):
    ws = _weights(n, k)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    outs = [torch.empty(m, n, device=DEV, dtype=torch.bfloat16) for _ in ws]

    def ref():
        for w, o in zip(ws, outs):
            torch.mm(x, w.T, out=o)

    def ours():
        for w in ws:
            tlin.gemm(x, w, None, torch.bfloat16, cfg=cfg, path=path, tiles_by_m=tiles_by_m)

    t_ref = bench(ref) / len(ws)
    t_ours = bench(ours) / len(ws)
    flops = 2.0 * m * n * k
    return {"M": m, "N": n, "K": k, "cublas_ms": t_ref, "ours_ms": t_ours,
            "cublas_tflops": flops / t_ref * 1e-9, "ours_tflops": flops / t_ours * 1e-9, "ratio": t_ref / t_ours}


def run_gemm(ms, tiles_by_m=False):
    rows = []
    for name, (n, k) in GEMM_SHAPES.items():
        for m in ms:
            r = time_gemm_pair(m, n, k, tiles_by_m=tiles_by_m or None)  # None: the M-class table if installed
            r["shape"] = name
            r["config"] = tlin.config_for(n, k, torch.bfloat16, m, tiles_by_m or None)
            r["tiles_by_m"] = tiles_by_m
            rows.append(r)
            print(f"GEMM{'[by-M]' if tiles_by_m else ''} {name:32s} M={m:5d}  cuBLAS {r['cublas_tflops']:7.1f}  ours {r['ours_tflops']:7.1f} TFLOP/s"
                  f"  ratio {r['ratio']:.3f}", flush=True)
    return rows


def run_sweep():
    cands = {} if os.environ.get("SWEEP_SKINNY_ONLY") else {
        "128x128x64 s4": lambda sps: tlin._cfg(128, 128, 64, sps, 8, 4),
        "128x128x128 s3": lambda sps: tlin._cfg(128, 128, 128, max(1, sps // 2), 8, 3),
        "128x256x64 s3 nosplit": lambda sps: tlin._cfg(128, 256, 64, 10 ** 6, 8, 3),
        "256x128x64 s3 nosplit": lambda sps: tlin._cfg(256, 128, 64, 10 ** 6, 8, 3),
    }
    splits = {(4096, 4096): [16, 32], (6144, 4096): [32, 16], (28672, 4096): [64, 32]}
    out = []
    for (n, k), sps_list in splits.items():
        for cname, mk in cands.items():
            for sps in (sps_list if "nosplit" not in cname else [None]):
                cfg = mk(sps or 64)
                res = {}
                for m in (64, 4096):
                    try:
                        res[m] = time_gemm_pair(m, n, k, cfg=cfg)["ratio"]
                    except Exception as e:  # noqa: BLE001
                        res[m] = f"error: {type(e).__name__}: {str(e)[:80]}"
                print(f"SWEEP N={n} K={k} {cname:24s} split_steps={sps}  " +
                      "  ".join(f"M={m}: {v if isinstance(v, str) else f'{v:.3f}'}" for m, v in res.items()), flush=True)
                out.append({"N": n, "K": k, "config": cname, "split_steps": sps, "ratios": res})
    # opt-in small-M tiles (no split, BLOCK_K 64): numerics-identical to 128x256x64 no-split
    skinny = [(64, 32, 4, 8), (64, 64, 4, 6), (64, 64, 4, 8), (64, 128, 4, 4), (64, 128, 4, 6)]
    for (n, k) in ((4096, 4096), (6144, 4096), (28672, 4096)):
        for bm, bn, w, st in skinny:
            cfg = tlin._cfg(bm, bn, 64, 10 ** 6, w, st)
            res = {}
            for m in (16, 64, 256):
                try:
                    res[m] = time_gemm_pair(m, n, k, cfg=cfg)["ratio"]
                except Exception as e:  # noqa: BLE001
                    res[m] = f"error: {type(e).__name__}: {str(e)[:80]}"
            print(f"SKINNY N={n} K={k} {bm}x{bn} w{w} st{st}  " +
                  "  ".join(f"M={m}: {v if isinstance(v, str) else f'{v:.3f}'}" for m, v in res.items()), flush=True)
            out.append({"N": n, "K": k, "skinny": [bm, bn, w, st], "ratios": res})
    return out


def _sdpa(q, k, v, causal, gqa=False):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        kw = {"enable_gqa": True} if gqa else {}
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, **kw)


def run_attention():
    rows = []
    b, t, h, d = 1, 4096, 32, 128
    for hkv in (32, 8):
        q = torch.randn(b, t, h, d, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(b, t, hkv, d, device=DEV, dtype=torch.bfloat16)
        v = torch.randn(b, t, hkv, d, device=DEV, dtype=torch.bfloat16)
        pos = torch.arange(t, device=DEV).expand(b, t).contiguous()
        kl = torch.full((b,), t, device=DEV)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        flops = 4.0 * b * h * d * t * (t + 1) / 2
        try:
            t_ref = bench(lambda: _sdpa(qt, kt, vt, True, gqa=hkv != h))
        except Exception as e:  # noqa: BLE001
            print("SDPA failed:", e)
            t_ref = float("nan")
        t_ours = bench(lambda: tattn.attention_fwd(q, k, v, pos, kl, d ** -0.5))
        r = {"case": f"prefill B={b} T={t} Hq={h} Hkv={hkv} D={d} causal", "sdpa_ms": t_ref, "ours_ms": t_ours,
             "sdpa_tflops": flops / t_ref * 1e-9, "ours_tflops": flops / t_ours * 1e-9, "ratio": t_ref / t_ours}
        rows.append(r)
        print(f"ATTN {r['case']:48s} SDPA {r['sdpa_tflops']:6.1f}  ours {r['ours_tflops']:6.1f} TFLOP/s  ratio {r['ratio']:.3f}", flush=True)
    # decode
    b, ctx = 256, 2048
    for hkv in (32, 8):
        q = torch.randn(b, 1, h, d, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(b, ctx, hkv, d, device=DEV, dtype=torch.bfloat16)
        v = torch.randn(b, ctx, hkv, d, device=DEV, dtype=torch.bfloat16)
        pos = torch.full((b, 1), ctx - 1, device=DEV)
        kl = torch.full((b,), ctx, device=DEV)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        nbytes = 2 * b * ctx * hkv * d * 2
        try:
            t_ref = bench(lambda: _sdpa(qt, kt, vt, False, gqa=hkv != h))
        except Exception as e:  # noqa: BLE001
            print("SDPA failed:", e)
            t_ref = float("nan")
        t_ours = bench(lambda: tattn.attention_fwd(q, k, v, pos, kl, d ** -0.5))
        r = {"case": f"decode B={b} ctx={ctx} Hq={h} Hkv={hkv} D={d}", "sdpa_ms": t_ref, "ours_ms": t_ours,
             "sdpa_GBps": nbytes / t_ref * 1e-6, "ours_GBps": nbytes / t_ours * 1e-6, "ratio": t_ref / t_ours}
        rows.append(r)
        print(f"ATTN {r['case']:48s} SDPA {r['sdpa_GBps']:7.0f}  ours {r['ours_GBps']:7.0f} GB/s (KV)  ratio {r['ratio']:.3f}", flush=True)
    return rows


def run_small_ops():
    rows = []
    h = torch.randn(8192, 4096, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(4096, device=DEV, dtype=torch.bfloat16)
    rn = implementation("rms_norm", DEV)
    ref = lambda: torch.nn.functional.rms_norm(h, (4096,), w, 1e-6)  # noqa: E731
    rows.append(("rms_norm 8192x4096 bf16", bench(ref), bench(lambda: rn(h, w, 1e-6)), 2 * h.numel() * 2))
    x = torch.randn(4096, 2 * 14336, device=DEV, dtype=torch.bfloat16)
    sm = implementation("silu_and_mul", DEV)
    ref = lambda: torch.nn.functional.silu(x[:, :14336]) * x[:, 14336:]  # noqa: E731
    rows.append(("silu_and_mul 4096x(2*14336) bf16", bench(ref), bench(lambda: sm(x)), x.numel() * 2 * 3 // 2))
    z = torch.randn(1024, 128256, device=DEV)
    se, nm = implementation("sum_exp_subtree", DEV), implementation("log_softmax_normalise", DEV)

    def ls():  # kernels.log_softmax at temperature 1 without the division: amax, 8-segment sum-exp, normalise
        m = z.amax(-1, keepdim=True)
        return nm(z, m, se(z, m, VOCAB_SEGMENTS))

    rows.append(("log_softmax 1024x128256 fp32", bench(lambda: torch.log_softmax(z, -1)), bench(ls),
                 2 * z.numel() * 4))
    out = []
    for name, t_ref, t_ours, nbytes in rows:
        r = {"case": name, "torch_ms": t_ref, "ours_ms": t_ours, "torch_GBps": nbytes / t_ref * 1e-6,
             "ours_GBps": nbytes / t_ours * 1e-6, "ratio": t_ref / t_ours}
        print(f"OP   {name:40s} torch {r['torch_GBps']:7.0f}  ours {r['ours_GBps']:7.0f} GB/s  ratio {r['ratio']:.3f}", flush=True)
        out.append(r)
    return out


def markdown(res) -> str:
    lines = [f"# GPU benchmarks — {res['gpu']} — {res['date']}", "",
             f"torch {res['torch']}, triton {res['triton']}, CUDA {res['cuda']}. Timing: CUDA-graph replay "
             "(`triton.testing.do_bench_cudagraph`), both sides in the same run; ratio = reference time / our time "
             "(> 1 means we are faster).", "",
             "## GEMM (bf16 in/out) vs torch.mm (cuBLAS)", "",
             "| shape (N x K) | M | cuBLAS TFLOP/s | ours TFLOP/s | ratio | config (BMxBNxBK, split steps, warps, stages) |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    def gemm_rows(rows):
        out = []
        for r in rows:
            c = r["config"]
            sps = "no split" if c["SPLIT_STEPS"] >= 1 << 19 else c["SPLIT_STEPS"]
            out.append(f"| {r['shape']} | {r['M']} | {r['cublas_tflops']:.1f} | {r['ours_tflops']:.1f} | {r['ratio']:.3f} | "
                       f"{c['BM']}x{c['BN']}x{c['BK']}, {sps}, {c['W']}, {c['S']} |")
        return out

    lines += gemm_rows(res.get("gemm", []))
    if res.get("gemm_tiles_by_m"):
        lines += ["", "### Opt-in: tile shape by M class (`MC_GEMM_TILES_BY_M=1`; numerics fixed per (N, K), tile shape per M)", "",
                  lines[6], lines[7]]
        lines += gemm_rows(res["gemm_tiles_by_m"])
    lines += ["", "## Attention vs SDPA (flash backend)", "", "| case | SDPA | ours | ratio |", "| --- | ---: | ---: | ---: |"]
    for r in res.get("attention", []):
        if "sdpa_tflops" in r:
            lines.append(f"| {r['case']} | {r['sdpa_tflops']:.1f} TFLOP/s | {r['ours_tflops']:.1f} TFLOP/s | {r['ratio']:.3f} |")
        else:
            lines.append(f"| {r['case']} | {r['sdpa_GBps']:.0f} GB/s | {r['ours_GBps']:.0f} GB/s | {r['ratio']:.3f} |")
    if res.get("small_ops"):
        lines += ["", "## Memory-bound ops vs torch eager", "", "| op | torch GB/s | ours GB/s | ratio |", "| --- | ---: | ---: | ---: |"]
        for r in res["small_ops"]:
            lines.append(f"| {r['case']} | {r['torch_GBps']:.0f} | {r['ours_GBps']:.0f} | {r['ratio']:.3f} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--tiles-by-m", action="store_true", help="also time the opt-in M-class tile table")
    ap.add_argument("--quick", action="store_true", help="GEMM at K=N=4096 only")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    res = {"gpu": torch.cuda.get_device_name(), "date": date, "torch": torch.__version__, "triton": triton.__version__,
           "cuda": torch.version.cuda}
    if args.sweep:
        res["sweep"] = run_sweep()
        with open(os.path.join(args.out, f"gpu_sweep_{date}.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
    if not args.no_bench:
        if args.quick:
            global GEMM_SHAPES
            GEMM_SHAPES = {"4096x4096": (4096, 4096)}
        res["gemm"] = run_gemm(GEMM_MS)
        if args.tiles_by_m:
            res["gemm_tiles_by_m"] = run_gemm(GEMM_MS, tiles_by_m=True)
        res["attention"] = run_attention()
        res["small_ops"] = run_small_ops()
        with open(os.path.join(args.out, f"gpu_{date}.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
        md = markdown(res)
        with open(os.path.join(args.out, f"gpu_{date}.md"), "w") as f:
            f.write(md)
        print(md)


if __name__ == "__main__":
    main()

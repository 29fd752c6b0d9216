"""GPU MoE layer forward: the consistent engine's MoE ops vs vLLM's stock fused MoE, one run, CUDA-graph replay.

    python benchmarks/bench_gpu_moe.py --out /tmp/moe.json [--tokens 1 16 64 256 1024 4096]
    python benchmarks/bench_gpu_moe.py --fp8 --out /tmp/moe_fp8.json  # block-FP8 experts on both sides
    python benchmarks/bench_gpu_moe.py --plot /tmp/moe.json          # the PNG again (CPU)

The layer of Qwen3-30B-A3B (hidden 2048, 128 experts, top-8, expert width 768, ``norm_topk_prob``; bf16), at T tokens
per forward (decode batches to prefill chunks):

* **consistent**: the engine's custom ops exactly as the vLLM plugin calls them — ``router_logits`` (Triton linear,
  float32 out), ``moe_route`` (deterministic softmax, stable top-k), ``moe_experts`` (pairs sorted by expert, grouped
  Triton GEMMs, slot-order combine); also its two halves alone (router + route; experts + combine);
* **stock**: vLLM 0.26's path for the same layer: ``F.linear`` router (cuBLAS), ``fused_topk`` (CUDA top-k softmax),
  ``fused_experts`` (vLLM's Triton fused-MoE kernel with its tuned or default config); skipped with the reason when
  vLLM does not import;
* **floor**: the expert weight bytes the T tokens touch (distinct experts hit x (2I + I) x H x 2 bytes, plus the
  router and the activations) over the device's **read** bandwidth measured in this run (a 2 GiB ``sum``: the layer
  streams its weights, it writes little); the copy bandwidth (read + write counted, the attention benchmark's floor)
  is reported beside it — both engines beat a copy-based floor (session 16).

With ``--fp8`` the experts are block-FP8 (E4M3 values, float32 scales per 128 x 128 block, activations quantized
per token and 128-group at run time; the router stays bf16): consistent = ``fp8_moe_experts`` (grouped FP8 Triton
GEMMs), stock = ``fused_experts`` with vLLM's block-FP8 quant config (its Triton w8a8 block kernel); the floor counts
one byte per expert weight.

Each time is ``triton.testing.do_bench_cudagraph`` of one forward (the expert weights, 1.2 GB, are far past L2).
Ratios are ``time(stock) / time(consistent)`` (> 1: consistent faster).  Writes JSON to ``--out``, prints a table and
writes a PNG next to the JSON (time per forward against T, log-log, with the floor).

``--fp8-variants flat flat+tma:64:64:4 ...``: the grouped FP8 experts' scheduling knobs timed in the same run (``flat``:
the splits walked by one loop; ``+tma``: the weights through a TMA descriptor; ``BM:BN:warps``: the launch shape;
``base`` = none), each output checked bit for bit against the default's (``torch.equal``).  ``--kernel-times``:
per-kernel device time of one eager forward of each engine (median of 20, torch profiler): where a layer's time goes.

``--owned-tp t`` (bf16): the engine's experts of TP rank 0 at TP = t (``moe_owned_expert_outputs``: its ``E/t`` experts'
pairs computed, the others' left out as expert -1), timed beside the same rank when every pair is computed on a local
expert and masked (session 31's scheme: ``masked all pairs``) and beside all experts' pairs at TP = 1; the rank's
owned pairs checked bit for bit against the one-rank pairs, its others exactly zero.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

H, E, TOP_K, INTER = 2048, 128, 8, 768
TOKENS = (1, 16, 64, 256, 1024, 4096)


def _layer(device):
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    r = lambda *s: (torch.randn(*s, device=device, generator=g) * 0.02).to(torch.bfloat16)  # noqa: E731
    return r(E, H), r(E, 2 * INTER, H), r(E, H, INTER)


def _fp8_experts(w):
    """Stacked experts ``[E, N, K]`` in block-FP8: (E4M3 values, block scales ``[E, N/128, K/128]``, per-row scales)."""
    import torch

    from megatron_consistent.kernels import fp8

    parts = [fp8.quantize(w[e], fp8.E4M3_WEIGHT_128) for e in range(w.shape[0])]
    q, blocks = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    return q, blocks, fp8.weight_row_scales(blocks, w.shape[1])


def _stock_fns(router, w13, w2, fp8_experts=None):
    """vLLM's stock MoE forward (block-FP8 with ``fp8_experts`` = the two :func:`_fp8_experts`), or the reason it
    cannot run here."""
    import torch.nn.functional as F

    try:
        from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
        from vllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk
    except Exception as e:  # noqa: BLE001
        return None, f"vLLM fused MoE not importable: {type(e).__name__}: {str(e)[:160]}"
    quant = None
    if fp8_experts is not None:
        (w13, s13, _), (w2, s2, _) = fp8_experts
        quant = fp8_w8a8_moe_quant_config(w1_scale=s13, w2_scale=s2, block_shape=[128, 128])

    def forward(x):
        logits = F.linear(x, router)
        w, ids, _ = fused_topk(x, logits, TOP_K, True)
        return fused_experts(x, w13, w2, w, ids, quant_config=quant)

    return forward, None


def read_bandwidth() -> float:
    """Device read bandwidth in bytes/s: a 2 GiB bf16 buffer summed (reads the buffer once, writes one number)."""
    import torch
    import triton.testing

    buf = torch.ones(1 << 30, dtype=torch.bfloat16, device="cuda")
    ms = triton.testing.do_bench_cudagraph(lambda: buf.sum(dtype=torch.float32), rep=50)
    return buf.numel() * buf.element_size() / (ms * 1e-3)


def _fp8_variant(spec: str):
    """The module settings of a ``--fp8-variants`` entry: ``flat|base[+tma][:BM:BN:warps]``."""
    name, _, tile = spec.partition(":")
    walk, _, tma = name.partition("+")
    if walk not in ("flat", "base") or tma not in ("", "tma") or (tile and not re.fullmatch(r"\d+:\d+:\d+", tile)):
        raise SystemExit(f"--fp8-variants: {spec!r} is not flat|base[+tma][:BM:BN:warps]")
    return {"FP8_GROUPED_FLAT": walk == "flat", "_FP8_GROUPED_TILE": tile, "FP8_GROUPED_W_TMA": tma == "tma"}


def kernel_times_us(fn, iters: int = 20) -> dict[str, float]:
    """Median device time (us) per forward of each kernel ``fn`` launches (eager, torch profiler), by kernel name."""
    import statistics

    from kernel_trace import profiled_kernels

    per_name: dict[str, list[float]] = {}
    for name, _, dur in profiled_kernels(fn, iters):
        per_name.setdefault(name[:80], []).append(dur)
    return {name: statistics.median(d) * len(d) / iters for name, d in per_name.items()}


def run(tokens, fp8: bool = False, variants=(), kernel_times: bool = False, owned_tp: int = 0) -> dict:
    import torch
    import triton
    import triton.testing

    from bench_gpu_attention import copy_bandwidth
    from module_knobs import module_knobs
    from megatron_consistent.kernels import inference_ops
    from megatron_consistent.kernels.triton import moe as tmoe
    from megatron_consistent.kernels.fp8 import E4M3_ACT_1x128, E4M3_WEIGHT_128

    dev = torch.device("cuda")
    router, w13, w2 = _layer(dev)

    def route(x):
        return inference_ops.moe_route(inference_ops.router_logits(x, router), TOP_K, "softmax", None, True, 1, 1, 1.0)

    fp8_experts = (_fp8_experts(w13), _fp8_experts(w2)) if fp8 else None

    def experts(x, w, e):
        if fp8_experts is not None:
            (q13, _, r13), (q2, _, r2) = fp8_experts
            return inference_ops.fp8_moe_experts(x, e, w, q13, r13, q2, r2, None, None, None, None, None,
                                                 E4M3_WEIGHT_128.spec, E4M3_ACT_1x128.spec)
        return inference_ops.moe_experts(x, e, w, w13, w2, None, None, None, "swiglu")

    def consistent(x):
        w, e = route(x)
        return experts(x, w, e)

    stock, stock_skip = _stock_fns(router, w13, w2, fp8_experts)
    bw = read_bandwidth()
    expert_bytes = (2 * INTER + INTER) * H * (1 if fp8 else 2)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "layer": {"hidden": H, "experts": E, "top_k": TOP_K, "expert_width": INTER,
                     "dtype": "block-FP8 experts, bf16 router" if fp8 else "bfloat16"},
           "read_bandwidth_GBps": bw / 1e9, "copy_bandwidth_GBps": copy_bandwidth() / 1e9,
           "package_dir": os.path.dirname(os.path.dirname(inference_ops.__file__)),
           "stock_skipped": stock_skip, "rows": []}
    for t in tokens:
        x = torch.randn(t, H, device=dev, generator=torch.Generator(device=dev).manual_seed(t)).to(torch.bfloat16)
        with torch.no_grad():
            w, e = route(x)
            hit = int(torch.unique(e).numel())
            y = consistent(x)
            experts_ref = experts(x, w, e)
            row = {"T": t, "experts_hit": hit,
                   "floor_ms": (hit * expert_bytes + E * H * 2 + 2 * t * H * 2) / bw * 1e3,
                   "consistent_ms": triton.testing.do_bench_cudagraph(lambda: consistent(x), rep=100),
                   "route_ms": triton.testing.do_bench_cudagraph(lambda: route(x), rep=100),
                   "experts_ms": triton.testing.do_bench_cudagraph(lambda: experts(x, w, e), rep=100)}
            if stock is not None:
                ys = stock(x)
                row["stock_ms"] = triton.testing.do_bench_cudagraph(lambda: stock(x), rep=100)
                row["stock_over_consistent"] = row["stock_ms"] / row["consistent_ms"]
                row["max_abs_vs_stock"] = (y.float() - ys.float()).abs().max().item()
            for spec in variants:
                settings = _fp8_variant(spec)
                try:
                    with module_knobs(tmoe, settings):
                        same = torch.equal(experts(x, w, e), experts_ref)
                        ms = triton.testing.do_bench_cudagraph(lambda: experts(x, w, e), rep=100)
                    row.setdefault("variants", {})[spec] = {"experts_ms": ms, "bits_equal_default": same}
                except Exception as exc:  # noqa: BLE001  (a launch shape that does not compile: say so, go on)
                    row.setdefault("variants", {})[spec] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            if owned_tp:
                row.update(_owned_rank(x, e, w13, w2, owned_tp))
            if kernel_times:
                row["kernels_us"] = {"consistent": kernel_times_us(lambda: consistent(x))}
                if stock is not None:
                    row["kernels_us"]["stock"] = kernel_times_us(lambda: stock(x))
        row["floor_over_consistent"] = row["floor_ms"] / row["consistent_ms"]
        out["rows"].append(row)
        print("MOE", json.dumps(row), flush=True)
    return out


def _owned_rank(x, e, w13, w2, tp: int) -> dict:
    """Rank 0's expert outputs at TP = ``tp`` (``--owned-tp``): times and the bit check."""
    import torch
    import triton.testing

    from megatron_consistent.kernels import inference_ops
    from megatron_consistent.kernels import moe as kmoe

    run_ = E // tp
    fc1, fc2 = w13[:run_], w2[:run_]
    mine = e < run_
    one = kmoe.expert_outputs(x, e, w13, w2)
    owned = inference_ops.moe_owned_expert_outputs(x, e, 0, fc1, fc2, "swiglu")
    bits = torch.equal(owned[mine], one[mine]) and bool((owned[~mine] == 0).all())

    def masked_all_pairs():  # every pair through a local expert (others on local expert 0), then the select
        y = kmoe.expert_outputs(x, torch.where(mine, e, torch.zeros_like(e)), fc1, fc2)
        return torch.where(mine[..., None], y, torch.zeros((), dtype=y.dtype, device=y.device))

    return {"owned_tp": tp, "owned_pairs": int(mine.sum()), "owned_bits_equal": bits,
            "owned_rank_ms": triton.testing.do_bench_cudagraph(
                lambda: inference_ops.moe_owned_expert_outputs(x, e, 0, fc1, fc2, "swiglu"), rep=100),
            "masked_all_pairs_ms": triton.testing.do_bench_cudagraph(masked_all_pairs, rep=100),
            "all_experts_pairs_ms": triton.testing.do_bench_cudagraph(lambda: kmoe.expert_outputs(x, e, w13, w2),
                                                                       rep=100)}


def table(res: dict) -> str:
    read = f"read bandwidth {res['read_bandwidth_GBps']:.0f} GB/s (floor), " if "read_bandwidth_GBps" in res else ""
    lines = [f"MoE layer forward ({res['layer']['dtype']}), {res['device']}, {read}copy bandwidth {res['copy_bandwidth_GBps']:.0f} GB/s"
             + (f" (stock skipped: {res['stock_skipped']})" if res.get("stock_skipped") else ""),
             "| T | experts hit | consistent ms | route ms | experts ms | stock ms | stock / consistent | floor ms | "
             "floor / consistent |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        s = lambda key, f="{:.4f}": f.format(r[key]) if key in r else "—"  # noqa: E731
        lines.append(f"| {r['T']} | {r['experts_hit']} | {s('consistent_ms')} | {s('route_ms')} | {s('experts_ms')} | "
                     f"{s('stock_ms')} | {s('stock_over_consistent', '{:.2f}')} | {s('floor_ms')} | "
                     f"{s('floor_over_consistent', '{:.2f}')} |")
    specs = [spec for spec in res["rows"][0].get("variants", {})] if res["rows"] else []
    if specs:
        lines += ["", "experts ms by grouped-FP8 variant (bits equal to the default's: = / DIFF)",
                  "| T | default | " + " | ".join(specs) + " |", "| --- " * (len(specs) + 2) + "|"]
        for r in res["rows"]:
            cells = [f"{v['experts_ms']:.4f} {'=' if v['bits_equal_default'] else 'DIFF'}" if "experts_ms" in v
                     else "error" for v in (r["variants"][spec] for spec in specs)]
            lines.append(f"| {r['T']} | {r['experts_ms']:.4f} | " + " | ".join(cells) + " |")
    if res["rows"] and "owned_tp" in res["rows"][0]:
        lines += ["", f"TP rank 0 of {res['rows'][0]['owned_tp']}: its experts' pairs (others as expert -1) vs every pair "
                  "computed and masked vs all experts at TP 1 (ms; bits: owned pairs = the one-rank pairs, others 0)",
                  "| T | owned pairs | owned rank ms | masked all pairs ms | all experts TP 1 ms | masked / owned | bits |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in res["rows"]:
            lines.append(f"| {r['T']} | {r['owned_pairs']} | {r['owned_rank_ms']:.4f} | {r['masked_all_pairs_ms']:.4f} | "
                         f"{r['all_experts_pairs_ms']:.4f} | {r['masked_all_pairs_ms'] / r['owned_rank_ms']:.2f} | "
                         f"{'equal' if r['owned_bits_equal'] else 'DIFF'} |")
    for r in res["rows"]:
        for engine, times in r.get("kernels_us", {}).items():
            top = sorted(times.items(), key=lambda kv: -kv[1])
            lines.append(f"T={r['T']} {engine}: {sum(times.values()):.1f} us in kernels: "
                         + ", ".join(f"{name[:40]} {us:.1f}" for name, us in top[:8]))
    return "\n".join(lines)


def plot(res: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    t = [r["T"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for key, label in (("consistent_ms", "consistent (route + grouped experts)"), ("stock_ms", "vLLM stock fused MoE"),
                       ("route_ms", "consistent: router + route"), ("floor_ms", "HBM floor (weights touched)")):
        if all(key in r for r in rows):
            ax.plot(t, [r[key] for r in rows], marker="o", label=label, linestyle="--" if key == "floor_ms" else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per forward")
    ax.set_ylabel("ms per MoE layer forward")
    ax.set_title(f"Qwen3-30B-A3B MoE layer ({res['layer']['dtype']}), {res['device']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="JSON path (the PNG goes next to it)")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--fp8", action="store_true", help="block-FP8 experts on both sides")
    ap.add_argument("--plot", type=Path, help="only redraw the PNG of an earlier JSON")
    ap.add_argument("--fp8-variants", nargs="*", default=[], help="with --fp8: flat|base[+tma][:BM:BN:warps] timed beside")
    ap.add_argument("--kernel-times", action="store_true", help="per-kernel device time of one forward per engine")
    ap.add_argument("--owned-tp", dest="owned_tp", type=int, default=0, choices=[0, 2, 4, 8],
                    help="also time TP rank 0's experts at this TP (bf16)")
    args = ap.parse_args()
    if args.plot:
        res = json.loads(args.plot.read_text())
        plot(res, args.plot.with_suffix(".png"))
        print(table(res))
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    if args.fp8_variants and not args.fp8:
        raise SystemExit("--fp8-variants needs --fp8")
    for spec in args.fp8_variants:
        _fp8_variant(spec)
    if args.owned_tp and args.fp8:
        raise SystemExit("--owned-tp: bf16 experts only (the engine refuses FP8 at TP > 1)")
    res = run(args.tokens, args.fp8, args.fp8_variants, args.kernel_times, args.owned_tp)
    print(table(res))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
        try:
            plot(res, args.out.with_suffix(".png"))
        except ImportError as e:
            print(f"(no PNG: {e})")


if __name__ == "__main__":
    main()

"""The Mamba-2 mixer's elementwise ops on CUDA: the torch evaluation of their contracts (the CUDA path until session
25: ``numerics.exp`` / ``log`` as float64 torch ops, dozens of launches an op) against the Triton kernels, bitwise
and timed in one run, with vLLM's own kernels beside them where vLLM is installed (other numerics: the stock path's
cost, not its bits).

    python benchmarks/bench_gpu_mamba_ops.py [--out benchmarks/results/mamba_ops_gpu.json]

Cases at Nemotron-H 8B's mixer widths (conv channels 10 240 = 8 192 + 2 x 8 x 128, kernel 4; gated norm over 8 192
channels in 8 groups; 128 heads for ``dt``): a prefill of 4 096 tokens and a decode step of 64 sequences.  Per op and
case: torch ms, Triton ms, their ratio, vLLM ms and Triton / vLLM where vLLM imports (the gated norm also timed with
the vectorised compilation, `SCALAR_LOADS_MAX_BLOCK = 0`), and the HBM floor (the bytes
the op must move at least -- operands read once, results written once -- over the measured copy bandwidth).  Timing:
``triton.testing.do_bench`` (CUDA events, median).  Exit status 1 if any Triton output differs from the torch one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_consistent.kernels.causal_conv1d import _causal_conv1d_cpu  # noqa: E402
from megatron_consistent.kernels.gated_rms_norm import _gated_rms_norm_cpu  # noqa: E402
from megatron_consistent.kernels.ssd import _mamba_dt_cpu  # noqa: E402
from megatron_consistent.kernels.triton.causal_conv1d import causal_conv1d_triton  # noqa: E402
from megatron_consistent.kernels.triton import gated_rms_norm as tgn  # noqa: E402
from megatron_consistent.kernels.triton.gated_rms_norm import gated_rms_norm_triton  # noqa: E402
from megatron_consistent.kernels.triton.mamba_dt import mamba_dt_triton  # noqa: E402

from bench_gpu_ssd import copy_bandwidth  # noqa: E402  (this folder, the script's own)

DEV = torch.device("cuda")
CONV, K, D_INNER, GROUP, H = 10240, 4, 8192, 1024, 128  # Nemotron-H 8B's mixer
EPS = 1e-5


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def vllm_ops():
    """vLLM's Mamba-2 kernels (prefill conv, decode conv update, gated RMSNorm), or None without vLLM."""
    try:
        from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
        from vllm.model_executor.layers.mamba.ops.layernorm_gated import rms_norm_gated
    except Exception as e:  # noqa: BLE001 -- any import failure means: no stock column
        print(f"vLLM's kernels not imported ({type(e).__name__}: {e}); no stock column", flush=True)
        return None
    return causal_conv1d_fn, causal_conv1d_update, rms_norm_gated


def timed(fn) -> float | str:
    try:
        return triton.testing.do_bench(fn)
    except Exception as e:  # noqa: BLE001 -- a stock call that fails is reported, not fatal
        return f"{type(e).__name__}: {str(e)[:120]}"


def conv_case(name: str, bsz: int, t_len: int, stock) -> dict:
    g = torch.Generator().manual_seed(t_len)
    x = torch.randn(bsz, t_len, CONV, generator=g).to(torch.bfloat16).to(DEV)
    w = (torch.randn(CONV, K, generator=g) * 0.3).to(DEV)
    b = torch.randn(CONV, generator=g).to(DEV)
    state = torch.randn(bsz, K - 1, CONV, generator=g).to(torch.bfloat16).to(DEV)
    ref, ours = _causal_conv1d_cpu(x, w, b, state, "silu"), causal_conv1d_triton(x, w, b, state, "silu")
    row = {"op": "causal_conv1d", "case": name, "bits_equal": all(torch.equal(u, v) for u, v in zip(ref, ours)),
           "torch_ms": timed(lambda: _causal_conv1d_cpu(x, w, b, state, "silu")),
           "triton_ms": timed(lambda: causal_conv1d_triton(x, w, b, state, "silu")),
           "floor_bytes": nbytes(x, w, b, state, *ours)}
    if stock:
        conv_fn, conv_update, _ = stock
        w, b = w.to(x.dtype), b.to(x.dtype)  # vLLM keeps the conv's parameters in the model dtype
        if t_len == 1:  # the decode step: a state per sequence, updated in place
            # vLLM's [lines, C, K-1] with its null block (line 0, skipped) first; vLLM 0.26 needs the indices
            cache = torch.cat([state[:1], state]).transpose(1, 2).contiguous()
            lines = torch.arange(1, bsz + 1, dtype=torch.int32, device=DEV)
            row["vllm_ms"] = timed(lambda: conv_update(x[:, 0], cache, w, b, "silu", conv_state_indices=lines))
        else:
            xt = x[0].t().contiguous()  # vLLM's [C, T] of the varlen batch
            qsl = torch.tensor([0, t_len], dtype=torch.int32, device=DEV)
            states = torch.zeros(1, CONV, K - 1, dtype=x.dtype, device=DEV)
            idx = torch.zeros(1, dtype=torch.int32, device=DEV)
            init = torch.zeros(1, dtype=torch.bool, device=DEV)
            row["vllm_ms"] = timed(lambda: conv_fn(xt, w, b, states, qsl, cache_indices=idx, has_initial_state=init,
                                                   activation="silu"))
    return row


def norm_case(name: str, rows: int, stock) -> dict:
    g = torch.Generator().manual_seed(rows)
    y, z = (torch.randn(rows, D_INNER, generator=g).to(torch.bfloat16).to(DEV) for _ in range(2))
    w = torch.randn(D_INNER, generator=g).to(DEV)
    ref, ours = _gated_rms_norm_cpu(y, z, w, GROUP, EPS), gated_rms_norm_triton(y, z, w, GROUP, EPS)
    row = {"op": "gated_rms_norm", "case": name, "bits_equal": torch.equal(ref, ours),
           "torch_ms": timed(lambda: _gated_rms_norm_cpu(y, z, w, GROUP, EPS)),
           "triton_ms": timed(lambda: gated_rms_norm_triton(y, z, w, GROUP, EPS)), "floor_bytes": nbytes(y, z, w, ours)}
    saved = tgn.SCALAR_LOADS_MAX_BLOCK  # the vectorised compilation for the group, beside (scheduling only)
    try:
        tgn.SCALAR_LOADS_MAX_BLOCK = 0
        row["bits_equal"] = row["bits_equal"] and torch.equal(gated_rms_norm_triton(y, z, w, GROUP, EPS), ours)
        row["triton_vectorised_ms"] = timed(lambda: gated_rms_norm_triton(y, z, w, GROUP, EPS))
    finally:
        tgn.SCALAR_LOADS_MAX_BLOCK = saved
    if stock:
        wb = w.to(torch.bfloat16)
        row["vllm_ms"] = timed(lambda: stock[2](y, wb, None, z=z, eps=EPS, group_size=GROUP, norm_before_gate=False))
    return row


def dt_case(name: str, rows: int) -> dict:
    g = torch.Generator().manual_seed(rows)
    dt_raw = (torch.randn(rows, H, generator=g) * 4).to(torch.bfloat16).to(DEV)
    bias = torch.randn(H, generator=g).to(DEV)
    args = (dt_raw, bias, 0.0, float("inf"))
    ref, ours = _mamba_dt_cpu(*args), mamba_dt_triton(*args)
    return {"op": "mamba_dt", "case": name, "bits_equal": torch.equal(ref, ours),
            "torch_ms": timed(lambda: _mamba_dt_cpu(*args)), "triton_ms": timed(lambda: mamba_dt_triton(*args)),
            "floor_bytes": nbytes(dt_raw, bias, ours)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/mamba_ops_gpu.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    bw = copy_bandwidth()
    stock = vllm_ops()
    cases = [lambda: conv_case("prefill 1 x 4096", 1, 4096, stock), lambda: conv_case("decode 64 x 1", 64, 1, stock),
             lambda: norm_case("prefill 4096 rows", 4096, stock), lambda: norm_case("decode 64 rows", 64, stock),
             lambda: dt_case("prefill 4096 rows", 4096), lambda: dt_case("decode 64 rows", 64)]
    rows = []
    for i, case in enumerate(cases):
        rows.append(case())
        r = rows[-1]
        r["floor_ms"] = r["floor_bytes"] / bw * 1e3
        print(f"[{i + 1}/{len(cases)}] {r['op']} {r['case']}: bits {'equal' if r['bits_equal'] else 'DIFFER'}",
              flush=True)

    def ms(v):
        return f"{v:.4f}" if isinstance(v, float) else "—"

    print("\n| op | case | torch ms | Triton ms | torch / Triton | vLLM ms | vLLM / Triton | HBM floor ms | floor / Triton "
          "| bits |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        t, s = r["triton_ms"], r.get("vllm_ms")
        ratio = f"{r['torch_ms'] / t:.1f}" if isinstance(r["torch_ms"], float) and isinstance(t, float) else "—"
        vs = f"{s / t:.2f}" if isinstance(s, float) and isinstance(t, float) else "—"
        floor = f"{r['floor_ms'] / t:.2f}" if isinstance(t, float) else "—"
        print(f"| {r['op']} | {r['case']} | {ms(r['torch_ms'])} | {ms(t)} | {ratio} | {ms(s)} | {vs} | "
              f"{r['floor_ms']:.4f} | {floor} | {'equal' if r['bits_equal'] else 'DIFFER'} |")
    for r in rows:
        if "triton_vectorised_ms" in r:
            print(f"gated_rms_norm {r['case']}: scalar-load compilation {ms(r['triton_ms'])} ms, vectorised "
                  f"{ms(r['triton_vectorised_ms'])} ms (SCALAR_LOADS_MAX_BLOCK {tgn.SCALAR_LOADS_MAX_BLOCK} / 0)")
    errors = [f"{r['op']} {r['case']}: {v}" for r in rows for k, v in r.items() if k.endswith("_ms") and isinstance(v, str)]
    for e in errors:
        print("failed:", e)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bw / 1e9, "rows": rows}, f, indent=1)
    print(f"results: {args.out}")
    return 0 if all(r["bits_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

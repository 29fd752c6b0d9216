"""The Mamba-2 SSD scan on CUDA: its outputs (contract steps 2-4) by the torch evaluation (the default) against the
fused Triton kernel (``MC_SSD_OUTPUTS=triton``, ``kernels/triton/ssd_outputs.py``), bitwise and timed in one run.

    python benchmarks/bench_gpu_ssd.py [--out benchmarks/results/ssd_gpu.json]

Cases at Nemotron-H 8B's mixer widths (128 heads x 64, 8 groups, state 128, chunk 128): a prefill of one sequence
(T = 1024 / 4096) and a decode step of 64 sequences (1 new token after 64 pending tokens of the chunk, so each replays
65 positions and outputs one).  Per case: the outputs step alone (the part the kernel replaces; the prefix sums and the
chunk states are torch ops in both) and the whole scan, each ratio = torch time / Triton time; the floor = the bytes
the outputs step must move at least (its float32 operands read once, its output written once) over the device's
measured copy bandwidth.  Timing: ``triton.testing.do_bench`` (CUDA
events, median), the torch path having host loops.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_consistent.kernels import ssd  # noqa: E402
from megatron_consistent.kernels.triton.ssd_outputs import ssd_outputs  # noqa: E402

DEV = torch.device("cuda")
H, P, G, N, L = 128, 64, 8, 128, 128  # Nemotron-H 8B's mixer


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (triton.testing.do_bench(lambda: dst.copy_(src)) * 1e-3)


def inputs(bsz: int, t_len: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(bsz, t_len, H, P, generator=g).to(torch.bfloat16)
    dt = torch.rand(bsz, t_len, H, generator=g) * 0.1 + 0.001
    a = -torch.rand(H, generator=g) * 4 - 0.5
    b, c = (torch.randn(bsz, t_len, G, N, generator=g).to(torch.bfloat16) for _ in range(2))
    d = torch.randn(H, generator=g)
    state = torch.randn(bsz, H, P, N, generator=g) * 0.1
    return [v.to(DEV) for v in (x, dt, a, b, c, d, state)]


def floor_bytes(ops, out: torch.Tensor) -> int:
    """The bytes the outputs step must move at least: each of its float32 operands read once, its output written once
    (HBM floor; its float32 arithmetic -- L x N + L x P + N x P products and sums a position and head -- is not in it)."""
    return sum(v.numel() * v.element_size() for v in ops) + out.numel() * out.element_size()


def run_case(name: str, bsz: int, t_len: int, first_out: int, bw: float) -> dict:
    x, dt, a, b, c, d, state = inputs(bsz, t_len)
    ops = ssd._ssd_chunk_states(x, dt, a, b, c, L, state)[:6]
    torch_out = ssd._ssd_outputs(*ops, d, first_out, t_len, torch.bfloat16)
    triton_out = ssd_outputs(*ops, d, first_out, t_len, torch.bfloat16)
    scan_torch, scan_triton = ssd.ssd_scan_by(ssd._ssd_outputs), ssd.ssd_scan_by(ssd_outputs)
    times = {
        "outputs torch": triton.testing.do_bench(lambda: ssd._ssd_outputs(*ops, d, first_out, t_len, torch.bfloat16)),
        "outputs triton": triton.testing.do_bench(lambda: ssd_outputs(*ops, d, first_out, t_len, torch.bfloat16)),
        "scan torch": triton.testing.do_bench(lambda: scan_torch(x, dt, a, b, c, d, L, state, first_out)),
        "scan triton": triton.testing.do_bench(lambda: scan_triton(x, dt, a, b, c, d, L, state, first_out)),
    }
    floor_ms = floor_bytes(ops, triton_out) / bw * 1e3
    return {"case": name, "batch": bsz, "T": t_len, "first_out": first_out, "ms": times, "floor_ms": floor_ms,
            "outputs_speedup": times["outputs torch"] / times["outputs triton"],
            "scan_speedup": times["scan torch"] / times["scan triton"],
            "triton_outputs_vs_floor": floor_ms / times["outputs triton"],
            "bits_equal": torch.equal(torch_out, triton_out)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/ssd_gpu.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    bw = copy_bandwidth()
    cases = [("prefill 1 x 1024", 1, 1024, 0), ("prefill 1 x 4096", 1, 4096, 0), ("decode 64 x (64 + 1)", 64, 65, 64)]
    rows = []
    for name, bsz, t_len, first_out in cases:
        rows.append(run_case(name, bsz, t_len, first_out, bw))
        r = rows[-1]
        print(f"{name:22s} outputs: torch {r['ms']['outputs torch']:8.3f} ms  triton {r['ms']['outputs triton']:8.3f} ms"
              f"  x{r['outputs_speedup']:6.1f}  floor {r['floor_ms']:.3f} ms ({r['triton_outputs_vs_floor']:.2f})"
              f"  | scan: x{r['scan_speedup']:5.2f}  bits {'equal' if r['bits_equal'] else 'DIFFER'}", flush=True)
    print("\n| case | outputs torch ms | outputs Triton ms | speedup | floor ms | Triton / floor | scan speedup | bits |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r['case']} | {r['ms']['outputs torch']:.3f} | {r['ms']['outputs triton']:.3f} | "
              f"{r['outputs_speedup']:.1f} | {r['floor_ms']:.3f} | {r['triton_outputs_vs_floor']:.2f} | "
              f"{r['scan_speedup']:.2f} | {'equal' if r['bits_equal'] else 'DIFFER'} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bw / 1e9, "widths":
                   {"H": H, "P": P, "G": G, "N": N, "chunk": L}, "rows": rows}, f, indent=1)
    print(f"results: {args.out}")
    return 0 if all(r["bits_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

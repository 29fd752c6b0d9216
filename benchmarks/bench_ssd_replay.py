"""Decode-step cost of the consistent SSD replay vs a plain recurrent update (CPU).

A consistent decode step (:func:`kernels.ssd_continue`) replays the partial chunk: the new
token's output is evaluated from the last chunk-boundary state and the ``p`` pending tokens
of its chunk (O(L*H*P) for the intra-chunk term + O(H*P*N) for the inter-chunk term), and
when the token completes a chunk the boundary state is rebuilt from the chunk (O(L*H*P*N)).
The stock decode is one recurrent update ``h = exp(dt A) h + dt x B^T; y = C.h + D x``
(O(H*P*N)).  Both are timed per token, averaged uniformly over the pending length
``p = 0..L-1`` (every position of a chunk is equally likely in a long decode); the
recurrent update is timed twice: stock torch ops (``torch.exp``/``einsum``) and the same
update built from the package's deterministic pieces (``numerics.exp``, ``tree_sum``).

    python benchmarks/bench_ssd_replay.py [--heads 8 --head-dim 32 --state 32 --chunks 16 64 128 --batch 1]

Prints JSON and a table; single-threaded (``torch.set_num_threads(1)``) for stable numbers.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from megatron_consistent.kernels import mamba_dt, ssd_continue
from megatron_consistent.kernels.numerics import exp, tree_sum


def best_time(fn, reps: int) -> float:
    """Minimum of ``reps`` timings of ``fn()`` (seconds), after two warm-up calls (robust to a loaded machine)."""
    fn()
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def recurrent_stock(h, x, dt, A, B, C, D):
    """One token, stock torch ops: h [b,H,P,N], x [b,H,P], dt [b,H], B/C [b,H,N] (heads already expanded)."""
    h = torch.exp(dt * A)[..., None, None] * h + torch.einsum("bhp,bhn->bhpn", dt[..., None] * x, B)
    return torch.einsum("bhpn,bhn->bhp", h, C) + D[:, None] * x, h


def recurrent_deterministic(h, x, dt, A, B, C, D):
    """One token from the package's deterministic pieces (elementwise float32, numerics.exp, tree_sum over N)."""
    h = exp(dt * A)[..., None, None] * h + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    return tree_sum(C[:, :, None, :] * h) + D[:, None] * x, h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--state", type=int, default=32)
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--chunks", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--pending-samples", type=int, default=16, help="pending lengths sampled evenly over 0..L-1")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    nb, nh, hp, ns, ng = args.batch, args.heads, args.head_dim, args.state, args.groups
    g = torch.Generator().manual_seed(0)
    A = -(torch.rand(nh, generator=g) * 7.5 + 0.5)
    D = torch.randn(nh, generator=g)
    state = torch.randn(nb, nh, hp, ns, generator=g)
    heads = torch.arange(nh) // (nh // ng)

    # The recurrent baselines do not depend on the chunk size.
    x1 = torch.randn(nb, nh, hp, generator=g).to(dtype).float()
    dt1 = mamba_dt(torch.randn(nb, nh, generator=g), torch.zeros(nh))
    b1 = torch.randn(nb, ng, ns, generator=g).to(dtype).float()[:, heads]
    c1 = torch.randn(nb, ng, ns, generator=g).to(dtype).float()[:, heads]
    t_stock = best_time(lambda: recurrent_stock(state, x1, dt1, A, b1, c1, D), args.reps)
    t_det = best_time(lambda: recurrent_deterministic(state, x1, dt1, A, b1, c1, D), args.reps)

    rows = []
    for L in args.chunks:
        tokens = L
        x = torch.randn(nb, tokens, nh, hp, generator=g).to(dtype)
        dt = mamba_dt(torch.randn(nb, tokens, nh, generator=g), torch.zeros(nh))
        B = torch.randn(nb, tokens, ng, ns, generator=g).to(dtype)
        C = torch.randn(nb, tokens, ng, ns, generator=g).to(dtype)
        n_samples = min(L, args.pending_samples)
        pendings = sorted({round(i * (L - 1) / max(n_samples - 1, 1)) for i in range(n_samples)})
        per_p = {}
        for p in pendings:
            pend = (x[:, :p], dt[:, :p], B[:, :p], C[:, :p])
            new = (x[:, p:p + 1], dt[:, p:p + 1], B[:, p:p + 1], C[:, p:p + 1])
            with torch.no_grad():
                per_p[p] = best_time(lambda: ssd_continue(state, pend, *new, A, D, L), args.reps)
        # Uniform average over p = 0..L-1: the non-completing steps (p < L-1) share the sampled mean of
        # p < L-1; the completing step (p = L-1, which rebuilds the boundary state) weighs 1/L.
        partial = [t for p, t in per_p.items() if p < L - 1]
        t_replay = (statistics.mean(partial) * (L - 1) + per_p[L - 1]) / L
        rows.append(dict(chunk=L, replay_ms=1e3 * t_replay, replay_min_p_ms=1e3 * per_p[0],
                         replay_max_partial_ms=1e3 * max(partial), completing_step_ms=1e3 * per_p[L - 1],
                         ratio_vs_stock_recurrent=t_replay / t_stock, ratio_vs_deterministic_recurrent=t_replay / t_det,
                         pending_lengths=pendings))
    result = dict(
        shape=dict(batch=nb, heads=nh, head_dim=hp, state=ns, groups=ng, dtype=args.dtype),
        threads=1, machine=platform.processor() or platform.machine(), torch=torch.__version__,
        recurrent_stock_ms=1e3 * t_stock, recurrent_deterministic_ms=1e3 * t_det, chunks=rows,
    )
    print(json.dumps(result, indent=1))
    print(f"\nshape b={nb} H={nh} P={hp} N={ns} G={ng} {args.dtype}; recurrent update: stock {1e3 * t_stock:.3f} ms, "
          f"deterministic {1e3 * t_det:.3f} ms per token")
    print(f"{'chunk':>6} {'replay ms/token':>16} {'p=0':>8} {'max p<L-1':>10} {'p=L-1':>8} {'x stock':>8} {'x determ.':>10}")
    for r in rows:
        print(f"{r['chunk']:>6} {r['replay_ms']:>16.3f} {r['replay_min_p_ms']:>8.3f} {r['replay_max_partial_ms']:>10.3f} "
              f"{r['completing_step_ms']:>8.3f} {r['ratio_vs_stock_recurrent']:>8.1f} {r['ratio_vs_deterministic_recurrent']:>10.1f}")


if __name__ == "__main__":
    main()

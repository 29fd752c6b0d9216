"""Causal GQA attention backward on the GPU: Triton flash-style kernel vs the materialised torch backward.

Times ``attention_bwd`` (kernels/triton/attention_bwd.py) for one shape, optionally sweeping
its tile configs, and the torch float32 materialised-softmax backward it replaces.

    python benchmarks/bench_gpu_attention_bwd.py [--seq 4096] [--heads 32] [--kv-heads 8] [--sweep]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from megatron_consistent.kernels import attention
from megatron_consistent.kernels import dispatch
from megatron_consistent.kernels.triton import attention_bwd as ab
from megatron_consistent.kernels.triton.attention import attention_fwd

DKDV = [(64, 64, 8, 2), (64, 64, 4, 2), (64, 64, 8, 3), (32, 128, 8, 2), (64, 128, 8, 2), (128, 64, 8, 2)]
DQ = [(64, 64, 8, 2), (64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 2), (64, 128, 8, 2)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--torch", action="store_true", help="also time the materialised torch backward")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    b, t, hq, hkv, d = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    q = torch.randn(b, t, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, t, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, t, hkv, d, device="cuda", dtype=torch.bfloat16)
    go = torch.randn_like(q)
    pos = torch.arange(t, device="cuda").expand(b, t).contiguous()
    klen = torch.full((b,), t, device="cuda")
    scale = d ** -0.5
    out, lse = attention_fwd(q, k, v, pos, klen, scale)
    flops_fwd = 4 * b * hq * d * t * t / 2  # causal
    res = {"shape": [b, t, hq, hkv, d], "fwd_ms": triton.testing.do_bench(lambda: attention_fwd(q, k, v, pos, klen, scale))}
    res["bwd_ms"] = triton.testing.do_bench(lambda: ab.attention_bwd(go, q, k, v, out, lse, pos, klen, scale))
    res["bwd_tflops"] = 2.5 * flops_fwd / res["bwd_ms"] / 1e9
    if args.sweep:
        res["dkdv"], res["dq"] = {}, {}
        for key, cfgs in (("dkdv", DKDV), ("dq", DQ)):
            for c in cfgs:
                kw = {"dkdv_cfg": c if key == "dkdv" else ab._DKDV_CFG, "dq_cfg": c if key == "dq" else ab._DQ_CFG}
                try:
                    res[key][str(c)] = triton.testing.do_bench(
                        lambda: ab.attention_bwd(go, q, k, v, out, lse, pos, klen, scale, **kw))
                except Exception as e:  # a tile that does not fit (shared memory, registers)
                    res[key][str(c)] = f"failed: {type(e).__name__}"
    if args.torch:
        fn = dispatch._IMPLEMENTATIONS.pop(("attention_backward", "cuda"))
        try:
            qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
            o = attention(qq, kk, vv, pos, klen)
            res["torch_bwd_ms"] = triton.testing.do_bench(lambda: torch.autograd.grad(o, (qq, kk, vv), go, retain_graph=True))
        finally:
            dispatch._IMPLEMENTATIONS[("attention_backward", "cuda")] = fn
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

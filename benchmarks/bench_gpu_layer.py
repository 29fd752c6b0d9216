"""One transformer layer on the GPU: consistent spec vs Megatron's stock local spec, side by side.

Rollout-like forward and training forward+backward tokens/s of a one-layer
``GPTModel`` (Llama-3-8B-shaped layer by default, small vocabulary so the layer
dominates), both built by this package from the same seed.  Prints a table and
writes JSON + markdown to ``benchmarks/results/``.  Needs CUDA and megatron-core.

    python benchmarks/bench_gpu_layer.py [--seq 4096] [--batch 1]
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch

from megatron_consistent.config import ArchConfig
from megatron_consistent.layers import (
    build_consistent_model,
    build_stock_gpt_model,
    compute_stock_token_logprobs,
    compute_token_logprobs,
)
from megatron_consistent.verify.metrics import format_table


def layer_arch(hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int) -> ArchConfig:
    return ArchConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": ffn,
        "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads, "max_position_embeddings": max(seq, 8192), "torch_dtype": "bfloat16",
    })


def timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    arch = layer_arch(args.hidden, args.heads, args.kv_heads, args.ffn, args.vocab, args.seq)
    ids = torch.randint(3, args.vocab, (args.batch, args.seq), device="cuda")
    tokens = args.batch * args.seq
    rows = []
    build_stock_gpt_model(arch, seed=0)  # initialises Megatron's process groups
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0)  # stock attention forks the CUDA RNG tracker even at dropout 0
    for name, build, logprobs in (("stock local spec", build_stock_gpt_model, compute_stock_token_logprobs),
                                  ("consistent spec", build_consistent_model, compute_token_logprobs)):
        model = build(arch, seed=0).cuda()

        def forward():
            with torch.no_grad():
                logprobs(model, ids)

        def train_step():
            model.zero_grad(set_to_none=True)
            (-logprobs(model, ids).mean()).backward()

        rows.append({"path": name, "forward_tok_s": tokens / timed(forward, args.iters),
                     "fwd_bwd_tok_s": tokens / timed(train_step, args.iters)})
        model = forward = train_step = None  # free the model before the next one is built
        torch.cuda.empty_cache()
    rows.append({"path": "ratio (consistent / stock)", "forward_tok_s": rows[1]["forward_tok_s"] / rows[0]["forward_tok_s"],
                 "fwd_bwd_tok_s": rows[1]["fwd_bwd_tok_s"] / rows[0]["fwd_bwd_tok_s"]})
    table = format_table(rows, ["path", "forward_tok_s", "fwd_bwd_tok_s"],
                         f"one layer (hidden {args.hidden}, heads {args.heads}/{args.kv_heads}, ffn {args.ffn}), "
                         f"batch {args.batch} x seq {args.seq}, bf16, {torch.cuda.get_device_name()}")
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.date.today().isoformat()
    (out / f"gpu_layer_{stamp}.json").write_text(json.dumps({"args": vars(args), "gpu": torch.cuda.get_device_name(), "rows": rows}, indent=2))
    (out / f"gpu_layer_{stamp}.md").write_text("```\n" + table + "\n```\n")


if __name__ == "__main__":
    main()

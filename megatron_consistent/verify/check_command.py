"""``megatron-consistent check`` arguments and entry point."""

from __future__ import annotations

import os
import sys

from .processes import ENGINE_TIMEOUT_S

_KEYS = ["hf_config", "num_prompts", "max_tokens", "temperature", "seed", "max_num_batched_tokens", "mode",
         "logprobs_mode", "out_dir", "json", "quantization", "kv_cache_dtype", "device", "block_size", "gpu_memory_utilization",
         "checkpoint", "prompts", "engine_args", "engine_tp", "trainer_tp", "trainer_pp", "trainer_dp", "trainer_ep", "trainer_sp",
         "trainer_cp", "engine_timeout_s"]


def add_arguments(p) -> None:
    from ..conversion.fp8 import QUANTIZATION_METHODS  # ~0.2 s: torch is imported with this package anyway

    p.add_argument("--config", help="YAML with CheckConfig fields (flags override it)")
    p.add_argument("--hf-config", dest="hf_config", help="folder with config.json, or the file (weights: random, seeded)")
    p.add_argument("--num-prompts", dest="num_prompts", type=int)
    p.add_argument("--max-tokens", dest="max_tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--max-num-batched-tokens", dest="max_num_batched_tokens", type=int, help="small values force chunked prefill")
    p.add_argument("--mode", choices=["consistent", "baseline", "both"])
    p.add_argument("--logprobs-mode", dest="logprobs_mode", choices=["processed", "raw"])
    p.add_argument("--out-dir", dest="out_dir")
    p.add_argument("--kv-cache-dtype", dest="kv_cache_dtype", choices=["auto", "fp8"], help="fp8: E4M3 KV cache (scale 1) in both engines")
    p.add_argument("--quantization", choices=QUANTIZATION_METHODS,
                   help="fp8: block-FP8 (E4M3, 128x128 weight blocks, dynamic 1x128 activations); nvfp4: NVFP4 weights (W4A16)")
    p.add_argument("--json", help="write the JSON report here (default: OUT_DIR/check.json)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"],
                   help="auto (default): engines and trainer on the GPU when one is visible (adds the stock VLLM_BATCH_INVARIANT=1 row)")
    p.add_argument("--block-size", dest="block_size", type=int, help="KV cache block size (CPU: multiple of 32; CUDA: 16/32/64/128)")
    p.add_argument("--gpu-memory-utilization", dest="gpu_memory_utilization", type=float)
    p.add_argument("--engine-timeout-s", dest="engine_timeout_s", type=float,
                   help=f"seconds one engine run may take (default {ENGINE_TIMEOUT_S:.0f}); past it the engine is killed with its processes")
    p.add_argument("--engine-tp", dest="engine_tp", type=int,
                   help="vLLM tensor_parallel_size of the engines (1, 2, 4 or 8 dividing what it cuts: heads, experts, a "
                        "hybrid's Mamba groups; default 1)")
    p.add_argument("--trainer-tp", dest="trainer_tp", type=int,
                   help="tensor-parallel size of the consistent Megatron recompute (1, 2, 4 or 8; default 1; >1: CPU gloo ranks)")
    p.add_argument("--trainer-pp", dest="trainer_pp", type=int,
                   help="pipeline-parallel size of the consistent Megatron recompute (default 1; >1: CPU gloo ranks)")
    p.add_argument("--trainer-dp", dest="trainer_dp", type=int,
                   help="data-parallel replicas of the consistent Megatron recompute, each with its share of the sequences "
                   "(default 1; >1: ranks)")
    p.add_argument("--trainer-ep", dest="trainer_ep", type=int,
                   help="expert-parallel size of the consistent Megatron recompute (MoE; divides trainer TP x DP; at "
                   "trainer TP > 1 with --trainer-sp; default 1)")
    p.add_argument("--trainer-cp", dest="trainer_cp", type=int,
                   help="context-parallel size of the consistent Megatron recompute (GPT models, dense or MoE; 1, 2 or 4: each "
                   "sequence's tokens over the CP ranks in Megatron's load-balanced layout; default 1; >1: ranks)")
    p.add_argument("--trainer-sp", dest="trainer_sp", action="store_true", default=None,
                   help="Megatron's sequence parallelism in the consistent recompute (trainer TP > 1)")
    p.add_argument("--checkpoint", help="your model: HF folder with config.json + safetensors (sharded or not) [+ tokenizer]; "
                   "trainer and engines run on its weights")
    p.add_argument("--engine-args", dest="engine_args",
                   help='JSON object of extra vLLM engine arguments for every engine, e.g. \'{"async_scheduling": false}\'')
    p.add_argument("--prompts", help='with --checkpoint: JSONL, one {"text": ...} or {"token_ids": [...]} per line '
                   "(default: built-in chat prompts through the tokenizer's chat template; token ids without a tokenizer)")


def validate(args):
    """Every input, before any work: settings, the model config, the output folder and the JSON path."""
    from .check import load_check_config
    from .inputs import hf_arch, output_dir, output_file

    cfg = load_check_config(args.config, **{k: getattr(args, k) for k in _KEYS})
    if cfg.hf_config or cfg.engine_tp > 1 or cfg.trainer_tp * cfg.trainer_pp * cfg.trainer_dp * cfg.trainer_ep \
            * cfg.trainer_cp > 1 or cfg.trainer_sp or cfg.kv_cache_dtype == "fp8":
        from ..config import builtin_model_dir
        from .check import check_layouts

        check_layouts(cfg, hf_arch(cfg.checkpoint or cfg.hf_config or builtin_model_dir()))  # TP, FP8 KV refusals
    if cfg.checkpoint:  # the folder, its config and its index here; every tensor and the prompts before any engine starts
        from pathlib import Path

        from ..conversion.hf import _checkpoint_files
        from .user_prompts import read_prompt_file

        if not Path(cfg.checkpoint).is_dir():
            raise FileNotFoundError(f"--checkpoint {cfg.checkpoint!r}: no such folder")
        hf_arch(cfg.checkpoint)
        _checkpoint_files(Path(cfg.checkpoint))
        if cfg.prompts:
            read_prompt_file(cfg.prompts)
    output_dir("--out-dir", cfg.out_dir)
    path = output_file("--json", cfg.json or os.path.join(cfg.out_dir, "check.json"))
    return cfg, path


def run(args) -> int:
    from .check import render, run_check, write_report
    from .inputs import FAILURES, one_line

    cfg, path = validate(args)  # bad input: ValueError / OSError -> exit 2, nothing started
    report: dict = {}
    try:
        run_check(cfg, report, before_engine=lambda: write_report(report, path))
    except FAILURES as e:  # noqa: BLE001 - a later stage failed: the report keeps what was measured, plus the error
        if report.get("stage") == "prepare" and isinstance(e, (ValueError, OSError)):
            raise  # bad input found while preparing (a checkpoint's tensors, the prompts): no engine started, exit 2
        report.pop("stage", None)
        report["error"] = f"{type(e).__name__}: {one_line(e)}"
        report["zero_mismatch"] = False
        write_report(report, path)
        print(f"megatron-consistent check: failed: {report['error']}\nreport: {path}", file=sys.stderr)
        return 1
    print(render(report))
    write_report(report, path)
    print(f"report: {path}")
    return 1 if "consistent" in report and not report["zero_mismatch"] else 0

"""Command line: ``megatron-consistent check`` (and the diagnostics commands)."""

from __future__ import annotations

import argparse
import os
import sys


def _add_check(sub) -> None:
    p = sub.add_parser("check", help="rollout (vLLM) vs recompute (Megatron) log-probs: zero mismatch end to end")
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
    p.add_argument("--json", help="write the JSON report here (default: OUT_DIR/check.json)")


def _run_check(args) -> int:
    from .verify.check import load_check_config, render, run_check, write_report

    keys = ["hf_config", "num_prompts", "max_tokens", "temperature", "seed", "max_num_batched_tokens", "mode", "logprobs_mode", "out_dir", "json"]
    cfg = load_check_config(args.config, **{k: getattr(args, k) for k in keys})
    report = run_check(cfg)
    print(render(report))
    path = cfg.json or os.path.join(cfg.out_dir, "check.json")
    write_report(report, path)
    print(f"report: {path}")
    if "consistent" in report and not report["zero_mismatch"]:
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(prog="megatron-consistent", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_check(sub)
    args = parser.parse_args(argv)
    try:
        return {"check": _run_check}[args.command](args)
    except (ValueError, FileNotFoundError) as e:  # bad input: a clear message, no traceback
        print(f"megatron-consistent {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

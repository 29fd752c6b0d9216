"""``megatron-consistent gates`` arguments and entry point (exit code 1 when a gate fails, 2 on bad input)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def add_arguments(p) -> None:
    p.add_argument("--hf-config", dest="hf_config", default="", help="folder with config.json, or the file (default: built-in tiny model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="", help="comma-separated gate ids to run (others: skip), e.g. C0,C1,C6")
    p.add_argument("--num-prompts", dest="num_prompts", type=int, default=16, help="C5 check prompts")
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=16, help="C5 check tokens per prompt")
    p.add_argument("--max-num-batched-tokens", dest="max_num_batched_tokens", type=int, default=32)
    p.add_argument("--out-dir", dest="out_dir", default="runs/gates")
    p.add_argument("--json", default="", help="write the JSON report here (default: OUT_DIR/gates.json)")


def run(args) -> int:
    from .gates import GATES, GatesConfig, render, run_all

    only = [x.strip().upper() for x in args.only.split(",") if x.strip()]
    unknown = sorted(set(only) - {g.id for g in GATES})
    if unknown:
        raise ValueError(f"unknown gate ids {unknown}; known: {', '.join(g.id for g in GATES)}")
    cfg = GatesConfig(hf_config=args.hf_config, seed=args.seed, out_dir=args.out_dir, json=args.json, only=only,
                      num_prompts=args.num_prompts, max_tokens=args.max_tokens, max_num_batched_tokens=args.max_num_batched_tokens)
    report = run_all(cfg)
    print(render(report))
    path = cfg.json or os.path.join(cfg.out_dir, "gates.json")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1))
    print(f"report: {path}")
    return 0 if report["passed"] else 1

"""``megatron-consistent gates`` arguments and entry point (exit code 1 when a gate fails, 2 on bad input)."""

from __future__ import annotations

import json
import os


def add_arguments(p) -> None:
    p.add_argument("--hf-config", dest="hf_config", default="", help="folder with config.json, or the file (default: built-in tiny model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="", help="comma-separated gate ids to run (others: skip), e.g. C0,C1,C6")
    p.add_argument("--num-prompts", dest="num_prompts", type=int, default=16, help="C5 check prompts")
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=16, help="C5 check tokens per prompt")
    p.add_argument("--max-num-batched-tokens", dest="max_num_batched_tokens", type=int, default=32)
    p.add_argument("--out-dir", dest="out_dir", default="runs/gates")
    p.add_argument("--json", default="", help="write the JSON report here (default: OUT_DIR/gates.json)")


def validate(args):
    """Every input, before any gate runs: ids, numbers, the model config, the output folder and the JSON path."""
    from .gates import GATES, GatesConfig
    from .inputs import hf_arch, integer, output_dir, output_file

    only = [x.strip().upper() for x in args.only.split(",") if x.strip()]
    unknown = sorted(set(only) - {g.id for g in GATES})
    if unknown:
        raise ValueError(f"unknown gate ids {unknown}; known: {', '.join(g.id for g in GATES)}")
    for flag, value in (("--num-prompts", args.num_prompts), ("--max-tokens", args.max_tokens),
                        ("--max-num-batched-tokens", args.max_num_batched_tokens)):
        integer(flag, value)
    integer("--seed", args.seed, 0)
    if args.hf_config:
        hf_arch(args.hf_config)
    output_dir("--out-dir", args.out_dir)
    path = output_file("--json", args.json or os.path.join(args.out_dir, "gates.json"))
    cfg = GatesConfig(hf_config=args.hf_config, seed=args.seed, out_dir=args.out_dir, json=args.json, only=only,
                      num_prompts=args.num_prompts, max_tokens=args.max_tokens, max_num_batched_tokens=args.max_num_batched_tokens)
    return cfg, path


def run(args) -> int:
    from .gates import render, run_all
    from .inputs import FAILURES, one_line

    cfg, path = validate(args)  # bad input: exit 2, no gate started
    try:
        report = run_all(cfg)
    except FAILURES as e:  # noqa: BLE001 - recorded in the report, which is written anyway
        report = {"gates": [], "passed": False, "seconds": 0.0, "error": f"{type(e).__name__}: {one_line(e)}", "settings": vars(args) | {}}
    print(render(report))
    path.write_text(json.dumps(report, indent=1, default=str))
    print(f"report: {path}")
    return 0 if report["passed"] else 1

"""``megatron-consistent diagnose`` arguments and entry point.

Exit code: 0 when every captured op is bitwise equal, 1 when a divergence was
found (named in the table and the JSON), 2 on bad input.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def _ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    p = Path(text)
    if p.is_file():
        return [int(x) for x in json.loads(p.read_text())]
    return [int(x) for x in text.replace(",", " ").split()]


def add_arguments(p) -> None:
    src = p.add_argument_group("request (one of)")
    src.add_argument("--check-dir", dest="check_dir", help="a check run's --out-dir: diagnose its first mismatching request")
    src.add_argument("--request-index", dest="request_index", type=int, help="with --check-dir: this request instead")
    src.add_argument("--request", help="JSON file {\"prompt\": [...], \"response\": [...]}")
    src.add_argument("--prompt", help="token ids, comma separated (or a JSON list file)")
    src.add_argument("--response", help="token ids, comma separated (or a JSON list file)")
    p.add_argument("--model-dir", dest="model_dir", help="HF folder (config.json + safetensors); default: --check-dir/model")
    p.add_argument("--hf-config", dest="hf_config", help="no weights: build seeded random weights for this config and export them")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-batched-tokens", dest="max_num_batched_tokens", type=int)
    p.add_argument("--inject-fault", dest="fault", default="", help="testing: e.g. layer1.o_proj (replaced by a plain matmul in vLLM only)")
    p.add_argument("--out-dir", dest="out_dir", default="runs/diagnose")
    p.add_argument("--json", help="write the JSON report here (default: OUT_DIR/diagnose.json)")


def run(args) -> int:
    from .diagnose import DiagnoseConfig, render, request_from_check_dir, run_diagnose

    settings: dict = {}
    if args.check_dir:
        prompt, response, settings = request_from_check_dir(args.check_dir, args.request_index)
        model_dir = args.model_dir or str(Path(args.check_dir) / "model")
    else:
        if args.request:
            r = json.loads(Path(args.request).read_text())
            prompt, response = r["prompt"], r["response"]
        else:
            prompt, response = _ids(args.prompt), _ids(args.response)
        if not prompt or not response:
            raise ValueError("give --check-dir, --request FILE, or both --prompt and --response")
        model_dir = args.model_dir
        if not model_dir:
            from ..config import ArchConfig, load_hf_config
            from ..conversion import export_hf
            from ..layers import build_consistent_model
            from ..config import builtin_model_dir

            arch = ArchConfig.from_hf(load_hf_config(args.hf_config or builtin_model_dir()))
            model_dir = str(Path(args.out_dir) / "model")
            export_hf(build_consistent_model(arch, seed=args.seed), arch, model_dir)
    kw = {k: settings[k] for k in ("max_num_batched_tokens", "block_size", "max_model_len") if k in settings}
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    cfg = DiagnoseConfig(prompt=list(prompt), response=list(response), model_dir=model_dir, out_dir=args.out_dir,
                         seed=settings.get("seed", args.seed), fault=args.fault, **kw)
    report = run_diagnose(cfg)
    report["source"] = settings
    print(render(report))
    path = args.json or os.path.join(args.out_dir, "diagnose.json")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1))
    print(f"report: {path}")
    return 0 if report["first_divergence"] is None else 1

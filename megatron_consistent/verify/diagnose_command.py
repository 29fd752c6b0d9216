"""``megatron-consistent diagnose`` arguments and entry point.

Exit code: 0 when every captured op is bitwise equal, 1 when a divergence was
found (named in the table and the JSON), 2 on bad input.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _ids(flag: str, text: str | None) -> list[int] | None:
    if text is None:
        return None
    p = Path(text)
    if p.is_file():
        try:
            values = json.loads(p.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{flag} {text!r}: not a JSON list of token ids ({e})") from None
        if not isinstance(values, list):
            raise ValueError(f"{flag} {text!r}: expected a JSON list of token ids")
    else:
        values = text.replace(",", " ").split()
    return _token_list(flag, values)


def _token_list(flag: str, values) -> list[int]:
    out = []
    for v in values:
        try:
            i = int(v) if not isinstance(v, (bool, float)) else None
        except ValueError:
            i = None
        if i is None or i < 0:
            raise ValueError(f"{flag}: token ids must be integers >= 0, got {v!r}")
        out.append(i)
    return out


def add_arguments(p) -> None:
    from .inputs import DEVICES

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
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="auto (default): the engine and the Megatron model on the GPU where one is visible, else the CPU")
    p.add_argument("--inject-fault", dest="fault", default="", help="testing: e.g. layer1.o_proj (replaced by a plain matmul in vLLM only)")
    p.add_argument("--out-dir", dest="out_dir", default="runs/diagnose")
    p.add_argument("--json", help="write the JSON report here (default: OUT_DIR/diagnose.json)")


def validate(args) -> dict:
    """Every input, before any work: the request, token ids against the vocabulary, numbers, the model or config,
    the output folder and the JSON path."""
    from ..config import builtin_model_dir
    from .diagnose import check_dir_model
    from .inputs import hf_arch, input_file, integer, output_dir, output_file, resolve_device

    resolve_device(args.device, "diagnose")
    integer("--seed", args.seed, 0)
    if args.max_num_batched_tokens is not None:
        integer("--max-num-batched-tokens", args.max_num_batched_tokens)
    if args.request_index is not None:
        integer("--request-index", args.request_index, 0)
    if args.model_dir:
        arch = hf_arch(input_file("--model-dir config", Path(args.model_dir) / "config.json"))
    else:
        arch = hf_arch(args.hf_config or builtin_model_dir())
    prompt = response = None
    if args.check_dir:
        for name in ("consistent.request.json", "consistent.result.json"):
            input_file("--check-dir", Path(args.check_dir) / "engines" / name)
        if not args.model_dir:
            arch = hf_arch(input_file("--check-dir model config", check_dir_model(args.check_dir) / "config.json"))
    elif args.request:
        try:
            r = json.loads(input_file("--request", args.request).read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"--request {args.request!r}: not JSON ({e})") from None
        if not isinstance(r, dict) or not {"prompt", "response"} <= r.keys():
            raise ValueError(f"--request {args.request!r}: expected {{\"prompt\": [...], \"response\": [...]}}")
        prompt, response = _token_list("--request prompt", r["prompt"]), _token_list("--request response", r["response"])
    else:
        prompt, response = _ids("--prompt", args.prompt), _ids("--response", args.response)
    if not args.check_dir:
        if not prompt or not response:
            raise ValueError("give --check-dir, --request FILE, or both --prompt and --response (non-empty)")
        bad = [t for t in prompt + response if t >= arch.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:8]} are outside the vocabulary (vocab_size {arch.vocab_size})")
    output_dir("--out-dir", args.out_dir)
    path = output_file("--json", args.json or os.path.join(args.out_dir, "diagnose.json"))
    return {"arch": arch, "prompt": prompt, "response": response, "json": path}


def run(args) -> int:
    from .diagnose import DiagnoseConfig, check_dir_model, render, request_from_check_dir, run_diagnose
    from .inputs import FAILURES, one_line

    v = validate(args)  # bad input: exit 2, nothing started
    path, report = v["json"], {}
    try:
        settings: dict = {}
        if args.check_dir:
            prompt, response, settings = request_from_check_dir(args.check_dir, args.request_index, args.device)
            model_dir = args.model_dir or str(check_dir_model(args.check_dir))
        else:
            prompt, response = v["prompt"], v["response"]
            model_dir = args.model_dir
            if not model_dir:
                from ..conversion import export_hf
                from ..layers import build_consistent_model

                model_dir = str(Path(args.out_dir) / "model")
                export_hf(build_consistent_model(v["arch"], seed=args.seed), v["arch"], model_dir)
        kw = {k: settings[k] for k in ("max_num_batched_tokens", "block_size", "max_model_len") if k in settings}
        if args.max_num_batched_tokens is not None:
            kw["max_num_batched_tokens"] = args.max_num_batched_tokens
        cfg = DiagnoseConfig(prompt=list(prompt), response=list(response), model_dir=model_dir, out_dir=args.out_dir,
                             seed=settings.get("seed", args.seed), fault=args.fault, device=args.device, **kw)
        report = run_diagnose(cfg)
        report["source"] = settings
    except FAILURES as e:  # noqa: BLE001 - recorded in the report, which is written anyway
        report["error"] = f"{type(e).__name__}: {one_line(e)}"
        path.write_text(json.dumps(report, indent=1, default=str))
        print(f"megatron-consistent diagnose: failed: {report['error']}\nreport: {path}", file=sys.stderr)
        return 1
    print(render(report))
    path.write_text(json.dumps(report, indent=1))
    print(f"report: {path}")
    return 0 if report["first_divergence"] is None else 1

"""Zero mismatch at the shapes users run: ``megatron-consistent check --device cuda`` on the rollout benchmark's shapes.

The built-in tiny models run every code path, but only at small GEMM, attention and vocabulary shapes: the tiles, M
classes, row-parallel tree schedules and grouped-GEMM tiles the GPU kernels pick for a 1B / 8B Llama or for
Qwen3-30B-A3B's MoE layers are only proven bit-equal kernel by kernel (``tests/test_gpu_*.py``).  Here the whole
check (the plugin's engine, compiled with CUDA graphs, against the Megatron-Core recompute on the same GPU) runs on
random models of ``bench_rollout_gpu.SHAPES`` (the same table; ``--layers`` keeps fewer layers: the widths pick
the kernels, the depth does not), with prompts long enough and a batched-token budget large enough that the engine's
prefill runs the large-M classes, its decode steps the small ones, and the trainer's recompute yet another M.

One ``check`` process per shape (GPU memory freed in between; a hung check cut by ``--timeout`` with the engine
processes it started); FP8 shapes (b8, d8) pass ``--quantization fp8``.  Prints one table row per shape, writes the
JSON (every shape's report inside); exit 0 only when every shape gave zero mismatch.  ``--device cpu`` runs the same on vLLM's CPU platform (a smoke
run of the script with small settings; the GPU kernels are what it is for).

    python benchmarks/check_shapes_gpu.py --shapes a b d b8 d8 --layers 4 --out benchmarks/results/check_shapes.json
    python benchmarks/check_shapes_gpu.py --shapes h --layers 4       # Nemotron-H 8B's widths: Mamba-2 + attention + MLP
    python benchmarks/check_shapes_gpu.py --shapes b d --layers 4 --engine-tp 2 --trainer-tp 2   # two GPUs (issue #19)

``--engine-tp`` / ``--trainer-tp`` pass through to ``check`` (its refusals apply: FP8 at TP > 1 is refused by name).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_rollout_gpu import SHAPES, write_model  # noqa: E402

from megatron_consistent.verify.processes import run_group  # noqa: E402

COLUMNS = ("shape", "layers", "quantization", "engine_tp", "trainer_tp", "tokens", "max_abs", "exact_fraction",
           "routing_agreement", "gen_tokens_per_s", "wall_s")


def shape_dims(key: str, layers: int) -> dict:
    """The model dimensions of shape ``key``, with ``layers`` decoder layers (0: the shape's own).  A hybrid keeps
    every kind of its layers: a Mamba-2 mixer, attention and an MLP first (``M*-``), then Mamba / MLP pairs."""
    dims = dict(SHAPES[key]["model"])
    if layers:
        dims["num_hidden_layers"] = layers
        if "hybrid_override_pattern" in dims:
            if layers < 3:
                raise SystemExit(f"--layers {layers}: shape {key} is a hybrid, its Mamba-2, attention and MLP layers "
                                 "need at least 3")
            dims["hybrid_override_pattern"] = "M*-" + ("M-" * layers)[: layers - 3]
    return dims


def check_settings(args) -> dict:
    """The ``CheckConfig`` fields every shape's check runs with (a YAML passed by ``--config``)."""
    return {"num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "min_prompt_len": args.min_prompt_len,
            "max_prompt_len": args.max_prompt_len, "max_model_len": args.max_prompt_len + args.max_tokens,
            "max_num_batched_tokens": args.max_num_batched_tokens, "block_size": args.block_size,
            "recompute_batch": args.recompute_batch, "mode": "consistent", "device": args.device,
            "gpu_memory_utilization": args.gpu_memory_utilization}


def run_shape(key: str, args, work: Path) -> dict:
    """One ``check`` process on shape ``key``: its table row, with the check's report under ``report``."""
    folder = work / f"model-{key}"
    settings = check_settings(args)
    dims = shape_dims(key, args.layers)
    # bf16 config: the check quantizes (--quantization) itself
    write_model(folder, dims, settings["max_model_len"], row_parallel_segments=args.row_parallel_segments)
    config = work / f"check-{key}.yaml"
    config.write_text(json.dumps(settings))  # JSON is YAML
    report_path = work / f"check-{key}.json"
    report_path.unlink(missing_ok=True)  # a report left in --work by an earlier run must not pass for this one
    quantization = SHAPES[key].get("quantization", "")
    cmd = [sys.executable, "-m", "megatron_consistent.cli", "check", "--config", str(config), "--hf-config", str(folder),
           "--out-dir", str(work / f"run-{key}"), "--json", str(report_path)]
    if quantization:
        cmd += ["--quantization", quantization]
    cmd += ["--engine-tp", str(args.engine_tp), "--trainer-tp", str(args.trainer_tp)]
    log = work / f"check-{key}.log"
    row = {"shape": key, "layers": dims["num_hidden_layers"], "quantization": quantization or "bf16",
           "engine_tp": args.engine_tp, "trainer_tp": args.trainer_tp}
    start = time.perf_counter()
    rc = run_group(cmd, log, args.timeout)  # None: timed out; the check and its engines were killed
    row["wall_s"] = round(time.perf_counter() - start, 1)
    row["rc"] = rc
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    consistent = report.get("consistent", {})
    row.update({k: consistent[k] for k in COLUMNS if k in consistent})
    row["zero_mismatch"] = bool(report.get("zero_mismatch"))
    if "first_divergence" in consistent:
        row["first_divergence"] = consistent["first_divergence"]
    if not row["zero_mismatch"]:
        row["log_tail"] = log.read_text().splitlines()[-12:]
    row["report"] = report
    return row


def render(rows: list[dict]) -> str:
    """The readable table."""
    lines = ["  ".join(f"{c:>17}" for c in COLUMNS) + "  result"]
    for r in rows:
        cells = []
        for c in COLUMNS:
            v = r.get(c, "—")
            cells.append(f"{v:>17.6g}" if isinstance(v, float) else f"{v!s:>17}")
        verdict = "ZERO MISMATCH" if r["zero_mismatch"] else ("timed out" if r["rc"] is None else f"MISMATCH / rc {r['rc']}")
        lines.append("  ".join(cells) + "  " + verdict)
        for line in r.get("log_tail", []):
            lines.append(f"    | {line[:200]}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["a", "b", "d", "b8", "d8"], choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=0, help="decoder layers of every shape (0: the shape's own)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-prompt-len", type=int, default=64)
    ap.add_argument("--max-prompt-len", type=int, default=960)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="the engine's prefill chunk budget (large: prefill at large M; decode batches stay small)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--recompute-batch", type=int, default=8, help="sequences per trainer forward")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: a smoke run of this script on vLLM's CPU platform (block size a multiple of 32)")
    ap.add_argument("--engine-tp", type=int, default=1, help="the engine's tensor_parallel_size (one GPU a rank)")
    ap.add_argument("--trainer-tp", type=int, default=1, help="the Megatron recompute's TP size (NCCL ranks, one GPU each)")
    ap.add_argument("--row-parallel-segments", type=int, default=8, metavar="S",
                    help="the models' row-parallel K segments (consistent_row_parallel_segments: 1, 2, 4 or 8)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one shape's check may take")
    ap.add_argument("--out", default="benchmarks/results/check_shapes_gpu.json")
    ap.add_argument("--work", default="", help="folder for models, logs and reports (default: a temporary one)")
    args = ap.parse_args()
    if args.layers < 0:
        raise SystemExit(f"--layers {args.layers}: must be >= 0")
    for key in args.shapes:  # a hybrid with too few layers is refused here, before any shape runs
        shape_dims(key, args.layers)
    from megatron_consistent.config import row_parallel_refusal

    for tp in (args.engine_tp, args.trainer_tp):
        if row_parallel_refusal(args.row_parallel_segments, tp):
            raise SystemExit(f"--row-parallel-segments: {row_parallel_refusal(args.row_parallel_segments, tp)}")
    if args.min_prompt_len > args.max_prompt_len:
        raise SystemExit(f"--min-prompt-len {args.min_prompt_len} > --max-prompt-len {args.max_prompt_len}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # fail on a bad path before any work
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for key in args.shapes:
            print(f"[{key}] check on {SHAPES[key]['model'].get('model_type', 'llama')} shape, "
                  f"{shape_dims(key, args.layers)['num_hidden_layers']} layers ...", flush=True)
            rows.append(run_shape(key, args, work))
            print(render(rows[-1:]), flush=True)
            Path(args.out).write_text(json.dumps({"settings": vars(args) | {"check": check_settings(args)}, "shapes": rows},
                                                 indent=1))  # kept if a later shape is cut short
    print("\n" + render(rows))
    print(f"results: {args.out}")
    return 0 if rows and all(r["zero_mismatch"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

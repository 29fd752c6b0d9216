"""GRPO on a tiny model with a LIVE vLLM engine whose weights are updated in place after every step.

    python examples/grpo_tiny.py                       # both modes, default settings, runs/grpo
    python examples/grpo_tiny.py --mode consistent --steps 15 --out runs/grpo
    python examples/grpo_tiny.py --restore runs/grpo   # continue from the checkpoints a previous run saved
    python examples/grpo_tiny.py --device cuda --mode consistent --out runs/grpo_cuda   # engine + trainer on one GPU
    python examples/grpo_tiny.py --mode consistent --quantization fp8 --out runs/grpo_fp8   # block-FP8 rollouts

Modes: ``consistent`` (vLLM with the megatron-consistent plugin + Megatron with
the consistent spec) and ``baseline`` (stock vLLM + Megatron's stock local
spec); ``both`` runs each in its own fresh process (the plugin switch is
process-wide).  Per mode: one engine for the whole run; each step samples
``--group`` answers for each of ``--prompts`` prompts, scores them
(:class:`megatron_consistent.rl.toy_task.ModTask`), recomputes the sampled
tokens' log-probs with the trainer at the same weight version, records the
mismatch, takes one clipped-GRPO AdamW step and pushes the new weights into
the engine through shared memory (:mod:`megatron_consistent.sync`).

``--device cuda`` puts the engine (vLLM CUDA, ``gpu_memory_utilization`` 0.3, compiled + CUDA graphs for
the dense model) and the trainer on the same GPU; the trainer steps with Megatron-Core's own optimizer
(``get_megatron_optimizer``, distributed optimizer, over Megatron ``DistributedDataParallel`` in a
one-rank NCCL group) and its checkpoint holds the model and the optimizer in ``dist_checkpointing``
(``--restore`` loads both from there).  ``--device cpu`` (default) uses the CPU stand-in optimizer
(:mod:`megatron_consistent.training` says why Megatron's cannot run on CPU).

``--quantization fp8|nvfp4`` (``--mode consistent`` only): the engine serves block-FP8 (W8A8) / NVFP4 (W4A16)
weights, the trainer runs its quantized forward on its bf16 masters and every push sends the quantized values and
scales of the updated masters (:class:`megatron_consistent.rl.session.RLSession`); checkpoints hold the masters.

Writes ``OUT/metrics.json`` (one record per step and mode), ``OUT/metrics.csv``,
``OUT/curves.png`` and per mode ``OUT/<mode>/checkpoint`` (model, optimizer,
HF export; ``--restore`` reads it).
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

MODES = ("consistent", "baseline")
CSV_COLUMNS = ["mode", "quantization", "device", "step", "version", "reward", "max_abs", "mean_abs", "std", "k3", "exact_fraction", "bitwise_equal",
               "sync_bytes", "sync_seconds", "sync_gbytes_per_s", "pointers_unchanged", "trainer_pointers_unchanged",
               "sample_seconds", "train_seconds", "step_seconds"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("consistent", "baseline", "both"), default="both")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--out", default="runs/grpo")
    ap.add_argument("--restore", default=None, help="folder of a previous run (its <mode>/checkpoint or checkpoint) or a checkpoint folder")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="GRPO group size (samples per prompt)")
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the trainer runs (cuda: with Megatron's distributed optimizer, beside the engine on one GPU)")
    from megatron_consistent.conversion.fp8 import QUANTIZATION_METHODS

    ap.add_argument("--quantization", choices=QUANTIZATION_METHODS, default=None,
                    help="quantized rollouts (--mode consistent): block-FP8 / NVFP4 engine weights pushed from the bf16 masters")
    return ap.parse_args(argv)


def _restore_dir(restore: str | None, mode: str) -> Path | None:
    if not restore:
        return None
    p = Path(restore)
    for ckpt in (p / mode / "checkpoint", p / "checkpoint", p):  # a --mode both run, a one-mode run, a checkpoint
        if (ckpt / "manifest.json").is_file():
            return ckpt
    raise SystemExit(f"--restore {restore}: no {mode}/checkpoint/manifest.json, checkpoint/manifest.json or manifest.json there")


def run_mode(args, mode: str) -> list[dict]:
    """One mode in this process: session, steps, checkpoint; writes OUT/metrics.json for the mode."""
    import torch
    from tqdm import tqdm

    from megatron_consistent.config import ArchConfig
    from megatron_consistent.rl.session import RLSession
    from megatron_consistent.rl import TINY_RL_HF_CONFIG, ModTask

    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arch = ArchConfig.from_hf(TINY_RL_HF_CONFIG)
    restore = _restore_dir(args.restore, mode)
    t0 = time.perf_counter()
    session = RLSession(arch, mode, out / "work", seed=args.seed, lr=args.lr, restore_dir=restore, device=args.device,
                        quantization=args.quantization)
    start = session.start_step
    restore_check = None
    task = ModTask(arch.vocab_size, seed=args.seed)
    for _ in range(start):  # keep the prompt stream where the restored run left it
        task.prompts(args.prompts)
    records = []
    bar = tqdm(range(start, start + args.steps), desc=f"grpo[{mode}]", unit="step")
    try:
        if restore:  # the restored trainer against the weights it was saved with, and the engine started from it
            restore_check = {"trainer_equals_saved": session.weights_match_hf(restore / session.manifest["files"]["hf"])["equal"],
                             "engine_equals_trainer": session.weights_match_engine()["equal"] if mode == "consistent" else None}
        for step in bar:
            s0 = time.perf_counter()
            rec = session.grpo_step(task.prompts(args.prompts), args.group, args.max_tokens, task.reward)
            rec.update(step=step, device=args.device, step_seconds=time.perf_counter() - s0, restored_from=str(restore) if restore else None,
                       first_after_restore=bool(restore) and step == start)
            records.append(rec)
            bar.set_postfix(reward=f"{rec['reward']:.3f}", k3=f"{rec['k3']:.2e}", inplace=rec["pointers_unchanged"])
        tmp = out / "checkpoint.new"
        shutil.rmtree(tmp, ignore_errors=True)
        session.save(tmp, step=start + args.steps, extra={"last": records[-1] if records else None})
        ckpt = out / "checkpoint"
        shutil.rmtree(ckpt, ignore_errors=True)  # a restored run may overwrite the checkpoint it started from
        tmp.rename(ckpt)
    finally:
        session.close()
    summary = {"mode": mode, "device": args.device, "quantization": args.quantization, "optimizer": type(session.optimizer).__name__,
               "engine_start_seconds": session.engine_start_seconds, "seconds": time.perf_counter() - t0,
               "checkpoint": str(ckpt), "restored_from": str(restore) if restore else None, "restore_check": restore_check}
    (out / "metrics.json").write_text(json.dumps(records, indent=1))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return records


def write_outputs(out: Path, records: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(records, indent=1))
    with open(out / "metrics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(records)
    plot(records, out / "curves.png")


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_k) = plt.subplots(1, 2, figsize=(10, 3.8))
    styles = {"consistent": dict(color="tab:green", marker="o"), "baseline": dict(color="tab:red", marker="s")}
    for mode in MODES:
        rs = [r for r in records if r["mode"] == mode]
        if not rs:
            continue
        steps = [r["step"] for r in rs]
        ax_r.plot(steps, [r["reward"] for r in rs], label=mode, **styles[mode], ms=3)
        ax_k.plot(steps, [r["k3"] for r in rs], label=mode, **styles[mode], ms=3)
    ax_r.set(xlabel="step", ylabel="mean reward", title="reward (uniform policy: 0.25)")
    ax_k.set_yscale("symlog", linthresh=1e-9)
    ax_k.axhline(0, color="k", lw=0.5)
    ax_k.set(xlabel="step", ylabel="k3 (trainer vs rollout), symlog", title="rollout/trainer mismatch before each update")
    for ax in (ax_r, ax_k):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            from megatron_consistent.training import MEGATRON_OPTIMIZER_NEEDS_CUDA

            print(f"grpo_tiny: --device cuda: {MEGATRON_OPTIMIZER_NEEDS_CUDA}", file=sys.stderr)
            return 2
    if args.quantization and args.mode != "consistent":
        from megatron_consistent.rl.session import BASELINE_QUANTIZATION_REFUSAL

        print(f"grpo_tiny: --quantization {args.quantization} --mode {args.mode}: {BASELINE_QUANTIZATION_REFUSAL}", file=sys.stderr)
        return 2
    out = Path(args.out)
    t0 = time.perf_counter()
    if args.mode != "both":
        records = run_mode(args, args.mode)
        write_outputs(out, records)
    else:
        records = []
        for mode in MODES:  # a fresh process per mode: the plugin switch is process-wide
            cmd = [sys.executable, __file__, "--mode", mode, "--out", str(out / mode), "--steps", str(args.steps),
                   "--lr", str(args.lr), "--prompts", str(args.prompts), "--group", str(args.group),
                   "--max-tokens", str(args.max_tokens), "--seed", str(args.seed), "--device", args.device]
            if args.restore:
                cmd += ["--restore", str(_restore_dir(args.restore, mode))]
            rc = subprocess.call(cmd)
            if rc != 0:
                print(f"grpo_tiny: mode {mode} failed (exit {rc})", file=sys.stderr)
                return rc
            records += json.loads((out / mode / "metrics.json").read_text())
        write_outputs(out, records)
    seconds = time.perf_counter() - t0
    print(f"\n{'mode':<11}{'quant':>6}{'dev':>5}{'step':>5}{'reward':>8}{'max_abs':>11}{'k3':>11}{'exact':>7}{'sync_B':>9}{'sync_ms':>9}"
          f"{'inplace':>8}{'tr_ptr':>7}{'restored':>9}")
    for r in records:
        print(f"{r['mode']:<11}{r['quantization'] or '-':>6}{r['device']:>5}{r['step']:>5}{r['reward']:>8.3f}{r['max_abs']:>11.3e}{r['k3']:>11.3e}"
              f"{r['exact_fraction']:>7.3f}{r['sync_bytes']:>9}{1e3 * r['sync_seconds']:>9.1f}{str(r['pointers_unchanged']):>8}"
              f"{str(r['trainer_pointers_unchanged']):>7}{'first' if r['first_after_restore'] else '':>9}")
    print(f"wrote {out}/metrics.json, metrics.csv, curves.png in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The child process of the RL lifecycle checks C7 / C8 (:mod:`megatron_consistent.verify.lifecycle` runs
``python -m megatron_consistent.rl.lifecycle_scenarios KIND REQUEST.json RESULT.json``): the scenarios on a live
:class:`~.session.RLSession`, described in that module's docstring.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

from ..verify.lifecycle import LifecycleConfig


def _arch(cfg: LifecycleConfig):
    from ..config import ArchConfig, load_hf_config
    from .toy_task import TINY_RL_HF_CONFIG

    return ArchConfig.from_hf(load_hf_config(cfg.hf_config) if cfg.hf_config else TINY_RL_HF_CONFIG)


def _strip(check: dict) -> dict:
    return {k: v for k, v in check.items() if k not in ("tokens_sampled", "rollout_logprobs")}


def _bad_updates(tensors: dict, version: int, arch) -> list[tuple[str, dict, int, object]]:
    """(case, tensors, version, sender's ArchConfig) of refused pushes; every case carries weights that differ from
    the engine's.  The last fits every tensor but comes from another row-parallel tree width S."""
    import dataclasses

    import torch

    names = list(tensors)
    first, last = names[0], names[-1]
    cases = []
    missing = dict(tensors)
    missing.pop(last)
    cases.append(("missing tensor", missing, version + 1))
    cases.append(("extra tensor", {**tensors, "model.layers.99.mlp.extra.weight": torch.zeros(4, dtype=tensors[first].dtype)}, version + 1))
    misshaped = dict(tensors)
    misshaped[last] = torch.cat([tensors[last], tensors[last][:1]])
    cases.append(("mis-shaped tensor", misshaped, version + 1))
    wrong_dtype = dict(tensors)
    wrong_dtype[first] = tensors[first].float()
    cases.append(("wrong dtype", wrong_dtype, version + 1))
    cases.append(("stale version", dict(tensors), version))
    cases = [(case, t, v, arch) for case, t, v in cases]
    other = dataclasses.replace(arch, row_parallel_segments=4 if arch.row_parallel_segments == 8 else 8)
    cases.append(("another architecture", dict(tensors), version + 1, other))
    return cases


def _scenario_weight_update(cfg: LifecycleConfig) -> dict:
    import torch

    from ..conversion import hf_state_dict
    from ..sync.protocol import WeightSyncError
    from .session import RLSession
    from .toy_task import ModTask

    arch = _arch(cfg)
    session = RLSession(arch, "consistent", Path(cfg.out_dir) / "weight_update" / "work", seed=cfg.seed, lr=cfg.lr)
    try:
        task = ModTask(arch.vocab_size, seed=cfg.seed)
        steps, fails = [], []
        for i in range(cfg.steps):
            rec = session.grpo_step(task.prompts(cfg.prompts), cfg.group, cfg.max_tokens, task.reward)
            steps.append(rec)
            if not (rec["bitwise_equal"] and rec["exact_fraction"] == 1.0):
                fails.append(f"step {i}: mismatch before the update (max_abs {rec['max_abs']:.3e})")
            if not (rec["pointers_unchanged"] and rec["trainer_pointers_unchanged"]):
                fails.append(f"step {i}: parameter storage moved")
            if rec["engine_version"] != i + 1:
                fails.append(f"step {i}: engine reports version {rec['engine_version']}, expected {i + 1}")
        after = session.check_rollout(task.prompts(cfg.prompts), cfg.max_tokens)
        if not after["bitwise_equal"]:
            fails.append(f"first rollout after the last push: mismatch (max_abs {after['max_abs']:.3e})")
        rejections = []
        if cfg.rejections:
            with torch.no_grad():
                perturbed = {n: (t.float() + 0.01).to(t.dtype) for n, t in hf_state_dict(session.model, arch).items()}
            pointers = session.channel.engine_pointers()
            for case, tensors, version, sender in _bad_updates(perturbed, session.channel.version, arch):
                entry = {"case": case}
                try:
                    session.channel.push_tensors(tensors, version, arch=sender)
                    entry["refused"] = False
                except WeightSyncError as e:
                    entry["refused"], entry["error"] = True, str(e)[:400]
                entry["version_unchanged"] = session.channel.engine_version() == session.channel.version
                entry["pointers_unchanged"] = session.channel.engine_pointers() == pointers
                chk = session.check_rollout(task.prompts(cfg.prompts), cfg.max_tokens)
                entry["old_weights_served"] = chk["bitwise_equal"]
                entry["engine_weights_equal_trainer"] = session.weights_match_engine()["equal"]
                rejections.append(entry)
                if not all(entry[k] for k in ("refused", "version_unchanged", "pointers_unchanged", "old_weights_served",
                                              "engine_weights_equal_trainer")):
                    fails.append(f"bad update '{case}' not cleanly refused: {entry}")
            rec = session.grpo_step(task.prompts(cfg.prompts), cfg.group, cfg.max_tokens, task.reward)
            final = session.check_rollout(task.prompts(cfg.prompts), cfg.max_tokens)
            if not (rec["bitwise_equal"] and final["bitwise_equal"] and rec["pointers_unchanged"]):
                fails.append("valid push after the refused ones: mismatch or moved storage")
        sync = [s for s in steps]
        return {
            "status": "fail" if fails else "pass",
            "detail": "; ".join(fails) if fails else (
                f"{cfg.steps} in-place updates into a live multiprocess engine: every rollout bitwise equal to the trainer "
                f"before its update, {len(session.start_pointers)} engine parameters never moved, versions 1..{cfg.steps} "
                f"on both sides; {len(rejections)} bad updates refused with nothing applied"),
            "steps": cfg.steps, "tokens_compared": sum(s["tokens"] for s in steps) + after["tokens"],
            "max_abs": max([s["max_abs"] for s in steps] + [after["max_abs"]]),
            "exact_fraction_min": min([s["exact_fraction"] for s in steps] + [after["exact_fraction"]]),
            "pointers_unchanged": all(s["pointers_unchanged"] for s in steps),
            "engine_version": session.channel.engine_version(),
            "sync_bytes": sync[0]["sync_bytes"] if sync else 0,
            "sync_seconds_mean": sum(s["sync_seconds"] for s in sync) / max(len(sync), 1),
            "engine_start_seconds": session.engine_start_seconds,
            "after_last_push": _strip(after), "rejections": rejections, "records": steps,
        }
    finally:
        session.close()


def _scenario_checkpoint_restore(cfg: LifecycleConfig) -> dict:
    import torch

    from ..checkpoint import load_checkpoint, save_checkpoint
    from ..config import ArchConfig
    from ..conversion import CheckpointMismatchError
    from ..layers import build_consistent_model, compute_token_logprobs
    from ..training import make_optimizer
    from .session import RLSession
    from .toy_task import ModTask

    arch = _arch(cfg)
    work = Path(cfg.out_dir) / "checkpoint_restore"
    fails = []
    # 1. a trainer that has taken optimizer steps (maximise the log-prob of seeded token sequences)
    model = build_consistent_model(arch, seed=cfg.seed)
    opt = make_optimizer(model, cfg.lr)
    g = torch.Generator().manual_seed(cfg.seed + 7)
    for _ in range(max(cfg.steps, 1)):
        ids = torch.randint(3, arch.vocab_size, (4, 12), generator=g)
        opt.zero_grad()
        (-compute_token_logprobs(model, ids).mean()).backward()
        opt.step()
    ckpt = work / "checkpoint"
    if ckpt.exists():
        import shutil

        shutil.rmtree(ckpt)
    t0 = time.perf_counter()
    save_checkpoint(ckpt, model, opt, step=max(cfg.steps, 1), weight_version=max(cfg.steps, 1))
    save_seconds = time.perf_counter() - t0
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    saved_opt = opt.state_dict()

    def same_weights(m) -> bool:
        return all(torch.equal(saved[n], p) for n, p in m.named_parameters())

    # 2. fresh Megatron models, restored from the dist checkpoint and (below, in the session) from safetensors
    fresh = build_consistent_model(arch, seed=cfg.seed + 1)
    fresh_opt = make_optimizer(fresh, cfg.lr)
    load_checkpoint(ckpt, fresh, fresh_opt, source="dist")
    dist_ok = same_weights(fresh) and all(torch.equal(saved_opt[k], v) for k, v in fresh_opt.state_dict().items())
    if not dist_ok:
        fails.append("dist_checkpointing restore is not bitwise")
    # 3. a checkpoint of another architecture: refused, nothing applied
    other_cfg = dict(arch.to_hf(), hidden_size=arch.hidden_size * 2, intermediate_size=arch.intermediate_size * 2)
    other = build_consistent_model(ArchConfig.from_hf(other_cfg), seed=cfg.seed)
    before = [p.detach().clone() for p in other.parameters()]
    wrong_arch = {}
    for source in ("hf", "dist"):
        try:
            load_checkpoint(ckpt, other, make_optimizer(other, cfg.lr), source=source)
            wrong_arch[source] = "accepted"
        except CheckpointMismatchError as e:
            wrong_arch[source] = str(e).splitlines()[0]
    untouched = all(torch.equal(a, b) for a, b in zip(before, other.parameters()))
    if any(v == "accepted" for v in wrong_arch.values()) or not untouched:
        fails.append(f"checkpoint of another architecture not cleanly refused: {wrong_arch}, untouched={untouched}")
    del fresh, other
    # 4. fresh trainer (safetensors restore) + fresh engine on the checkpoint's HF folder
    session = RLSession(arch, "consistent", work / "work", seed=cfg.seed + 2, lr=cfg.lr, restore_dir=ckpt, engine_dir=ckpt / "hf")
    try:
        hf_ok = same_weights(session.model) and all(torch.equal(saved_opt[k], v) for k, v in session.optimizer.state_dict().items())
        if not hf_ok:
            fails.append("safetensors restore is not bitwise")
        engine_match = session.weights_match_engine()
        if not engine_match["equal"]:
            fails.append(f"fresh engine's weights differ from the saved ones: {engine_match['differ']}")
        task = ModTask(arch.vocab_size, seed=cfg.seed)
        first = session.grpo_step(task.prompts(cfg.prompts), cfg.group, cfg.max_tokens, task.reward)
        if not (first["bitwise_equal"] and first["exact_fraction"] == 1.0):
            fails.append(f"first rollout after restore: mismatch (max_abs {first['max_abs']:.3e})")
        if not first["pointers_unchanged"]:
            fails.append("push after restore moved parameter storage")
    finally:
        session.close()
    return {
        "status": "fail" if fails else "pass",
        "detail": "; ".join(fails) if fails else (
            "saved (dist_checkpointing + safetensors optimizer + HF export), restored bitwise into fresh Megatron models "
            "(dist and safetensors) and a fresh engine; first rollout after restore bitwise equal; other architecture refused"),
        "save_seconds": save_seconds, "dist_restore_bitwise": dist_ok, "hf_restore_bitwise": hf_ok,
        "engine_weights_bitwise": engine_match["equal"], "first_step_max_abs": first["max_abs"],
        "first_step_exact_fraction": first["exact_fraction"], "first_step_tokens": first["tokens"],
        "restored_weight_version": first["version"], "wrong_arch": wrong_arch, "wrong_arch_untouched": untouched,
        "first_step": first,
    }


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    kind, req, res = args
    cfg = LifecycleConfig(**json.loads(Path(req).read_text()))
    scenarios = {"weight_update": _scenario_weight_update, "checkpoint_restore": _scenario_checkpoint_restore}
    try:
        out = scenarios[kind](cfg)
    except Exception as e:  # noqa: BLE001 - reported as a failed check
        out = {"status": "fail", "detail": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    Path(res).write_text(json.dumps(out, indent=1, default=str))
    return 0 if out["status"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())

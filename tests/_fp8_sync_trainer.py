"""Trainer process for tests/test_sync.py's quantized pushes: ``python tests/_fp8_sync_trainer.py OUT_DIR FORMAT MODEL``.

FORMAT ``fp8`` (block-FP8 E4M3 128x128) or ``nvfp4``; MODEL a built-in config.  Builds MODEL with that forward (``enable_fp8``), exports it
(``export_hf_fp8``), starts a live consistent vLLM engine on the export (:class:`~megatron_consistent.rl.RLSession` with
``quantization=FORMAT`` and the export as ``engine_dir``: the same seeded trainer with that forward), perturbs the
trainer's weights in place, tries the pushes the test judges and prints one JSON line (``RESULT {...}``).
"""

import json
import os
import sys
import time

from _sync_trainer import attempt

if __name__ == "__main__":
    out_dir, fmt_name, model_name = sys.argv[1:4]
    import torch

    from megatron_consistent.config import ArchConfig
    from megatron_consistent.conversion.fp8 import export_hf_fp8, fp8_hf_state_dict, method_formats
    from megatron_consistent.layers import build_consistent_model
    from megatron_consistent.layers.fp8 import enable_fp8
    from megatron_consistent.rl.session import RLSession
    from megatron_consistent.verify.check import builtin_model_dir

    w_fmt, a_fmt = method_formats(fmt_name)
    arch = ArchConfig.from_hf(json.loads((builtin_model_dir(model_name) / "config.json").read_text()))
    exported = build_consistent_model(arch, seed=0)
    enable_fp8(exported, w_fmt, a_fmt)
    engine_dir = export_hf_fp8(exported, arch, os.path.join(out_dir, "engine"), w_fmt, a_fmt)
    session = RLSession(arch, "consistent", out_dir, seed=0, engine_dir=engine_dir, quantization=fmt_name)  # the same seeded trainer
    model, ch = session.model, session.channel
    prompts, max_tokens = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]], 4

    def state(tag: str, tensors) -> dict:
        """Engine rollouts against the trainer's forward on the new and on the old (exported) weights; what it holds."""
        out = {f"{tag}_version": ch.engine_version(), f"{tag}_engine_holds": ch.engine_matches(tensors)["equal"]}
        for weights, trainer in (("new", model), ("old", exported)):
            session.model = trainer
            out[f"{tag}_equal_{weights}"] = session.check_rollout(prompts, max_tokens)["bitwise_equal"]
        session.model = model
        return out

    old = fp8_hf_state_dict(model, arch, w_fmt)
    out = {**state("start", old)}
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # an optimizer-like step, in place (the trainer's storage stays)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.05 * p.float().abs().mean().to(p.dtype))
    new = fp8_hf_state_dict(model, arch, w_fmt)
    out.update(state("stale", old))  # the engine still on the old weights: the trainer's new forward differs
    out["push_bf16"] = attempt(lambda: ch.push_model(model, quantization=False))  # the model dtype, asked explicitly
    out.update(state("after_bf16", old))
    scale = {n for n in new if n.endswith(("_scale", "_scale_inv", "_scale_2"))}
    out["push_old_scales"] = attempt(lambda: ch.push_tensors({n: old[n] if n in scale else t for n, t in new.items()}, arch=arch))
    out.update(state("old_scales", new))
    t0 = time.perf_counter()
    report = session.push()  # push_model: the model's FP8 / NVFP4 forward -> the quantized tensors
    out["push_seconds_wall"] = time.perf_counter() - t0
    out["report"] = report
    out.update(state("pushed", new))
    out["dtypes"] = sorted({str(t.dtype).replace("torch.", "") for t in new.values()})
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)

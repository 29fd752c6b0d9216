"""Trainer process for tests/test_rl_quantized.py: ``python tests/_quantized_grpo.py OUT_DIR QUANTIZATION STEPS
[RESTORE_DIR]``.

QUANTIZATION ``fp8`` or ``nvfp4``.  An :class:`~megatron_consistent.rl.session.RLSession` on the tiny RL model with a
live quantized consistent engine runs STEPS GRPO steps; after each it records whether the optimizer moved the bf16
masters, whether the engine holds exactly what the trainer pushes and how many of its scale tensors changed; then
one rollout after the last push and a checkpoint (the bf16 masters).  RESTORE_DIR (a checkpoint of an earlier run):
the session restores it first (masters and optimizer; its engine starts from the quantized export of the restored
masters) and records whether the restored masters equal the checkpoint's.  Prints one JSON line (``RESULT {...}``).
"""

import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    out_dir, quantization, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    restore_dir = sys.argv[4] if len(sys.argv) > 4 else None  # a checkpoint of an earlier run of this script
    import torch

    from megatron_consistent.config import ArchConfig
    from megatron_consistent.conversion.fp8 import hf_layout, method_formats
    from megatron_consistent.rl import TINY_RL_HF_CONFIG, ModTask
    from megatron_consistent.rl.session import RLSession

    arch = ArchConfig.from_hf(TINY_RL_HF_CONFIG)
    session = RLSession(arch, "consistent", Path(out_dir) / "work", seed=0, lr=1e-2, quantization=quantization,
                        restore_dir=restore_dir)
    task = ModTask(arch.vocab_size, seed=0)
    digests = session.llm.collective_rpc("mc_sync_digests")[0]
    scale_suffixes = tuple("." + s for s in hf_layout(method_formats(quantization)[0]).scale_suffixes)
    out = {"start_engine_holds": session.weights_match_engine()["equal"],
           "restored_masters": restore_dir and session.weights_match_hf(Path(restore_dir) / "hf")["equal"],
           "engine_scale_tensors": sum(n.endswith(scale_suffixes) for n in digests), "steps": []}
    for _ in range(steps):
        masters = {n: p.detach().clone() for n, p in session.model.named_parameters()}
        rec = session.grpo_step(task.prompts(4), 4, 2, task.reward)
        rec["masters_moved"] = sum(not torch.equal(masters[n], p) for n, p in session.model.named_parameters())
        rec["engine_holds_pushed"] = session.weights_match_engine()["equal"]
        before, digests = digests, session.llm.collective_rpc("mc_sync_digests")[0]
        rec["engine_scales_changed"] = sum(n.endswith(scale_suffixes) and before[n] != d for n, d in digests.items())
        out["steps"].append(rec)
    after = session.check_rollout(task.prompts(4), 2)
    out["after"] = {k: after[k] for k in ("bitwise_equal", "max_abs", "version")}
    ckpt = session.save(Path(out_dir) / "checkpoint", step=session.start_step + steps, dist=False)
    out["checkpoint_holds_masters"] = session.weights_match_hf(Path(ckpt) / "hf")["equal"]
    session.close()
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)

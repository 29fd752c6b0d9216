"""Trainer process for tests/test_gpu_lifecycle.py: ``python tests/_megatron_restore.py OUT_DIR`` (GPU, no engine);
with ``--emulate-cuda-on-cpu`` the same on a CPU machine (``tests/_cuda_on_cpu.py``; the emulated test in the same file).

Megatron-Core's optimizer (``training.MegatronOptimizer``: DDP + ``get_megatron_optimizer``, distributed optimizer, one
NCCL rank) steps a consistent model twice and saves model + optimizer through ``dist_checkpointing``; a fresh model
(other seed) restores both; then both take the same third step.  Prints one JSON line (``RESULT {...}``).  Its own
process: the NCCL group is process-wide.
"""

import json
import sys
from pathlib import Path

if __name__ == "__main__":
    import torch

    from megatron_consistent.checkpoint import load_checkpoint, save_checkpoint
    from megatron_consistent.config import ArchConfig
    from megatron_consistent.conversion import CheckpointMismatchError
    from megatron_consistent.layers import build_consistent_model, compute_token_logprobs
    from megatron_consistent.rl import TINY_RL_HF_CONFIG
    from megatron_consistent.training import MegatronOptimizer, init_single_rank, make_optimizer

    out_dir = Path(sys.argv[1])
    arch = ArchConfig.from_hf(TINY_RL_HF_CONFIG)
    if "--emulate-cuda-on-cpu" in sys.argv:
        from _cuda_on_cpu import emulate_cuda_on_cpu

        emulate_cuda_on_cpu()
    else:
        init_single_rank()
    batches = torch.randint(3, arch.vocab_size, (3, 4, 12), generator=torch.Generator().manual_seed(7)).cuda()

    def trainer(seed):
        model = build_consistent_model(arch, seed=seed).cuda()
        return model, MegatronOptimizer(model, 1e-2)

    def step(model, opt, ids) -> bool:
        opt.zero_grad()
        (-compute_token_logprobs(model, ids).mean()).backward()
        return opt.step()

    def params(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    a, opt_a = trainer(0)
    ptrs_a = [p.data_ptr() for p in a.parameters()]
    start = params(a)
    stepped = [step(a, opt_a, batches[i]) for i in range(2)]
    res = {"optimizer": type(opt_a.optimizer).__name__, "stepped": stepped,
           "moved": sum(not torch.equal(start[n], p) for n, p in a.named_parameters()), "tensors": len(start),
           "trainer_pointers_unchanged": ptrs_a == [p.data_ptr() for p in a.parameters()]}
    ckpt = save_checkpoint(out_dir / "checkpoint", a, opt_a, step=2, weight_version=2)
    res["files"] = json.loads((ckpt / "manifest.json").read_text())["files"]
    saved = params(a)

    b, opt_b = trainer(1)
    ptrs_b = [p.data_ptr() for p in b.parameters()]
    res["fresh_differs"] = any(not torch.equal(saved[n], p) for n, p in b.named_parameters())
    try:
        load_checkpoint(ckpt, b, opt_b, source="hf")
        res["hf_source"] = "accepted"
    except CheckpointMismatchError as e:
        res["hf_source"] = str(e).splitlines()[-1].strip()
    cpu_twin = build_consistent_model(arch, seed=0)
    try:
        load_checkpoint(ckpt, cpu_twin, make_optimizer(cpu_twin, 1e-2), source="dist")
        res["stand_in"] = "accepted"
    except CheckpointMismatchError as e:
        res["stand_in"] = str(e).splitlines()[-1].strip()
    manifest = load_checkpoint(ckpt, b, opt_b, source="dist")
    res["restored_step"] = manifest["step"]
    res["restore_bitwise"] = all(torch.equal(saved[n], p) for n, p in b.named_parameters())
    res["restore_pointers_unchanged"] = ptrs_b == [p.data_ptr() for p in b.parameters()]
    # the optimizer state (float32 main params, Adam moments, step count) restored too: the next step is the same
    res["next_stepped"] = [step(a, opt_a, batches[2]), step(b, opt_b, batches[2])]
    after = params(a)
    res["next_step_bitwise"] = all(torch.equal(after[n], p) for n, p in b.named_parameters())
    res["next_step_moved"] = sum(not torch.equal(saved[n], after[n]) for n in saved)
    # control: the saved weights with a fresh optimizer state (main params re-read from the bf16 weights, no Adam
    # moments, step 0) take a different step, so the comparison above can fail
    c, opt_c = trainer(2)
    with torch.no_grad():
        for n, p in c.named_parameters():
            p.copy_(saved[n])
    opt_c.optimizer.reload_model_params()
    step(c, opt_c, batches[2])
    res["fresh_optimizer_step_differs"] = any(not torch.equal(after[n], p) for n, p in c.named_parameters())
    torch.distributed.destroy_process_group()
    print("RESULT " + json.dumps(res), flush=True)

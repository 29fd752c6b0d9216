"""One Megatron optimizer step on the consistent GPTModel on a GPU (megatron-core 0.19.x; also 0.16.1), JSON out.

    python examples/megatron_optimizer_step_gpu.py [--hf-config DIR] [--dtype bfloat16] [--lr 1e-2] [--json OUT.json]

What it does (single process, world size 1, NCCL):

1. builds the consistent Megatron ``GPTModel`` (:func:`build_consistent_model`, Triton kernels on CUDA),
2. wraps it in Megatron's ``DistributedDataParallel`` (``use_distributed_optimizer=True``,
   ``grad_reduce_in_fp32=True``) and ``get_megatron_optimizer`` (Adam, bf16 params,
   float32 main params = the distributed optimizer),
3. runs forward/backward of ``-mean(token log-probs)`` on seeded tokens, ``finish_grad_sync``,
4. compares every parameter's ``main_grad`` (float32 grad buffer) with the gradient of a
   float64 reference (:func:`megatron_consistent.verify.reference.reference_logprobs_f64`,
   plain torch on the CPU, same weights) — relative Frobenius error per tensor,
5. takes the optimizer step and checks it: every parameter moved, the first Adam step moves
   each weight against its gradient's sign (where the gradient is clearly non-zero), and the
   model's parameter storage did not move.

The gradient tolerance (``--grad-tol``, default 3e-2) reflects bf16 activations (unit roundoff
3.9e-3) through ~20 chained ops; a wrong mapping or a broken backward gives errors of order 1.
DDP, the optimizer and the one-rank NCCL group are the package's
(:class:`megatron_consistent.training.MegatronOptimizer`, :func:`~megatron_consistent.training.init_single_rank`),
where the API differences between megatron-core releases are handled.
Exit code 0 iff ``status == "pass"``.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path


def run(args) -> dict:
    import torch

    from megatron_consistent.config import SUPPORTED_DTYPES
    from megatron_consistent.conversion import hf_state_dict
    from megatron_consistent.layers import build_consistent_model, compute_token_logprobs
    from megatron_consistent.training import MegatronOptimizer, init_single_rank
    from megatron_consistent.verify.reference import reference_logprobs_f64
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import megatron.core

    if not torch.cuda.is_available():
        return {"status": "fail", "detail": "no CUDA device (this script is for the GPU machine)"}
    dtype = SUPPORTED_DTYPES[args.dtype]
    init_single_rank()
    model_parallel_cuda_manual_seed(args.seed)
    hf_config = args.hf_config or str(Path(__file__).resolve().parents[1] / "megatron_consistent" / "configs" / "models" / "tiny-llama")
    model = build_consistent_model(hf_config, seed=args.seed, dtype=dtype)
    arch = model.arch_config
    model.cuda()
    weights0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    mopt = MegatronOptimizer(model, args.lr)  # DDP moves every parameter into its contiguous buffer, once, here
    ddp, optimizer, opt_cfg = mopt.ddp, mopt.optimizer, mopt.config
    ptrs0 = {n: p.data_ptr() for n, p in model.named_parameters()}  # from now on storage must stay put

    ids = torch.randint(0, arch.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(args.seed + 1))
    mopt.zero_grad()
    model.train()
    loss = -compute_token_logprobs(model, ids.cuda()).mean()
    loss.backward()
    ddp.finish_grad_sync()
    main_grads = {}
    for n, p in model.named_parameters():
        g = getattr(p, "main_grad", None)
        if g is None:
            return {"status": "fail", "detail": f"parameter {n} has no main_grad after backward (Megatron DDP hooks did not run)"}
        main_grads[n] = g.detach().float().cpu().clone()

    # float64 reference gradients, in HF layout; our main_grads mapped to HF layout through a float32 CPU twin
    w64 = {k: v.double().requires_grad_(True) for k, v in hf_state_dict(model, arch).items()}
    ref_loss = -reference_logprobs_f64(w64, arch, ids).mean()
    ref_loss.backward()
    twin = build_consistent_model(hf_config, seed=0, dtype=torch.float32).cpu()
    with torch.no_grad():
        for n, p in twin.named_parameters():
            p.copy_(main_grads[n])
    got = hf_state_dict(twin, arch)
    rel = {}
    for k, t in w64.items():
        err, scale = (got[k].double() - t.grad).norm().item(), t.grad.norm().item()
        rel[k] = err / scale if scale > 0 else err
    worst = max(rel, key=rel.get)

    ret = optimizer.step()
    success = ret[0] if isinstance(ret, tuple) else bool(ret) if ret is not None else True
    torch.cuda.synchronize()
    moved_params, sign_agree, considered = [], 0, 0
    for n, p in model.named_parameters():
        delta = (p.detach().float() - weights0[n].float()).cpu()
        if torch.equal(p.detach(), weights0[n]):
            moved_params.append(n)
        g = main_grads[n]
        big = g.abs() > g.abs().max() * 1e-2
        considered += int(big.sum())
        sign_agree += int(((delta[big] * g[big]) < 0).sum())
    ptr_moved = [n for n, p in model.named_parameters() if p.data_ptr() != ptrs0[n]]
    fails = []
    if abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()) > args.loss_tol:
        fails.append(f"loss {loss.item():.6f} vs float64 reference {ref_loss.item():.6f}")
    if rel[worst] > args.grad_tol:
        fails.append(f"main_grad of {worst}: relative error {rel[worst]:.3e} > {args.grad_tol}")
    if not success:
        fails.append("optimizer.step() reported no update")
    if moved_params:
        fails.append(f"parameters unchanged by the step: {moved_params[:8]}")
    if considered and sign_agree / considered < 0.99:
        fails.append(f"only {sign_agree}/{considered} clearly-non-zero-gradient weights moved against their gradient")
    if ptr_moved:
        fails.append(f"parameter storage moved: {ptr_moved[:8]}")
    return {
        "status": "fail" if fails else "pass",
        "detail": "; ".join(fails) or "main_grad matches the float64 reference; one distributed-optimizer step applied",
        "megatron_core": getattr(megatron.core, "__version__", "?"), "torch": torch.__version__, "device": torch.cuda.get_device_name(),
        "model": arch.architecture, "dtype": args.dtype, "optimizer": type(optimizer).__name__,
        "optimizer_config": type(opt_cfg).__name__, "use_distributed_optimizer": True,
        "loss": loss.item(), "ref_loss": ref_loss.item(), "max_grad_rel_err": rel[worst], "worst": worst,
        "grad_rel_errors": rel, "step_result": str(ret), "sign_agreement": sign_agree / max(considered, 1),
        "pointers_unchanged": not ptr_moved,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="One Megatron distributed-optimizer step on the consistent GPTModel (GPU).")
    ap.add_argument("--hf-config", default="")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--lr", type=float, default=1e-2)  # > bf16 half-ulp at 1.0 (2^-8), so norm weights visibly move
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--grad-tol", type=float, default=3e-2)
    ap.add_argument("--loss-tol", type=float, default=1e-2)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    try:
        report = run(args)
    except Exception as e:  # noqa: BLE001 - reported as JSON
        report = {"status": "fail", "detail": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return 0 if report["status"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())

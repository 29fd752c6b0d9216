"""Checkpoint save / export / reload (unit, no engine) and the C8 restore scenario on a fresh live engine."""

from __future__ import annotations

import pickle

import pytest
import torch

from megatron_consistent.checkpoint import audit_dist_metadata, load_checkpoint, save_checkpoint
from megatron_consistent.config import ArchConfig
from megatron_consistent.conversion import CheckpointMismatchError
from megatron_consistent.layers import build_consistent_gpt_model, build_stock_gpt_model, compute_token_logprobs
from megatron_consistent.rl import TINY_RL_HF_CONFIG, group_advantages, grpo_loss
from megatron_consistent.training import initial_adam_state, make_optimizer

ARCH = ArchConfig.from_hf(TINY_RL_HF_CONFIG)


def _trained(build, steps=2):
    model = build(ARCH, seed=0)
    opt = make_optimizer(model, 1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(3, ARCH.vocab_size, (2, 10), generator=g)
        opt.zero_grad()
        logits = model(ids, torch.arange(10).expand(2, 10), None).float()
        torch.log_softmax(logits, -1).gather(-1, ids[..., None]).mean().neg().backward()
        assert opt.step()
    return model, opt


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model, opt = _trained(build_consistent_gpt_model)
    ckpt = save_checkpoint(tmp_path_factory.mktemp("ck") / "checkpoint", model, opt, step=2, weight_version=2)
    return model, opt, ckpt


@pytest.mark.parametrize("source", ["hf", "dist"])
def test_restore_bitwise_in_place(saved, source):
    model, opt, ckpt = saved
    fresh = build_consistent_gpt_model(ARCH, seed=5)
    fresh_opt = make_optimizer(fresh, 1e-2)
    ptrs = [p.data_ptr() for p in fresh.parameters()]
    manifest = load_checkpoint(ckpt, fresh, fresh_opt, source=source)
    assert manifest["step"] == 2 and manifest["weight_version"] == 2
    for (n, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), n
    assert ptrs == [p.data_ptr() for p in fresh.parameters()]
    sd, sd2 = opt.state_dict(), fresh_opt.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    ids = torch.randint(3, ARCH.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    assert torch.equal(compute_token_logprobs(model, ids).detach(), compute_token_logprobs(fresh, ids).detach())


def test_stock_model_roundtrip(tmp_path):
    model, opt = _trained(build_stock_gpt_model, steps=1)
    save_checkpoint(tmp_path / "c", model, opt)
    fresh = build_stock_gpt_model(ARCH, seed=3)
    load_checkpoint(tmp_path / "c", fresh, make_optimizer(fresh, 1e-2), source="dist")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


@pytest.mark.parametrize("source", ["hf", "dist"])
def test_other_architecture_refused_nothing_applied(saved, source):
    _, _, ckpt = saved
    other_arch = ArchConfig.from_hf(dict(TINY_RL_HF_CONFIG, hidden_size=128, intermediate_size=256))
    other = build_consistent_gpt_model(other_arch, seed=0)
    opt = make_optimizer(other, 1e-2)
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(CheckpointMismatchError, match="hidden_size"):
        load_checkpoint(ckpt, other, opt, source=source)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))
    assert not opt.opt.state  # optimizer untouched too


def test_optimizer_state_mismatch_refused_before_weights(saved, tmp_path):
    _, _, ckpt = saved
    fresh = build_consistent_gpt_model(ARCH, seed=9)
    before = [p.detach().clone() for p in fresh.parameters()]
    opt = make_optimizer(fresh, 1e-2)
    opt.main.pop()  # an optimizer over fewer parameters than the checkpoint's
    with pytest.raises(CheckpointMismatchError, match="optimizer state has entries"):
        load_checkpoint(ckpt, fresh, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))


class _Evil:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned",))


def test_dist_metadata_audit_refuses_foreign_globals(saved, tmp_path):
    _, _, ckpt = saved
    audit_dist_metadata(ckpt / "megatron")  # the real metadata passes
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"x": _Evil()}))
    with pytest.raises(CheckpointMismatchError, match="posix.system|os.system|not on the allowlist"):
        audit_dist_metadata(tmp_path)


def test_grpo_helpers():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), 2)
    assert adv[0] > 0 > adv[1] and adv[2] == 0 == adv[3]
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, stats = grpo_loss(lp, lp.detach(), torch.tensor([1.0]))
    assert stats["ratio_max_dev"] == 0.0
    loss.backward()
    assert torch.equal(lp.grad, torch.tensor([[-0.5, -0.5]]))


@pytest.mark.engine
def test_live_restore_first_rollout_bitwise(tmp_path):
    """Save -> reload into fresh Megatron models and a fresh multiprocess engine -> first rollout bitwise equal."""
    from megatron_consistent.verify.lifecycle import check_checkpoint_restore

    r = check_checkpoint_restore({"out_dir": str(tmp_path), "steps": 2, "prompts": 4, "group": 4, "max_tokens": 2})
    assert r["status"] == "pass", r["detail"] + "\n" + r.get("traceback", "")
    assert r["dist_restore_bitwise"] and r["hf_restore_bitwise"] and r["engine_weights_bitwise"]
    assert r["first_step_exact_fraction"] == 1.0 and r["first_step_max_abs"] == 0.0
    assert r["first_step"]["bitwise_equal"] and r["first_step"]["pointers_unchanged"]
    assert all(v != "accepted" for v in r["wrong_arch"].values()) and r["wrong_arch_untouched"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_refused_without_cuda_before_any_work(tmp_path):
    """``grpo_tiny.py --device cuda`` without CUDA: one line, exit 2, no output folder; the pieces refuse alike."""
    import subprocess
    import sys
    from pathlib import Path

    from megatron_consistent.training import MEGATRON_OPTIMIZER_NEEDS_CUDA, MegatronOptimizer, init_single_rank

    script = Path(__file__).resolve().parents[1] / "examples" / "grpo_tiny.py"
    r = subprocess.run([sys.executable, str(script), "--device", "cuda", "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [f"grpo_tiny: --device cuda: {MEGATRON_OPTIMIZER_NEEDS_CUDA}"]
    assert not (tmp_path / "out").exists()
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        init_single_rank()
    with pytest.raises(ValueError, match="move the model to the GPU"):
        MegatronOptimizer(build_consistent_gpt_model(ARCH, seed=0), 1e-2)


def test_filter_kwargs_classes_and_dataclasses():
    """The one place megatron-core signature differences are absorbed: functions, classes, dataclasses."""
    import dataclasses

    from megatron_consistent.layers.builder import filter_kwargs

    @dataclasses.dataclass
    class Cfg:
        lr: float = 0.0

    class Opt:
        def __init__(self, config, model_chunks):
            pass

    assert filter_kwargs(Cfg, {"lr": 1.0, "only_in_0_19": 2}) == {"lr": 1.0}
    assert filter_kwargs(Opt, {"config": 1, "model_chunks": 2, "extra": 3}) == {"config": 1, "model_chunks": 2}
    assert filter_kwargs(lambda a, **kw: None, {"a": 1, "b": 2}) == {"a": 1, "b": 2}


@pytest.mark.parametrize("amsgrad", [False, True])
def test_initial_adam_state_is_what_the_first_step_creates(amsgrad):
    """Megatron-Core (0.16.1, 0.19.2) reads ``step`` of every param before a distributed-optimizer restore; the state given to
    a fresh optimizer for it must leave the next step bit-identical, and must not touch a param that has state."""
    torch.manual_seed(0)
    base = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    grads = [torch.randn_like(p) for p in base]
    runs = []
    for prime in (False, True):
        params = [torch.nn.Parameter(p.detach().clone()) for p in base]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
        if prime:
            initial_adam_state(opt)
            assert all(float(opt.state[p]["step"]) == 0 for p in params)
        for _ in range(2):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
        runs.append((params, opt))
    for a, b in zip(runs[0][0], runs[1][0]):
        assert torch.equal(a, b)
    params, opt = runs[1]
    moments = opt.state[params[0]]["exp_avg"].clone()
    initial_adam_state(opt)  # stepped params keep their state
    assert torch.equal(opt.state[params[0]]["exp_avg"], moments) and float(opt.state[params[0]]["step"]) == 2

"""NVFP4 MoE experts (issue #9): the block-FP8 MoE path with NVFP4 weights (W4A16), trainer == export == engine.

Zero means zero: every consistent comparison is ``torch.equal``.  The experts (and the shared expert) are quantized
per HF tensor -- each expert's gate, up and down with their own E4M3 block scales and float32 global scale (the
ModelOpt names ``weight`` / ``weight_scale`` / ``weight_scale_2``); the router and the shared-expert gate stay in the
model dtype.

* trainer == export (tiny-qwen2moe-top8-shared: 64 experts, top-8, a shared expert): the trainer's quantized experts
  are the file's, the trainer's MoE block is ``fp8_moe_experts`` on the file's tensors; one expert's block scale
  perturbed, or one global scale for the whole expert stack, is caught; log-probs batch invariant, STE gradients
  against a float64 reference;
* tensor parallelism (tiny-qwen2moe-fp8tp, 8 experts): a rank's whole experts quantize as the stack's; the ranks'
  owned pairs summed and combined = TP 1; gloo ranks: the trainer at TP 2 = TP 1, the plugin's NVFP4 MoE layers
  (``tests/_tp_ranks.py``) at TP 1 and 2 = the trainer, an in-place reload at TP 2 = TP 1 on the new weights, and an
  engine with the wrong run of experts is caught;
* end to end: ``check --quantization nvfp4`` on tiny-qwen3moe-top1 (a real vLLM CPU engine), zero mismatch.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_consistent.architectures import take_part
from megatron_consistent.conversion.fp8 import export_hf_fp8, quantized_parts
from megatron_consistent.conversion.hf import _join, _plan
from megatron_consistent.kernels import inference_ops
from megatron_consistent.kernels import moe as kmoe
from megatron_consistent.kernels.fp8 import NVFP4_WEIGHT, FP8Weights, dequantize_rows, fp8_moe_experts
from megatron_consistent.kernels.nvfp4 import nvfp4_effective_scales, nvfp4_quantize, unpack_e2m1
from megatron_consistent.layers import build_consistent_gpt_model
from megatron_consistent.layers.fp8 import FP8MoEBinding, enable_fp8
from megatron_consistent.verify.check import builtin_model_dir, check_layouts, load_check_config, run_check
from test_fp8_moe import assert_moe_logprobs_batch_invariant_and_trainable
from test_fp8_tp import MOETP, _arch, _engine_jobs, _trainer_tp1, _weights, assert_owned_experts_sum_to_all

NV = (NVFP4_WEIGHT, None)
SPECS = (NVFP4_WEIGHT.spec, "")  # the ops' format arguments: W4A16


def _rand(*shape, dtype=torch.bfloat16, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.fixture(scope="module")
def moe_nv(tmp_path_factory):
    model = build_consistent_gpt_model(builtin_model_dir("tiny-qwen2moe-top8-shared"), seed=0, moe_impl="module")
    bound = enable_fp8(model, *NV)
    assert sum(b.endswith(".mlp") for b in bound) == len(model.arch_config.moe_layers)
    out = tmp_path_factory.mktemp("nvfp4-moe")
    export_hf_fp8(model, model.arch_config, out, *NV)
    return model, out


def _file_weights(arch, tensors, layer: int):
    """The plugin's view of one MoE layer from the exported tensors only: codes unpacked, per-row scales
    ``float32(weight_scale) * weight_scale_2`` (no masters)."""
    m, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
    plan = {mn: (hf, kind) for mn, hf, kind in _plan(arch) if mn.startswith(m)}

    def load(mname):
        hf, kind = plan[m + mname]
        return FP8Weights(_join(arch, kind, [unpack_e2m1(tensors[n]) for n in hf]),
                          _join(arch, kind, [nvfp4_effective_scales(tensors[n + "_scale"], tensors[n + "_scale_2"]) for n in hf]))

    shared = (load("mlp.shared_experts.linear_fc1.weight"), load("mlp.shared_experts.linear_fc2.weight"),
              tensors[h + "mlp.shared_expert_gate.weight"])
    return tensors[h + "mlp.gate.weight"], load("mlp.experts.linear_fc1.weight"), load("mlp.experts.linear_fc2.weight"), shared


def test_nvfp4_moe_export_is_the_trainer_forward_and_broken_scales_are_caught(moe_nv):
    model, out = moe_nv
    arch = model.arch_config
    tensors = load_file(str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["megatron_consistent_quantization"]["method"] == "nvfp4"
    for i in arch.moe_layers:
        block = model.decoder.layers[i].mlp
        h = f"model.layers.{i}.mlp."
        assert tensors[h + "gate.weight"].dtype == torch.bfloat16  # router unquantized
        globals_ = []
        for e in range(arch.num_experts):
            for n, shape in (("gate_proj", (32, 64)), ("up_proj", (32, 64)), ("down_proj", (128, 16))):
                name = h + f"experts.{e}.{n}.weight"
                assert tensors[name].dtype == torch.uint8 and tuple(tensors[name].shape) == shape  # two codes a byte
                assert tensors[name + "_scale"].dtype == torch.float8_e4m3fn and tensors[name + "_scale_2"].dim() == 0
                globals_.append(tensors[name + "_scale_2"])
        # each expert tensor its own global scale (amax / (6 * 448) of that tensor): not one for the stack
        master = block.experts.linear_fc1.weight.detach()[3, :arch.moe_intermediate_size]
        assert torch.equal(tensors[h + "experts.3.gate_proj.weight_scale_2"], nvfp4_quantize(master)[2])
        assert len(set(float(g) for g in globals_)) > arch.num_experts
        router, fc1, fc2, shared = _file_weights(arch, tensors, i)
        for kind, weight, mine in (("experts_fc1", block.experts.linear_fc1.weight, fc1),
                                   ("experts_fc2", block.experts.linear_fc2.weight, fc2)):
            got = block.fp8.quantize_weight(kind, weight)
            assert torch.equal(got.q, mine.q) and torch.equal(got.rows, mine.rows)
        # the trainer block's output == fp8_moe_experts on the exported tensors (the vLLM plugin's computation)
        x = _rand(11, 1, arch.hidden_size, seed=i)
        y, _ = block(x)
        y = y.reshape(-1, arch.hidden_size)
        x2 = x.reshape(-1, arch.hidden_size)
        w, experts = kmoe.route(x2, router, arch.num_experts_per_tok, "softmax", norm_topk_prob=arch.norm_topk_prob)
        assert torch.equal(y, fp8_moe_experts(x2, experts, w, fc1, fc2, shared, w_fmt=NVFP4_WEIGHT, a_fmt=None))
        # broken: one routed expert's first E4M3 block scale one step up (its file tensor perturbed)
        e = int(experts[0, 0])
        bad = dict(tensors)
        sc = h + f"experts.{e}.gate_proj.weight_scale"
        bad[sc] = tensors[sc].clone()
        bad[sc].view(torch.uint8)[0, 0] += 1
        _, bfc1, _, _ = _file_weights(arch, bad, i)
        assert not torch.equal(y, fp8_moe_experts(x2, experts, w, bfc1, fc2, shared, w_fmt=NVFP4_WEIGHT, a_fmt=None))
        # broken: the expert stack quantized as one tensor (one global scale for every expert's gate | up)
        stack = block.experts.linear_fc1.weight.detach()
        q, sb, g = nvfp4_quantize(stack.reshape(-1, stack.shape[-1]))
        one = FP8Weights(q.reshape(stack.shape), nvfp4_effective_scales(sb, g).reshape(*stack.shape[:2], -1))
        assert not torch.equal(y, fp8_moe_experts(x2, experts, w, one, fc2, shared, w_fmt=NVFP4_WEIGHT, a_fmt=None))


def test_nvfp4_moe_trainer_logprobs_batch_invariant_and_trainable(moe_nv):
    assert_moe_logprobs_batch_invariant_and_trainable(moe_nv[0], shared=True)


def _stacked(kind: str, w: torch.Tensor, master=None) -> FP8Weights:
    """Quantize a stacked expert weight per HF tensor in NVFP4 (the export's routine) -> FP8Weights, Megatron layout."""
    parts = quantized_parts(None, kind, w, NVFP4_WEIGHT)
    return FP8Weights(_join(None, kind, [q for q, _ in parts]), _join(None, kind, [s for _, s in parts]), master)


def test_nvfp4_moe_ste_gradients_match_float64_reference():
    """float32 experts with masters: gradients to x, the stacked masters and the routing weights vs a float64 reference
    (W4A16: ``x`` unquantized; STE: quantize -> dequantize of the weights treated as the identity in the backward).

    Reference per (token, slot): ``y = (silu(g) * u) @ wd2^T`` with ``[g; u] = x @ wd1^T``, the weights dequantized from
    the kernel's quantizer, everything else float64.  Tolerance as the block-FP8 MoE test: float32 throughout with
    reductions of length <= 160 and a few chained ops, so 2^-13 * max|reference| per tensor (~7 bits of slack)."""
    E, H, inter, T, K = 3, 160, 48, 9, 2
    x = _rand(T, H, dtype=torch.float32, seed=1).requires_grad_()
    m1 = _rand(E, 2 * inter, H, dtype=torch.float32, seed=2, scale=0.05).requires_grad_()
    m2 = _rand(E, H, inter, dtype=torch.float32, seed=3, scale=0.05).requires_grad_()
    w, experts = kmoe.route_logits(_rand(T, E, dtype=torch.float32, seed=4), K)
    w = w.detach().requires_grad_()
    gy = _rand(T, H, dtype=torch.float32, seed=5)
    fc1, fc2 = _stacked("experts_fc1", m1.detach(), m1), _stacked("experts_fc2", m2.detach(), m2)
    fp8_moe_experts(x, experts, w, fc1, fc2, w_fmt=NVFP4_WEIGHT, a_fmt=None).backward(gy)

    def reference(quantized: bool):
        """float64 gradients (x, m1, m2, w); ``quantized=False``: the masters' own (a broken STE)."""
        x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        m1_64, m2_64 = m1.detach().double().requires_grad_(), m2.detach().double().requires_grad_()
        out = torch.zeros(T, H, dtype=torch.float64)
        for j in range(K):
            for t in range(T):
                e = int(experts[t, j])
                w1, w2 = m1_64[e], m2_64[e]
                if quantized:  # forward value dq(q(W)), gradient of the identity
                    w1 = w1 + (dequantize_rows(fc1.q[e], fc1.rows[e], NVFP4_WEIGHT).double() - w1).detach()
                    w2 = w2 + (dequantize_rows(fc2.q[e], fc2.rows[e], NVFP4_WEIGHT).double() - w2).detach()
                gu = x64[t] @ w1.t()
                act = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
                out = out.index_add(0, torch.tensor([t]), (w64[t, j] * (act @ w2.t()))[None])
        out.backward(gy.double())
        return x64.grad, m1_64.grad, m2_64.grad, w64.grad

    ref = reference(True)
    for got, r in zip((x.grad, m1.grad, m2.grad, w.grad), ref):
        assert torch.all((got.double() - r).abs() <= 2.0**-13 * r.abs().max())
    # the STE through the quantized weights is what is checked: the masters' own gradient of x is far outside the bound
    assert not torch.all((reference(False)[0] - ref[0]).abs() <= 2.0**-13 * ref[0].abs().max())


def test_nvfp4_odd_input_sizes_refused_by_name():
    """Two E2M1 codes a byte: a quantized tensor with an odd K (here every expert's down_proj) is refused in one line,
    by the trainer's ``enable_fp8``, the export and the plugin's layer factory (``check_fp8_arch``)."""
    from megatron_consistent.config import UnsupportedConfigError
    from megatron_consistent.conversion.fp8 import check_fp8_arch, fp8_arch_refusal

    arch = _arch("tiny-qwen2moe-fp8tp", moe_intermediate_size=63)
    reason = fp8_arch_refusal(arch, NVFP4_WEIGHT)
    assert reason == "model.layers.0.mlp.experts.0.down_proj.weight (256, 63) has an odd input size (two E2M1 codes per byte)"
    assert fp8_arch_refusal(arch) == "" and fp8_arch_refusal(_arch("tiny-qwen2moe-fp8tp"), NVFP4_WEIGHT) == ""
    with pytest.raises(UnsupportedConfigError, match="^nvfp4 quantization: model.layers.0.mlp.experts.0.down_proj"):
        check_fp8_arch(arch, NVFP4_WEIGHT)
    # check refuses it at TP 1 too, before any work (its layout check)
    with pytest.raises(ValueError, match="^--quantization nvfp4: model.layers.0.mlp.experts.0.down_proj"):
        check_layouts(load_check_config(device="cpu", quantization="nvfp4"), arch)


# ------------------------------------------------------------------------------------------------ tensor parallelism
def _moe_operands(seed: int = 0):
    """tiny-qwen2moe-fp8tp's MoE block in NVFP4 (the trainer's quantization, masters attached) and routed tokens."""
    arch = _arch("tiny-qwen2moe-fp8tp")
    E, H, inter, s = arch.num_experts, arch.hidden_size, arch.moe_intermediate_size, arch.shared_expert_intermediate_size
    r = iter(range(seed, seed + 10))
    binding = FP8MoEBinding(arch, *NV)
    fc1 = binding.quantize_weight("experts_fc1", _rand(E, 2 * inter, H, seed=next(r), scale=0.05))
    fc2 = binding.quantize_weight("experts_fc2", _rand(E, H, inter, seed=next(r), scale=0.05))
    shared = (binding.quantize_weight("fc1", _rand(2 * s, H, seed=next(r), scale=0.05)),
              binding.quantize_weight("copy", _rand(H, s, seed=next(r), scale=0.05)), _rand(1, H, seed=next(r), scale=0.05))
    x = _rand(40, H, seed=next(r))
    w, experts = kmoe.route(x, _rand(E, H, seed=next(r), scale=0.3), arch.num_experts_per_tok)
    return binding, x, experts, w, fc1, fc2, shared


def test_nvfp4_owned_experts_summed_over_ranks_equal_tp1_and_broken_variants_are_caught():
    """A rank's whole experts quantized on their own are the stack's codes and scales (each expert tensor its own
    global scale); each rank's owned pairs (engine op with fixed shapes == the trainer's, masters attached), summed
    over the 2 ranks and combined = ``fp8_moe_experts`` with every expert; no sum, or the next rank's experts: caught."""
    binding, x, experts, w, fc1, fc2, shared = _moe_operands()
    sh = (shared[0].q, shared[0].rows, shared[1].q, shared[1].rows, shared[2])
    one = inference_ops.fp8_moe_experts(x, experts, w, fc1.q, fc1.rows, fc2.q, fc2.rows, *sh, *SPECS)
    tp, run = 2, fc1.q.shape[0] // 2
    for r in range(tp):
        cut = slice(r * run, (r + 1) * run)
        part = binding.quantize_weight("experts_fc1", fc1.master[cut])
        assert torch.equal(part.q, fc1.q[cut]) and torch.equal(part.rows, fc1.rows[cut])
    assert_owned_experts_sum_to_all(x, experts, w, fc1, fc2, sh, one, tp, SPECS, NV)


@pytest.fixture(scope="module")
def nv_moe_runs(tmp_path_factory):
    """tiny-qwen2moe-fp8tp in NVFP4.  Trainer: TP 1 here, TP 2 in gloo ranks.  Engine (the plugin's model classes in
    gloo ranks): the export at TP 1 and 2, TP 2 reloaded in place with a second export and with the next rank's run of
    experts, TP 1 on the second export."""
    from megatron_consistent.layers.distributed import recompute_logprobs_parallel

    from _tp_ranks import PROMPT

    tmp = tmp_path_factory.mktemp("nvfp4moetp")
    weights = _weights(0, MOETP)
    ids = torch.tensor([PROMPT[:36], PROMPT[::-1][:36]]) % 512
    logits1, model = _trainer_tp1(weights, ids, NV, MOETP)
    engine_dir, reload_dir = tmp / "nv", tmp / "nv_reload"
    export_hf_fp8(model, model.arch_config, engine_dir, *NV)
    _, model_b = _trainer_tp1(_weights(1, MOETP), ids[:1], NV, MOETP)
    export_hf_fp8(model_b, model_b.arch_config, reload_dir, *NV)
    trainer = recompute_logprobs_parallel(MOETP, weights, ids, tp=2, return_logits=True, quantization=NV,
                                          workdir=tmp / "trainer2")
    engine = _engine_jobs(tmp, engine_dir, {}, {
        1: {"tp1": {}, "tp1_reload": {"model_dir": reload_dir}},
        2: {"tp2": {}, "reloaded": {"reload": str(reload_dir)}, "slice": {"fault": "moe_slice"}}})
    one = logits1.transpose(0, 1) if logits1.shape[0] != ids.shape[0] else logits1
    return {"ids": ids, "logits1": one.float(), "trainer": trainer, "engine": engine}


@pytest.mark.slow
def test_nvfp4_moe_trainer_tp2_equals_tp1(nv_moe_runs):
    from megatron_consistent.kernels import log_softmax

    lp, logits = nv_moe_runs["trainer"]
    one, ids = nv_moe_runs["logits1"], nv_moe_runs["ids"]
    assert torch.equal(logits, one)
    assert torch.equal(lp, log_softmax(one)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0])


@pytest.mark.slow
def test_nvfp4_moe_engine_tp1_tp2_equal_the_trainer(nv_moe_runs):
    engine = nv_moe_runs["engine"]
    one, two = engine["tp1"]["out"], engine["tp2"]["out"]
    assert set(one) == set(two) and "logits" in one
    for k in one:
        assert torch.equal(one[k], two[k]), k
    assert torch.equal(one["logits"][:36], nv_moe_runs["logits1"][0])  # the engine's prompt starts with the trainer's row 0
    r0, r1 = (engine["tp2"]["ranks"][r] for r in range(2))
    assert r0["held"]["layers.0.experts_fc1"] == [4, 128, 128]  # 4 whole experts, [2I, H / 2]: codes two a byte
    assert r0["held"]["layers.0.experts_gate_scale"] == [4, 64, 16] and r0["held"]["layers.0.experts_gate_scale_2"] == [4]
    gate7 = "model.layers.0.mlp.experts.7.gate_proj.weight"
    for suffix in ("", "_scale", "_scale_2"):  # expert 7: rank 1's, nothing of it on rank 0
        assert r0["parts"][gate7 + suffix] == [0, 0, 0] and r1["parts"][gate7 + suffix] is None
    assert not torch.equal(engine["slice"]["out"]["logits"], one["logits"])  # the next rank's run of experts: caught


@pytest.mark.slow
def test_nvfp4_moe_engine_tp2_reloaded_in_place_equals_tp1(nv_moe_runs):
    """A reload at TP 2 (``load_weights`` in place, what a refit does: each rank copies its experts' codes, block scales
    and global scales, nothing of the others' -- an empty part of a 0-d global scale) serves what a TP 1 engine
    started on those weights serves."""
    engine = nv_moe_runs["engine"]
    reloaded, direct = engine["reloaded"], engine["tp1_reload"]["out"]
    assert all(r["reload_pointers_same"] for r in reloaded["ranks"])
    assert not torch.equal(direct["logits"], engine["tp1"]["out"]["logits"])  # other weights
    for k in direct:
        assert torch.equal(reloaded["out"][k], direct[k]), k
    g = torch.tensor(0.5)  # another rank's expert's global scale: nothing of it; its own: all of it
    assert take_part(g, (0, 0, 0)).shape == (0,) and take_part(g, None) is g


# ------------------------------------------------------------------------------------------------ end to end (real vLLM engine)
@pytest.mark.engine
def test_check_nvfp4_moe_zero_mismatch(tmp_path):
    """One engine: Qwen3-MoE (a dense layer 0 and a MoE layer 1, both NVFP4), chunked prefill, prefix caching."""
    cfg = load_check_config(hf_config=str(builtin_model_dir("tiny-qwen3moe-top1")), quantization="nvfp4", mode="consistent",
                            num_prompts=6, max_tokens=12, max_num_batched_tokens=32, out_dir=str(tmp_path), max_prompt_len=60,
                            shared_prefix_len=40, prefix_groups=2)
    report = run_check(cfg)
    c = report["consistent"]
    assert c["tokens"] == 72 and c["exact_fraction"] == 1.0 and c["max_abs"] == 0.0 and report["zero_mismatch"]
    assert c["routing_agreement"] == 1.0
    assert "megatron-consistent plugin active" in open(tmp_path / "engines" / "consistent.log").read()

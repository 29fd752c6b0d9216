"""Hybrid Mamba-2 / Nemotron-H on the Megatron side: config, model, batch invariance, gradients, conversion, transformers.

The vLLM side (decode / chunked prefill vs whole-sequence bits) is tested with the plugin.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from megatron_consistent import kernels
from megatron_consistent.config import ArchConfig, UnsupportedConfigError, builtin_model_dir, load_hf_config
from megatron_consistent.conversion import CheckpointMismatchError, export_hf, hf_state_dict, import_hf, megatron_to_hf_names
from megatron_consistent.layers import build_consistent_gpt_model, compute_token_logprobs
from megatron_consistent.layers import hybrid as lh
from megatron_consistent.layers.hybrid import build_consistent_hybrid_model
from megatron_consistent.verify import ssm_reference as f64

NAMES = ("tiny-mamba2", "tiny-nemotronh", "tiny-nemotronh-moe")


def hf_cfg(name: str) -> dict:
    return load_hf_config(builtin_model_dir(name))


def tokens(b: int, s: int, seed: int, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def models():
    """One bf16 consistent model per tiny hybrid config (seed 0)."""
    return {n: build_consistent_hybrid_model(builtin_model_dir(n), seed=0) for n in NAMES}


# ---------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("name", NAMES)
def test_config_round_trip(name):
    arch = ArchConfig.from_hf(hf_cfg(name))
    assert arch.is_hybrid and arch.num_layers == len(arch.layer_types)
    assert ArchConfig.from_hf(arch.to_hf()) == arch
    assert ArchConfig.from_dict(json.loads(json.dumps(arch.as_dict()))) == arch
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in arch.to_hf().items() if k != "architectures"})
    kinds = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}
    assert tuple(kinds[t] for t in cfg.layer_types) == arch.layer_types


def test_config_fields():
    a = ArchConfig.from_hf(hf_cfg("tiny-nemotronh-moe"))
    assert a.layer_types == ("mamba", "moe", "attention", "mamba", "mlp", "moe") and a.moe_layers == (1, 5)
    assert (a.hidden_act, a.use_rope, a.moe_scoring, a.moe_n_group, a.moe_topk_group, a.routed_scaling_factor) == (
        "relu2", False, "sigmoid", 2, 1, 2.5)
    s = a.ssm
    assert (s.num_heads, s.head_dim, s.state_size, s.n_groups, s.conv_kernel, s.chunk_size) == (8, 16, 16, 2, 4, 16)
    assert (s.d_inner, s.conv_dim, s.in_proj_size, s.group_size) == (128, 192, 328, 64)
    # the legacy list names and the pattern string give the same layers; Mamba2 is all-Mamba
    legacy = {**hf_cfg("tiny-nemotronh"), "layers_block_type": ["mamba", "attention", "mamba", "mlp", "mamba", "attention", "mlp", "mamba"]}
    assert ArchConfig.from_hf(legacy).layer_types == ArchConfig.from_hf(hf_cfg("tiny-nemotronh")).layer_types
    assert ArchConfig.from_hf(hf_cfg("tiny-mamba2")).layer_types == ("mamba",) * 3


REFUSED = [
    ("tiny-nemotronh", {"mamba_proj_bias": True}, "mamba_proj_bias"),
    ("tiny-nemotronh", {"use_bias": True}, "use_bias"),
    ("tiny-nemotronh", {"mlp_bias": True}, "mlp_bias"),
    ("tiny-nemotronh", {"attention_bias": True}, "attention_bias"),
    ("tiny-nemotronh", {"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
    ("tiny-nemotronh", {"mamba_hidden_act": "gelu"}, "mamba_hidden_act"),
    ("tiny-nemotronh", {"sliding_window": 64}, "sliding_window"),
    ("tiny-nemotronh", {"num_nextn_predict_layers": 1}, "num_nextn_predict_layers"),
    ("tiny-nemotronh", {"mamba_ssm_cache_dtype": "bfloat16"}, "mamba_ssm_cache_dtype"),
    ("tiny-nemotronh", {"tie_word_embeddings": True}, "tie_word_embeddings"),
    ("tiny-nemotronh", {"hybrid_override_pattern": "M*X-M*-M", "layers_block_type": None}, "hybrid_override_pattern"),
    ("tiny-nemotronh", {"hybrid_override_pattern": "MMMMMMMM"}, "disagrees"),
    ("tiny-nemotronh", {"n_groups": 3}, "n_groups"),
    ("tiny-nemotronh", {"time_step_limit": [0.1, 0.01]}, "time_step_limit"),
    ("tiny-nemotronh-moe", {"moe_latent_size": 64}, "moe_latent_size"),
    ("tiny-nemotronh-moe", {"n_shared_experts": 2}, "n_shared_experts"),
    ("tiny-nemotronh-moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("tiny-nemotronh-moe", {"n_group": 3}, "n_group"),
    ("tiny-mamba2", {"use_bias": True}, "use_bias"),
    ("tiny-mamba2", {"expand": 3}, "expand"),
    ("tiny-mamba2", {"hidden_act": "gelu"}, "hidden_act"),
]


@pytest.mark.parametrize("name, change, message", REFUSED, ids=[f"{n}-{m}" for n, _, m in REFUSED])
def test_config_refusals_by_name(name, change, message):
    hf = hf_cfg(name)
    for k, v in change.items():
        if v is None:
            hf.pop(k, None)
        else:
            hf[k] = v
    with pytest.raises(UnsupportedConfigError, match=message):
        ArchConfig.from_hf(hf)
    with pytest.raises(UnsupportedConfigError, match=message):
        build_consistent_gpt_model(hf)


# ---------------------------------------------------------------------------------------------- build + forward
@pytest.mark.parametrize("name", NAMES)
def test_build_forward_backward(name, models):
    model = models[name]
    arch = model.arch_config
    kinds = {"mamba": lh.ConsistentMambaMixer, "attention": lh.ConsistentNoRopeCoreAttention}
    for i, kind in enumerate(arch.layer_types):
        layer = model.decoder.layers[i]
        if kind == "mamba":
            assert isinstance(layer.mixer, kinds[kind]) and isinstance(layer.norm, lh.ConsistentHybridNorm)
        elif kind == "attention":
            assert isinstance(layer.self_attention.core_attention, kinds[kind])
    assert isinstance(model.decoder.final_norm, lh.ConsistentRMSNorm)
    assert type(model.output_layer).__name__ == "ConsistentOutputLayer"
    assert {p.dtype for n, p in model.named_parameters() if not n.endswith("expert_bias")} == {torch.bfloat16}
    # the dense builder dispatches here: same seed, same weights
    twin = build_consistent_gpt_model(builtin_model_dir(name), seed=0)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(model.named_parameters(), twin.named_parameters()))
    ids = tokens(2, 35, seed=1)
    model.zero_grad(set_to_none=True)
    lp = compute_token_logprobs(model, ids)
    assert lp.shape == (2, 34) and lp.dtype == torch.float32 and torch.isfinite(lp).all()
    (-lp.mean()).backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all(), n
    model.zero_grad(set_to_none=True)


def test_no_stock_baseline_and_no_rope():
    from megatron_consistent.layers import build_stock_gpt_model

    with pytest.raises(UnsupportedConfigError, match="no stock Megatron baseline"):
        build_stock_gpt_model(builtin_model_dir("tiny-nemotronh"))
    with pytest.raises(UnsupportedConfigError, match="moe_impl"):
        build_consistent_gpt_model(builtin_model_dir("tiny-nemotronh-moe"), moe_impl="megatron")


# ---------------------------------------------------------------------------------------------- batch invariance
@settings(max_examples=4)
@given(length=st.integers(2, 50), batch=st.integers(1, 3), data=st.data())
def test_alone_vs_in_batch_and_prefix(models, length, batch, data):
    """A sequence's log-probs are the same bits alone, in any row of a batch, and as the prefix of a longer sequence
    (chunk boundaries of the SSD scan fall inside and at the end of the prompt; partial chunks are padded)."""
    model = models["tiny-nemotronh-moe"]  # all four layer kinds
    seed = data.draw(st.integers(0, 10**6))
    row = data.draw(st.integers(0, batch - 1))
    full = tokens(batch, length + 13, seed)
    with torch.no_grad():
        alone = compute_token_logprobs(model, full[row : row + 1, :length])
        in_batch = compute_token_logprobs(model, full)
    assert torch.equal(alone[0], in_batch[row, : length - 1])


def _length_dependent_scan(x, dt, A, B, C, D, chunk_size, initial_state=None):
    """BROKEN on purpose: the chunk size depends on the sequence length (like a kernel whose block size follows T).
    The chunked scan is exact mathematics for any chunk size, so only the bits can tell."""
    return kernels.ssd.ssd_scan(x, dt, A, B, C, D, chunk_size if x.shape[-3] % 2 else chunk_size // 2, initial_state)


def test_prefix_check_catches_length_dependent_scan(monkeypatch):
    """The prefix property on one float32 Mamba mixer with O(1) activations (every ulp of the scan is visible there,
    unlike in bf16 log-probs of a small-init model): the real scan passes, a length-dependent chunking is caught."""
    model = build_consistent_hybrid_model(builtin_model_dir("tiny-mamba2"), seed=0, dtype=torch.float32)
    mixer = model.decoder.layers[0].mixer
    h = torch.randn(2, 40, model.arch_config.hidden_size, generator=torch.Generator().manual_seed(5))
    prefixes = (21, 29, 37)
    with torch.no_grad():
        full = mixer.mix(h)
        assert all(torch.equal(mixer.mix(h[:, :n]), full[:, :n]) for n in prefixes)  # the real scan: prefix == whole
        monkeypatch.setattr(kernels, "ssd_scan", _length_dependent_scan)
        full = mixer.mix(h)
        assert not all(torch.equal(mixer.mix(h[:, :n]), full[:, :n]) for n in prefixes)


def test_packed_thd_equals_separate_sequences(models):
    """THD packing (Megatron's packed_seq_params): every segment is scanned / attended on its own, so packing never changes
    a row: the packed forward's logits equal each sequence's own forward, bit for bit."""
    from megatron.core.packed_seq_params import PackedSeqParams

    model = models["tiny-nemotronh-moe"]
    lengths = (17, 1, 30)
    seqs = [tokens(1, n, seed=20 + n) for n in lengths]
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    with torch.no_grad():
        packed = model(torch.cat(seqs, dim=1), None, None, packed_seq_params=psp)[0]
        for (a, b), ids in zip(zip(cu[:-1].tolist(), cu[1:].tolist()), seqs):
            assert torch.equal(packed[a:b], model(ids, None, None)[0])


# ---------------------------------------------------------------------------------------------- gradients vs float64
def _rms_f64(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def reference_logprobs_f64(w: dict, arch: ArchConfig, ids: torch.Tensor, routes: dict) -> torch.Tensor:
    """Plain-torch float64 hybrid forward from HF-named weights; MoE layers use the given expert choices."""
    b, s = ids.shape
    eps = arch.rms_norm_eps
    x = w["backbone.embeddings.weight"][ids]
    for i, kind in enumerate(arch.layer_types):
        p = f"backbone.layers.{i}."
        h = _rms_f64(x, w[p + "norm.weight"], eps)
        if kind == "mamba":
            c = arch.ssm
            zx = h @ w[p + "mixer.in_proj.weight"].T
            z, xbc, dt = torch.split(zx, [c.d_inner, c.conv_dim, c.num_heads], dim=-1)
            xbc, _ = f64.causal_conv1d_f64(xbc, w[p + "mixer.conv1d.weight"][:, 0], w.get(p + "mixer.conv1d.bias"))
            xs, B, C = torch.split(xbc, [c.d_inner, c.n_groups * c.state_size, c.n_groups * c.state_size], dim=-1)
            dt = f64.mamba_dt_f64(dt, w[p + "mixer.dt_bias"], *c.time_step_limit)
            y, _ = f64.ssd_recurrence_f64(xs.reshape(b, s, c.num_heads, c.head_dim), dt, -torch.exp(w[p + "mixer.A_log"]),
                                          B.reshape(b, s, c.n_groups, c.state_size), C.reshape(b, s, c.n_groups, c.state_size), w[p + "mixer.D"])
            y = f64.gated_rms_norm_f64(y.reshape(b, s, c.d_inner), z, w[p + "mixer.norm.weight"], c.group_size, eps)
            out = y @ w[p + "mixer.out_proj.weight"].T
        elif kind == "attention":
            nh, nkv, hd = arch.num_heads, arch.num_kv_heads, arch.head_dim
            q = (h @ w[p + "mixer.q_proj.weight"].T).reshape(b, s, nh, hd).transpose(1, 2)
            k = (h @ w[p + "mixer.k_proj.weight"].T).reshape(b, s, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, 1)
            v = (h @ w[p + "mixer.v_proj.weight"].T).reshape(b, s, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, 1)
            att = (q @ k.transpose(-1, -2)) * hd**-0.5
            att = att.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -torch.inf).softmax(-1)
            out = (att @ v).transpose(1, 2).reshape(b, s, nh * hd) @ w[p + "mixer.o_proj.weight"].T
        elif kind == "mlp":
            out = f64.relu_squared_f64(h @ w[p + "mixer.up_proj.weight"].T) @ w[p + "mixer.down_proj.weight"].T
        else:
            experts = routes[i]  # [b, s, k] as chosen by the model (piecewise-constant selection: no gradient)
            scores = torch.sigmoid(h @ w[p + "mixer.gate.weight"].T)
            wts = scores.gather(-1, experts)
            if arch.norm_topk_prob:
                wts = wts / wts.sum(-1, keepdim=True)
            wts = wts * arch.routed_scaling_factor
            out = f64.relu_squared_f64(h @ w[p + "mixer.shared_experts.up_proj.weight"].T) @ w[p + "mixer.shared_experts.down_proj.weight"].T
            for e in range(arch.num_experts):
                ye = f64.relu_squared_f64(h @ w[p + f"mixer.experts.{e}.up_proj.weight"].T) @ w[p + f"mixer.experts.{e}.down_proj.weight"].T
                out = out + (wts * (experts == e)).sum(-1, keepdim=True) * ye
        x = x + out
    h = _rms_f64(x, w["backbone.norm_f.weight"], eps)
    head = w["backbone.embeddings.weight"] if arch.tie_word_embeddings else w["lm_head.weight"]
    logp = torch.log_softmax(h @ head.T, -1)
    return logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]


# float32 model vs float64 reference, relative Frobenius error per gradient tensor.  float32 roundoff u = 6e-8; the
# chain is 3-8 layers of float32 reductions of length <= 328 plus the float32 SSD backward recompute, so ~1e-6 is
# expected (measured, seed 3, 2x37 tokens: worst 7.2e-7 tiny-mamba2, 1.1e-6 tiny-nemotronh, 1.05e-6 tiny-nemotronh-moe;
# loss <= 5e-8).  2e-5 (the dense models' bound, verify/reference.py) keeps ~18x headroom; a wrong formula (the A_log
# gradient sign flipped, below) gives errors of order 1.
GRAD_REL_TOL = 2e-5


def gradient_errors_vs_f64(arch: ArchConfig, weights: dict, grads: dict, ids: torch.Tensor, routes: dict) -> tuple[float, dict[str, float]]:
    """(loss, relative Frobenius error of every gradient) of a model's gradients vs the float64 reference, from the
    HF-named weights and the HF-named gradients (the loss: ``-mean`` of the reference's token log-probs)."""
    w64 = {k: v.double().requires_grad_(True) for k, v in weights.items()}
    ref = -reference_logprobs_f64(w64, arch, ids, routes).mean()
    ref.backward()
    errs = {}
    for k, t in w64.items():
        if k.endswith("e_score_correction_bias"):
            continue  # a selection bias: no gradient on either side
        scale = t.grad.norm().item()
        errs[k] = (grads[k].double() - t.grad).norm().item() / scale if scale > 0 else grads[k].double().norm().item()
    return ref.item(), errs


def hf_gradients(hf_config, arch: ArchConfig, grads: dict) -> dict:
    """HF-named gradients of a model's (full, TP = 1) Megatron-named ``grads`` (``None``: zeros), through a twin."""
    twin = build_consistent_hybrid_model(hf_config, seed=0, dtype=torch.float32)
    with torch.no_grad():
        for n, p in twin.named_parameters():
            p.copy_(grads[n] if grads.get(n) is not None else torch.zeros_like(p))
    return hf_state_dict(twin, arch)


def _hybrid_gradient_errors(name: str, seed: int = 3) -> tuple[float, dict[str, float]]:
    model = build_consistent_hybrid_model(builtin_model_dir(name), seed=seed, dtype=torch.float32)
    arch = model.arch_config
    ids = tokens(2, 37, seed=4)
    weights = hf_state_dict(model, arch)
    loss = -compute_token_logprobs(model, ids).mean()
    loss.backward()
    routes = {i: model.decoder.layers[i].mlp.last_routes.reshape(ids.shape[1], ids.shape[0], -1).transpose(0, 1)
              for i in arch.moe_layers}
    got = hf_gradients(builtin_model_dir(name), arch, {n: p.grad for n, p in model.named_parameters()})
    ref, errs = gradient_errors_vs_f64(arch, weights, got, ids, routes)
    return abs(loss.item() - ref) / abs(ref), errs


@pytest.mark.parametrize("name", ["tiny-mamba2", "tiny-nemotronh-moe"])
def test_gradients_vs_float64(name):
    loss_err, errs = _hybrid_gradient_errors(name)
    assert loss_err <= 1e-5
    worst = max(errs, key=errs.get)
    assert errs[worst] <= GRAD_REL_TOL, f"{worst}: relative gradient error {errs[worst]:.2e}"


def test_gradient_check_catches_wrong_a_log_backward(monkeypatch):
    from megatron_consistent.kernels.ssd import SSMDecayRateFunction

    monkeypatch.setattr(SSMDecayRateFunction, "backward", staticmethod(lambda ctx, g: -(g * ctx.saved_tensors[0])))  # sign flipped
    _, errs = _hybrid_gradient_errors("tiny-mamba2")
    assert errs["backbone.layers.0.mixer.A_log"] > 100 * GRAD_REL_TOL


# ---------------------------------------------------------------------------------------------- conversion
@pytest.mark.parametrize("name", NAMES)
def test_export_import_round_trip_bitwise(name, models, tmp_path):
    src = models[name]
    arch = src.arch_config
    export_hf(src, arch, tmp_path)
    t = load_file(str(tmp_path / "model.safetensors"))
    assert set(t) == {n for names in megatron_to_hf_names(arch).values() for n in names}
    assert ("lm_head.weight" in t) == (not arch.tie_word_embeddings)
    assert t["backbone.layers.0.mixer.conv1d.weight"].shape == (arch.ssm.conv_dim, 1, arch.ssm.conv_kernel)
    assert t["backbone.layers.0.mixer.in_proj.weight"].shape == (arch.ssm.in_proj_size, arch.hidden_size)
    for i in arch.moe_layers:
        assert t[f"backbone.layers.{i}.mixer.gate.e_score_correction_bias"].dtype == torch.float32
        assert t[f"backbone.layers.{i}.mixer.experts.0.up_proj.weight"].shape == (arch.moe_intermediate_size, arch.hidden_size)
    assert ArchConfig.from_hf(json.loads((tmp_path / "config.json").read_text())) == arch
    dst = build_consistent_hybrid_model(builtin_model_dir(name), seed=7)
    ptrs = {n: p.data_ptr() for n, p in dst.named_parameters()}
    import_hf(dst, arch, tmp_path)
    for (n, a), (m, b) in zip(src.named_parameters(), dst.named_parameters()):
        assert n == m and a.dtype == b.dtype and torch.equal(a, b), n
    assert {n: p.data_ptr() for n, p in dst.named_parameters()} == ptrs


def test_bad_hybrid_checkpoint_loads_nothing(models, tmp_path):
    src = models["tiny-nemotronh"]
    export_hf(src, src.arch_config, tmp_path / "ok")
    t = load_file(str(tmp_path / "ok" / "model.safetensors"))
    t.pop("backbone.layers.2.mixer.A_log")
    t["backbone.layers.0.mixer.D"] = t["backbone.layers.0.mixer.D"].float()
    (tmp_path / "bad").mkdir()
    save_file(t, str(tmp_path / "bad" / "model.safetensors"))
    (tmp_path / "bad" / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    dst = build_consistent_hybrid_model(builtin_model_dir("tiny-nemotronh"), seed=7)
    before = {n: p.detach().clone() for n, p in dst.named_parameters()}
    with pytest.raises(CheckpointMismatchError, match=r"(?s)missing tensors.*A_log.*wrong dtype for backbone.layers.0.mixer.D"):
        import_hf(dst, dst.arch_config, tmp_path / "bad")
    assert all(torch.equal(p, before[n]) for n, p in dst.named_parameters())


# Cross-implementation sanity check (the one tolerance-based comparison in this file): transformers' torch path in float32 on the exported
# bf16 weights vs our bf16 model.  Metric: mean |logit difference| / mean |logit|.  bf16 rounding of activations
# gives ~1e-2 relative per element, averaging to <= 1e-2 (measured 0.6-0.8%); a mapping error (conv taps reversed,
# D dropped, wrong split order) gives 0.35 .. 1.2.  HF's Mamba2 gated norm is NOT grouped (vLLM's and mamba_ssm's
# are), so the Mamba2 check uses n_groups=1 where both agree (with n_groups=2 the difference is ~0.15).
HF_REL_TOL = 0.03


def _vs_transformers(hf: dict, tmp_path, breaker=None) -> float:
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = build_consistent_hybrid_model(hf, seed=0)
    export_hf(model, model.arch_config, tmp_path)
    if breaker is not None:
        t = load_file(str(tmp_path / "model.safetensors"))
        breaker(t)
        save_file(t, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ref, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, local_files_only=True,
                                                                  output_loading_info=True)
    assert not any(info.values()), info  # every tensor mapped, nothing left at random init
    ids = tokens(2, 37, seed=6)
    with torch.no_grad():
        ours = model(ids, None, None)
        theirs = ref(input_ids=ids).logits.float()
    return ((ours - theirs).abs().mean() / theirs.abs().mean()).item()


@pytest.mark.parametrize("name", NAMES)
def test_transformers_loads_export(name, tmp_path):
    hf = hf_cfg(name)
    if name == "tiny-mamba2":
        hf["n_groups"] = 1
    assert _vs_transformers(hf, tmp_path) <= HF_REL_TOL


def test_transformers_check_catches_reversed_conv(tmp_path):
    key = "backbone.layers.0.mixer.conv1d.weight"
    err = _vs_transformers(hf_cfg("tiny-nemotronh"), tmp_path, lambda t: t.__setitem__(key, t[key].flip(-1).contiguous()))
    assert err > 5 * HF_REL_TOL


# ---------------------------------------------------------------------------------------------- Megatron-LM --spec
def test_entry_point_spec_builds_consistent_model():
    from megatron.core.transformer.spec_utils import ModuleSpec, import_module

    from megatron_consistent.layers.hybrid import _hybrid_model_class, make_hybrid_transformer_config
    from megatron_consistent.layers.builder import prepare_build
    from megatron_consistent.layers.output import ConsistentOutputLayer

    spec = import_module(("megatron_consistent.layers.entry_points", "consistent_hybrid_stack_spec"))  # args.spec, split
    assert isinstance(spec, ModuleSpec) and spec.module is lh.ConsistentHybridStack
    arch, dtype = prepare_build(builtin_model_dir("tiny-nemotronh"), None, {})
    config = make_hybrid_transformer_config(arch, dtype)  # what Megatron-LM's args would give: mamba_* sizes, relu2 MLP
    cls = _hybrid_model_class()
    kwargs = lh._hybrid_model_kwargs(cls, arch, config, spec)
    model = cls(**kwargs)
    assert isinstance(model.output_layer, ConsistentOutputLayer)  # swapped by the registration hook
    assert isinstance(model.decoder.final_norm, lh.ConsistentRMSNorm)
    mixer = model.decoder.layers[0].mixer
    assert isinstance(mixer, lh.ConsistentMambaMixer) and mixer.ssm.chunk_size == 128 and mixer.ssm.num_heads == arch.ssm.num_heads
    ids = tokens(1, 20, seed=8)
    with torch.no_grad():
        assert torch.isfinite(model(ids, None, None)).all()
    with pytest.raises(UnsupportedConfigError, match="rotary"):  # refused while the model is built
        cls(**{**kwargs, "position_embedding_type": "rope"})


def test_entry_point_moe_layers_read_the_transformer_config():
    """Megatron-LM E layers: the MoE routing / sizes come from the TransformerConfig's moe_* fields."""
    import dataclasses

    from megatron.core.transformer.spec_utils import import_module

    from megatron_consistent.layers.builder import make_transformer_config, prepare_build
    from megatron_consistent.layers.moe import ConsistentMoELayer

    spec = import_module(("megatron_consistent.layers.entry_points", "consistent_hybrid_stack_spec"))
    arch, dtype = prepare_build(builtin_model_dir("tiny-nemotronh-moe"), None, {})
    moe_args = dict(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=64, moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=128, moe_router_num_groups=2,
                    moe_router_group_topk=1, moe_router_topk_scaling_factor=2.5)
    config = make_transformer_config(dataclasses.replace(arch, num_experts=0), dtype, consistent=True, gated_linear_unit=False,
                                     activation_func=torch.nn.functional.relu, mamba_state_dim=16, mamba_head_dim=16,
                                     mamba_num_groups=2, mamba_num_heads=8, **moe_args)
    cls = lh._hybrid_model_class()
    model = cls(**lh._hybrid_model_kwargs(cls, arch, config, spec))
    moe = model.decoder.layers[1].mlp
    assert isinstance(moe, ConsistentMoELayer) and moe.activation == "relu2"
    a = moe.arch
    assert (a.moe_scoring, a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size, a.shared_expert_intermediate_size,
            a.moe_n_group, a.moe_topk_group, a.routed_scaling_factor, a.norm_topk_prob) == ("sigmoid", 8, 2, 64, 128, 2, 1, 2.5, True)
    with torch.no_grad():
        assert torch.isfinite(model(tokens(1, 20, seed=9), None, None)).all()
    with pytest.raises(UnsupportedConfigError, match="non-gated"):
        lh.ConsistentHybridMoELayer(dataclasses.replace(config, gated_linear_unit=True))

"""Megatron-Core's own MoELayer (all-gather token dispatcher, CPU) with the consistent router / experts / combine.

* the GPT model whose MoE layers are Megatron's ``MoELayer`` (``moe_impl="megatron"``) gives logits
  torch.equal to the :class:`ConsistentMoELayer` model (``moe_impl="module"``) with the same weights, for
  the three built-in MoE configs (top-1, top-2 renormalised, top-8 + gated shared expert), and the same routes;
* hypothesis: any batch composition — a row alone == the row in the batch (Megatron path);
* broken variants are caught: Megatron's native combine (weighted rows summed by the unpermute in bf16)
  differs; a dispatcher row order other than the one the experts verify raises;
* Megatron's aux-loss machinery (coeff > 0, training) changes no forward value but reaches the router gradient;
* gradients of the Megatron-path model vs the float64 reference (verify/moe_reference.py) within
  ``verify.reference.GRAD_REL_TOL``;
* unsupported options are refused by name.
"""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_consistent.config import UnsupportedConfigError, builtin_model_dir
from megatron_consistent.layers import build_consistent_gpt_model
from megatron_consistent.layers import moe_megatron as mm
from megatron_consistent.layers.model import _positions
from megatron_consistent.layers.moe import collect_routes

CONFIGS = ["tiny-qwen3moe-top1", "tiny-mixtral-top2", "tiny-qwen2moe-top8-shared"]
_CACHE: dict = {}


def _model(name: str, impl: str, seed: int = 0, **kw):
    key = (name, impl, seed, tuple(sorted(kw.items())))
    if key not in _CACHE:
        _CACHE[key] = build_consistent_gpt_model(builtin_model_dir(name), seed=seed, moe_impl=impl, **kw)
    return _CACHE[key]


def _logits(model, ids):
    return model(ids, _positions(ids), None)


def _ids(vocab, b, s, seed):
    return torch.randint(3, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", CONFIGS)
def test_megatron_moelayer_equals_module_path(name):
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    same_seed, meg = _model(name, "module"), _model(name, "megatron")
    assert meg.moe_impl == "megatron" and same_seed.moe_impl == "module"
    sd0 = same_seed.state_dict()
    assert set(meg.state_dict()) == set(sd0)  # same parameter names: converters / export are shared
    # same seed -> same weights (same construction / RNG order as the module path)
    assert all(torch.equal(sd0[k], v) for k, v in meg.state_dict().items() if isinstance(v, torch.Tensor))
    moe_layers = [layer.mlp for layer in meg.decoder.layers if meg.arch_config.layer_is_moe(layer.layer_number - 1)]
    assert moe_layers and all(type(m) is MoELayer for m in moe_layers)  # Megatron's class itself, not a subclass
    assert all(isinstance(m.token_dispatcher, MoEAllGatherTokenDispatcher) for m in moe_layers)
    assert all(isinstance(m.experts, mm.ConsistentExperts) for m in moe_layers)
    module = build_consistent_gpt_model(builtin_model_dir(name), seed=1, moe_impl="module")  # other weights, mapped over
    meg.load_state_dict(module.state_dict())
    ids = _ids(meg.arch_config.vocab_size, 3, 23, seed=4)
    with torch.no_grad():
        a, b = _logits(module, ids), _logits(meg, ids)
        ra, rb = collect_routes(module), collect_routes(meg)
    assert torch.equal(a, b)
    assert sorted(ra) == sorted(rb) and all(torch.equal(ra[i], rb[i]) for i in ra)


@pytest.mark.parametrize("name", ["tiny-mixtral-top2"])  # all three configs: tests/test_gpu_moe_dispatch.py (CUDA)
def test_alltoall_dispatcher_equals_allgather_on_cpu(name):
    """Megatron's MoEAlltoAllTokenDispatcher at EP=1 on the CPU (its CUDA stream calls stubbed as no-ops; the
    product refuses 'alltoall' without CUDA): values, routes and gradients equal to the all-gather dispatcher."""
    from _cuda_on_cpu import alltoall_dispatcher_stubs
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from megatron_consistent.layers import init_cpu_process_group

    init_cpu_process_group()  # before claiming CUDA (it seeds Megatron's CUDA RNG where CUDA is available)
    with alltoall_dispatcher_stubs(claim_cuda=True):
        a2a = build_consistent_gpt_model(builtin_model_dir(name), seed=0, moe_impl="megatron", moe_token_dispatcher="alltoall")
    assert isinstance(a2a.decoder.layers[1].mlp.token_dispatcher, MoEAlltoAllTokenDispatcher)
    module, ag = _model(name, "module"), _model(name, "megatron")
    ag.load_state_dict(module.state_dict())
    a2a.load_state_dict(module.state_dict())
    ids = _ids(module.arch_config.vocab_size, 3, 29, seed=6)
    with alltoall_dispatcher_stubs(), torch.no_grad():  # the forward needs the stream stubs again
        lm, la, lg = _logits(module, ids), _logits(a2a, ids), _logits(ag, ids)
        ra, rg = collect_routes(a2a), collect_routes(ag)
    assert torch.equal(la, lg) and torch.equal(lg, lm)
    assert sorted(ra) == sorted(rg) and all(torch.equal(ra[i], rg[i]) for i in ra)
    with alltoall_dispatcher_stubs():
        for m in (a2a, ag):
            m.zero_grad(set_to_none=True)
            _logits(m, ids).float().square().mean().backward()
    pa, pg = dict(a2a.named_parameters()), dict(ag.named_parameters())
    assert all(torch.equal(pa[k].grad, pg[k].grad) for k in pa)  # CPU: even the backward is identical
    ag.zero_grad(set_to_none=True)


@settings(max_examples=6, deadline=None)
@given(lens=st.lists(st.integers(1, 19), min_size=2, max_size=4), pick=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_megatron_path_row_alone_equals_row_in_batch(lens, pick, seed):
    meg = _model("tiny-mixtral-top2", "megatron")
    s = max(lens)
    ids = _ids(meg.arch_config.vocab_size, len(lens), s, seed)
    i = pick % len(lens)
    with torch.no_grad():
        batch = _logits(meg, ids)
        routes = collect_routes(meg)
        alone = _logits(meg, ids[i : i + 1, : lens[i]])
        routes_alone = collect_routes(meg)
    assert torch.equal(alone[0], batch[i, : lens[i]])
    for layer, r in routes.items():  # [s*b, k] in [s, b] token order
        assert torch.equal(routes_alone[layer], r.view(s, len(lens), -1)[: lens[i], i])


def _native_megatron_rows(products, pair_of_row, routes, n_local, group=None):
    """BROKEN on purpose: Megatron's SequentialMLP convention -- each row's weighted output in the model dtype, the
    unpermute's scatter_add sums a token's rows (no fp32 slot-order combine)."""
    return products.to(torch.bfloat16).to(torch.float32)


def test_broken_combine_and_broken_layout_are_caught(monkeypatch):
    module = _model("tiny-qwen2moe-top8-shared", "module")
    meg = _model("tiny-qwen2moe-top8-shared", "megatron")
    meg.load_state_dict(module.state_dict())
    ids = _ids(meg.arch_config.vocab_size, 2, 17, seed=9)
    with torch.no_grad():
        ref = _logits(module, ids)
        assert torch.equal(_logits(meg, ids), ref)
        monkeypatch.setattr(mm, "slot_order_rows", _native_megatron_rows)
        assert not torch.equal(_logits(meg, ids), ref)
        monkeypatch.undo()
        # a row order other than Megatron's (tokens descending within each expert) must be detected, not used
        right = mm.dispatched_pairs

        def tokens_descending(routes, first, count):
            t, k = routes.shape
            flipped = right(routes.flip(0), first, count)
            return (t - 1 - flipped // k) * k + flipped % k

        monkeypatch.setattr(mm, "dispatched_pairs", tokens_descending)
        with pytest.raises(RuntimeError, match="expert-major, token-ascending"):
            _logits(meg, ids)
        monkeypatch.undo()
        assert torch.equal(_logits(meg, ids), ref)


def test_megatron_path_fp8_experts_equal_module_path():
    from megatron_consistent.layers.fp8 import enable_fp8

    name = "tiny-qwen2moe-top8-shared"
    module = build_consistent_gpt_model(builtin_model_dir(name), seed=2, moe_impl="module")
    meg = build_consistent_gpt_model(builtin_model_dir(name), seed=2, moe_impl="megatron")
    bound_m, bound_g = enable_fp8(module), enable_fp8(meg)
    assert bound_m == bound_g and "decoder.layers.0.mlp" in bound_g
    assert meg.decoder.layers[0].mlp.experts.fp8 is meg.decoder.layers[0].mlp.shared_experts.fp8 is not None
    ids = _ids(meg.arch_config.vocab_size, 2, 15, seed=3)
    with torch.no_grad():
        fp8_logits = _logits(meg, ids)
        assert torch.equal(fp8_logits, _logits(module, ids))
        meg.decoder.layers[0].mlp.shared_experts.fp8 = None  # bf16 shared expert: a different value, caught
        assert not torch.equal(_logits(meg, ids), fp8_logits)


def test_megatron_aux_loss_changes_no_forward_value_but_reaches_the_router():
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    name = "tiny-qwen3moe-top1"
    plain = build_consistent_gpt_model(builtin_model_dir(name), seed=0, moe_impl="megatron")
    aux = build_consistent_gpt_model(builtin_model_dir(name), seed=0, moe_impl="megatron", moe_aux_loss_coeff=0.05)
    assert aux.config.moe_aux_loss_coeff == 0.05 and plain.config.moe_aux_loss_coeff == 0.0
    aux.load_state_dict(plain.state_dict())
    plain.train()
    aux.train()
    ids = _ids(plain.arch_config.vocab_size, 2, 19, seed=5)
    clear_aux_losses_tracker()
    la, lb = _logits(plain, ids), _logits(aux, ids)
    assert torch.equal(la, lb)  # forward values unchanged (MoEAuxLossAutoScaler is the identity)
    tracked = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"]
    assert float(tracked.sum()) > 0  # Megatron's tracker recorded it
    la.float().sum().backward()
    lb.float().sum().backward()
    router = "decoder.layers.1.mlp.router.weight"
    ga, gb = dict(plain.named_parameters())[router].grad, dict(aux.named_parameters())[router].grad
    assert not torch.equal(ga, gb)  # the aux-loss gradient reached the router
    clear_aux_losses_tracker()


# Layer level (float32 vs float64, as tests/test_moe_reference.py): the chain is ~6 float32 ops, each a reduction over
# <= 128 terms (blocked / tree sums, ~log2(K) * 6e-8 each), so ~1e-6 is expected; 1e-4 leaves ample headroom while a
# wrong Jacobian (missing renormalisation term, wrong slot, a lost shared-expert gate) gives >= 1e-2.
LAYER_GRAD_REL_TOL = 1e-4


def _hf_layer_weights(arch, layer, i):
    """The MoE layer's parameters under their HF names (the MoE family's weight table), float64 leaves."""
    from megatron_consistent.architectures import hf_names

    names, m = hf_names(arch), f"decoder.layers.{i}.mlp."
    inter = arch.moe_intermediate_size
    fc1, fc2 = layer.experts.linear_fc1.weight.detach(), layer.experts.linear_fc2.weight.detach()
    gate_up, down = names[m + "experts.linear_fc1.weight"], names[m + "experts.linear_fc2.weight"]
    w = {names[m + "router.weight"][0]: layer.router.weight.detach()}
    for e in range(arch.num_experts):
        w[gate_up[2 * e]], w[gate_up[2 * e + 1]] = fc1[e, :inter], fc1[e, inter:]
        w[down[e]] = fc2[e]
    if layer.shared_experts is not None:
        se, n = layer.shared_experts, arch.shared_expert_intermediate_size
        (s_gate, s_up), (s_down,) = names[m + "shared_experts.linear_fc1.weight"], names[m + "shared_experts.linear_fc2.weight"]
        w[s_gate], w[s_up] = se.linear_fc1.weight.detach()[:n], se.linear_fc1.weight.detach()[n:]
        w[s_down] = se.linear_fc2.weight.detach()
        w[names[m + "shared_experts.gate_weight"][0]] = se.gate_weight.detach()
    return {k: v.double().requires_grad_(True) for k, v in w.items()}, names, m


@pytest.mark.parametrize("name", ["tiny-mixtral-top2", "tiny-qwen2moe-top8-shared"])
def test_megatron_moelayer_gradients_vs_float64_moe_reference(name):
    from megatron_consistent.verify.moe_reference import moe_mlp_f64

    model = build_consistent_gpt_model(builtin_model_dir(name), seed=3, dtype=torch.float32, moe_impl="megatron")
    arch, i = model.arch_config, 1
    layer = model.decoder.layers[i].mlp
    g = torch.Generator().manual_seed(8)
    x = torch.randn(13, 2, arch.hidden_size, generator=g).requires_grad_(True)
    upstream = torch.randn(13, 2, arch.hidden_size, generator=g)
    out, bias = layer(x)
    assert bias is None and out.dtype == torch.float32
    (out * upstream).sum().backward()
    w64, names, m = _hf_layer_weights(arch, layer, i)
    router = names[m + "router.weight"][0]
    x64 = x.detach().double().requires_grad_(True)
    ref = moe_mlp_f64(w64, arch, i, x64)
    (ref * upstream.double()).sum().backward()
    assert (out.double() - ref).norm() / ref.norm() <= LAYER_GRAD_REL_TOL  # also: the same experts were chosen
    ours = {"x": x.grad, router: layer.router.weight.grad}
    theirs = {"x": x64.grad, router: w64[router].grad}
    down = names[m + "experts.linear_fc2.weight"]
    routed = torch.unique(layer.router.last_routes).tolist()
    for e in routed:
        theirs[f"fc2.{e}"], ours[f"fc2.{e}"] = w64[down[e]].grad, layer.experts.linear_fc2.weight.grad[e]
    unrouted = sorted(set(range(arch.num_experts)) - set(routed))
    assert all(not layer.experts.linear_fc1.weight.grad[e].any() for e in unrouted)
    if layer.shared_experts is not None:
        ours["shared_gate"], theirs["shared_gate"] = layer.shared_experts.gate_weight.grad, w64[names[m + "shared_experts.gate_weight"][0]].grad
        shared_down = names[m + "shared_experts.linear_fc2.weight"][0]
        ours["shared_down"], theirs["shared_down"] = layer.shared_experts.linear_fc2.weight.grad, w64[shared_down].grad
    errs = {k: ((ours[k].double() - theirs[k]).norm() / theirs[k].norm()).item() for k in ours}
    print(f"{name}: max relative gradient error {max(errs.values()):.2e} ({max(errs, key=errs.get)}) over {len(errs)} tensors")
    for k, err in errs.items():
        assert err <= LAYER_GRAD_REL_TOL, f"{k}: relative gradient error {err:.2e}"


def test_megatron_path_model_gradients_vs_float64_reference(monkeypatch):
    """Whole model (tiny-mixtral-top2) through verify.reference.gradient_check (MoE blocks: verify/moe_reference.py)."""
    import megatron_consistent.layers as layers
    from megatron_consistent.verify.reference import GRAD_REL_TOL, LOSS_REL_TOL, gradient_check

    built = []
    build = layers.build_consistent_model

    def megatron_build(*a, **k):
        m = build(*a, **{**k, "moe_impl": "megatron"})
        built.append(m.moe_impl)
        return m

    monkeypatch.setattr(layers, "build_consistent_model", megatron_build)
    r = gradient_check(builtin_model_dir("tiny-mixtral-top2"), batch=2, seq=12)
    print(f"tiny-mixtral-top2 model: max relative gradient error {r['max_rel_err']:.2e} ({r['worst']})")
    assert built and set(built) == {"megatron"}
    assert r["max_rel_err"] <= GRAD_REL_TOL, (r["worst"], r["max_rel_err"])
    assert r["loss_rel_err"] <= LOSS_REL_TOL
    assert any(".experts." in k for k in r["rel_errors"]) and any(k.endswith(".gate.weight") for k in r["rel_errors"])


def test_unsupported_options_refused_by_name():
    path = builtin_model_dir("tiny-mixtral-top2")
    if not torch.cuda.is_available():  # Megatron's all-to-all dispatcher creates a torch.cuda.Stream
        with pytest.raises(UnsupportedConfigError, match="alltoall"):
            build_consistent_gpt_model(path, moe_impl="megatron", moe_token_dispatcher="alltoall")
    with pytest.raises(UnsupportedConfigError, match="flex"):
        build_consistent_gpt_model(path, moe_impl="megatron", moe_token_dispatcher="flex")
    with pytest.raises(UnsupportedConfigError, match="moe_impl"):
        build_consistent_gpt_model(path, moe_impl="sequential")
    cfg = types.SimpleNamespace(expert_model_parallel_size=3, num_moe_experts=8, tensor_model_parallel_size=2,
                                moe_token_dispatcher_type="allgather", moe_expert_capacity_factor=1.0, moe_permute_fusion=True)
    with pytest.raises(UnsupportedConfigError, match=r"expert_model_parallel_size=3 with num_moe_experts=8.*tensor "
                       r"parallelism without sequence parallelism .tensor_model_parallel_size=2.*moe_expert_capacity_factor=1.0.*"
                       r"moe_permute_fusion"):
        mm.check_megatron_moe_config(cfg)
    with pytest.raises(UnsupportedConfigError, match="hybrid"):
        mm.check_megatron_moe_arch(types.SimpleNamespace(is_moe=True, is_hybrid=True))

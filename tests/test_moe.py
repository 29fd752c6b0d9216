"""MoE kernels and the MoE end-to-end check: exact equality (torch.equal) everywhere.

* a token's route and expert output alone == inside a batch (any batch size, any
  other tokens sharing its experts);
* exact ties in router scores (identical router rows) break to the lowest expert index;
* end to end: a real vLLM engine with the plugin vs the Megatron recompute on an MoE
  config whose router has exact ties forced in every layer: zero mismatch and
  routing agreement 1.0, and both sides chose the lower index of every tied pair.
"""

from __future__ import annotations

import pytest
import torch

from megatron_consistent.kernels import moe as kmoe


def _weights(E, H, I, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, std=0.05: (torch.randn(*s, generator=g) * std).to(dtype)  # noqa: E731
    return r(E, H, std=0.1), r(E, 2 * I, H), r(E, H, I), (r(2 * I, H), r(H, I), r(1, H))


@pytest.mark.parametrize("scoring, norm, top_k, shared", [("softmax", False, 1, False), ("softmax", True, 2, False),
                                                           ("softmax", False, 8, True), ("sigmoid", True, 4, False)])
def test_row_alone_equals_row_in_batch(scoring, norm, top_k, shared):
    E, H, I, T = 16, 128, 32, 37
    router, fc1, fc2, sh = _weights(E, H, I)
    x = (torch.randn(T, H, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    bias = torch.linspace(-0.01, 0.01, E) if scoring == "sigmoid" else None
    w, e = kmoe.route(x, router, top_k, scoring, bias=bias, norm_topk_prob=norm)
    y = kmoe.moe_experts(x, e, w, fc1, fc2, sh if shared else None)
    assert w.dtype == torch.float32 and e.dtype == torch.int64 and y.dtype == torch.bfloat16
    for t in range(T):
        w1, e1 = kmoe.route(x[t : t + 1], router, top_k, scoring, bias=bias, norm_topk_prob=norm)
        assert torch.equal(e1, e[t : t + 1]) and torch.equal(w1, w[t : t + 1])
        assert torch.equal(kmoe.moe_experts(x[t : t + 1], e1, w1, fc1, fc2, sh if shared else None), y[t : t + 1])
    # reversed order and a sub-batch: same rows
    rev = torch.flip(x, [0])
    wr, er = kmoe.route(rev, router, top_k, scoring, bias=bias, norm_topk_prob=norm)
    assert torch.equal(torch.flip(kmoe.moe_experts(rev, er, wr, fc1, fc2, sh if shared else None), [0]), y)


def test_expert_result_independent_of_tokens_sharing_it():
    E, H, I = 4, 128, 32
    _, fc1, fc2, _ = _weights(E, H, I)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    experts = torch.zeros(9, 1, dtype=torch.int64)  # all tokens on expert 0
    w = torch.ones(9, 1)
    together = kmoe.moe_experts(x, experts, w, fc1, fc2)
    for t in range(9):
        assert torch.equal(kmoe.moe_experts(x[t : t + 1], experts[:1], w[:1], fc1, fc2), together[t : t + 1])


def test_exact_ties_pick_lowest_index():
    E, H = 8, 128
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    # all-equal scores: experts 0..k-1 in order
    w, e = kmoe.route(x, torch.zeros(E, H, dtype=torch.bfloat16), 3)
    assert torch.equal(e, torch.tensor([[0, 1, 2]] * 5))
    assert torch.equal(w, torch.full((5, 3), 1.0 / 8))
    # identical router rows 6, 3, 5 that dominate: scores tie exactly, order 3, 5, 6
    router = torch.zeros(E, H, dtype=torch.bfloat16)
    router[[3, 5, 6]] = x[0].sign() * 0.5
    w, e = kmoe.route(x[:1], router, 3)
    assert torch.equal(e, torch.tensor([[3, 5, 6]]))
    assert w[0, 0] == w[0, 1] == w[0, 2]
    # tie between two experts for the second slot only
    router[5] = 0
    router[7] = router[3]
    w, e = kmoe.route(x[:1], router, 2)
    assert torch.equal(e, torch.tensor([[3, 6]]))
    # sigmoid scoring with a group limit: groups of 2, tied groups -> lowest group
    w, e = kmoe.route(x[:2], torch.zeros(E, H, dtype=torch.bfloat16), 2, "sigmoid", n_group=4, topk_group=1)
    assert torch.equal(e, torch.tensor([[0, 1], [0, 1]]))


def test_nan_scores_refused():
    with pytest.raises(ValueError, match="NaN"):
        kmoe.route_logits(torch.tensor([[0.0, float("nan")]]), 1)


def test_megatron_moe_layer_rows_and_routes():
    from megatron_consistent.layers import build_consistent_gpt_model, compute_token_logprobs
    from megatron_consistent.layers.moe import collect_routes
    from megatron_consistent.config import builtin_model_dir

    model = build_consistent_gpt_model(builtin_model_dir("tiny-qwen2moe-top8-shared"), seed=0)
    ids = torch.randint(3, 512, (3, 21), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        batched = compute_token_logprobs(model, ids)
        routes = collect_routes(model)
        assert sorted(routes) == [0, 1] and routes[0].shape == (21 * 3, 8)
        per_seq = routes[1].reshape(21, 3, 8)
        for r in range(3):
            assert torch.equal(compute_token_logprobs(model, ids[r : r + 1])[0], batched[r])
            assert torch.equal(collect_routes(model)[1].reshape(21, 8), per_seq[:, r])


def _tie_routers(model):
    """Router rows 2j+1 := rows 2j in every MoE layer: every token sees exact ties in every pair of experts."""
    with torch.no_grad():
        for layer in model.decoder.layers:
            r = getattr(getattr(layer.mlp, "router", None), "weight", None)
            if r is not None:
                r[1::2] = r[0::2]
    return model


@pytest.mark.engine
def test_end_to_end_zero_mismatch_with_forced_router_ties(tmp_path, monkeypatch):
    import megatron_consistent.layers as layers
    from megatron_consistent.config import builtin_model_dir
    from megatron_consistent.verify.check import load_check_config, run_check
    from megatron_consistent.verify.routing import load_engine_routes

    build = layers.build_consistent_gpt_model
    monkeypatch.setattr(layers, "build_consistent_gpt_model", lambda *a, **k: _tie_routers(build(*a, **k)))
    cfg = load_check_config(hf_config=str(builtin_model_dir("tiny-qwen3moe-top1")), num_prompts=12, max_tokens=16,
                            max_num_batched_tokens=32, out_dir=str(tmp_path), max_prompt_len=60, shared_prefix_len=40,
                            prefix_groups=3, mode="consistent")
    report = run_check(cfg)
    c = report["consistent"]
    assert c["tokens"] == 12 * 16
    assert c["exact_fraction"] == 1.0 and c["max_abs"] == 0.0 and report["zero_mismatch"]
    assert c["routing_agreement"] == 1.0 and c["routed_pairs"] >= 12 * 15
    engine = load_engine_routes(tmp_path / "routes" / "consistent")
    chosen = torch.stack(list(engine.values()))
    assert (chosen % 2 == 0).all()  # every tie went to the lower index of its pair

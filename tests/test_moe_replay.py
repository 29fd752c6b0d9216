"""Routing-replay baseline (issue #7): stock kernels on both sides, the trainer's routes forced to the stock engine's.

* unit: ``layers.moe.replay_routes`` on the stock MoE block: replaying the block's own
  routes changes nothing (torch.equal); replaying other experts makes the block use exactly
  those (collect_routes, as sets) and changes the output; masked-off rows keep their own;
* ``ReplayRoutes``: a position the engine did not compute takes the route of the same
  token prefix;
* end to end: a real stock vLLM engine (routes captured by ``verify/stock_routes.py``) vs
  the stock Megatron recompute with those routes forced: routing agreement 1.0 by
  construction, yet the log-probs are not bitwise equal (max_abs > 0) — replay alone is
  not enough for zero mismatch.
"""

from __future__ import annotations

import pytest
import torch

from megatron_consistent.config import builtin_model_dir


def _stock(name):
    from megatron_consistent.layers import build_stock_gpt_model

    return build_stock_gpt_model(builtin_model_dir(name), seed=0)


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                       reason="needs a CUDA device")])
# Megatron's rotary embedding makes its frequencies on the current CUDA device whenever one exists, so a stock model
# moved to the CPU cannot run on a GPU machine (session 18, H200)
CPU = pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only machine: Megatron's "
                                                   "rotary embedding puts its frequencies on the GPU when one exists"))


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("name", ["tiny-mixtral-top2", "tiny-qwen2moe-top8-shared"])
def test_stock_block_replay(name, device):
    """Forced routes replace the block's own; the routes and masks come on the CPU (as the engine's routes files
    give them) whatever the model's device."""
    from megatron_consistent.layers import compute_stock_token_logprobs
    from megatron_consistent.layers.moe import collect_routes, replay_routes

    model = _stock(name).to(device)
    ids = torch.randint(3, 512, (2, 13), generator=torch.Generator().manual_seed(5)).to(device)
    with torch.no_grad():
        own = compute_stock_token_logprobs(model, ids)
        routes = {i: r.cpu() for i, r in collect_routes(model).items()}
        T = ids.numel()
        all_rows = torch.ones(T, dtype=torch.bool)
        with replay_routes(model, {i: (r, all_rows) for i, r in routes.items()}):
            assert torch.equal(compute_stock_token_logprobs(model, ids), own)
        E = model.decoder.layers[next(iter(routes))].mlp.arch.num_experts
        shifted = {i: (r + 1) % E for i, r in routes.items()}
        with replay_routes(model, {i: (r, all_rows) for i, r in shifted.items()}):
            other = compute_stock_token_logprobs(model, ids)
            got = collect_routes(model)
        for i in routes:
            assert torch.equal(got[i].cpu().sort(-1).values, shifted[i].sort(-1).values)
        assert not torch.equal(other, own)
        half = torch.arange(T) % 2 == 0
        with replay_routes(model, {i: (r, half) for i, r in shifted.items()}):
            compute_stock_token_logprobs(model, ids)
            got = collect_routes(model)
        for i in routes:
            assert torch.equal(got[i].cpu()[half].sort(-1).values, shifted[i][half].sort(-1).values)
            assert torch.equal(got[i].cpu()[~half], routes[i][~half])
    assert all(layer.mlp.forced_routes is None for layer in model.decoder.layers if hasattr(layer.mlp, "forced_routes"))


def test_replay_routes_prefix_lookup():
    from megatron_consistent.verify.routing import ReplayRoutes

    seqs = [[5, 6, 7, 8], [5, 6, 9]]
    e = lambda v: torch.tensor([[v, v + 1]])  # noqa: E731  [1 MoE layer, k=2]
    engine = {(0, 0): e(0), (0, 1): e(2), (0, 2): e(4), (1, 2): e(6)}  # request 1's prefix [5, 6] was a cache hit
    replay = ReplayRoutes(engine, seqs, (3,))
    forced = replay(0, [4, 3], 4)
    ex, mask = forced[3]
    ex, mask = ex.reshape(4, 2, 2), mask.reshape(4, 2)
    assert torch.equal(mask, torch.tensor([[True, True], [True, True], [True, True], [False, False]]))
    assert torch.equal(ex[:2, 1], ex[:2, 0]) and torch.equal(ex[2, 1], e(6)[0])
    assert replay.missing == 0 and replay.from_prefix == 2  # position 3 of request 0 is its last token: not counted


@pytest.mark.engine
def test_end_to_end_replay_is_not_enough(tmp_path):
    from megatron_consistent.verify.check import load_check_config, run_check

    cfg = load_check_config(hf_config=str(builtin_model_dir("tiny-mixtral-top2")), num_prompts=12, max_tokens=16,
                            max_num_batched_tokens=32, out_dir=str(tmp_path), max_prompt_len=60, shared_prefix_len=40,
                            prefix_groups=3, mode="baseline")
    report = run_check(cfg)
    b, r = report["baseline"], report["routing_replay"]
    assert b["tokens"] == r["tokens"] == 12 * 16
    assert r["routing_agreement"] == 1.0 and r["routed_pairs"] >= 12 * 15 * 2 * 2  # by construction
    assert r["unrouted_positions"] == 0
    assert r["max_abs"] > 0 and r["exact_fraction"] < 1.0  # replay alone: still not bitwise equal
    assert 0.0 < b["routing_agreement"] <= 1.0 and b["routed_pairs"] == r["routed_pairs"]


def test_stock_routes_from_vllm_outputs_round_trip(tmp_path):
    """CUDA source: vLLM's ``routed_experts`` [positions, num_hidden_layers, k] per request -> routes files ->
    (request, position) -> the MoE layers' experts; dense layers dropped, positions from 0; a request without routes
    is refused before any file is written."""
    import numpy as np

    from megatron_consistent.verify.routing import load_engine_routes
    from megatron_consistent.verify.stock_routes import write_output_routes

    rng = np.random.default_rng(0)
    moe_layers = (1, 3)
    routed = [rng.integers(0, 8, size=(n, 4, 2)).astype(np.int32) for n in (5, 1, 9)]
    write_output_routes(str(tmp_path / "r"), routed, moe_layers)
    got = load_engine_routes(tmp_path / "r")
    assert len(got) == 5 + 1 + 9
    for i, r in enumerate(routed):
        for p in range(len(r)):
            assert torch.equal(got[(i, p)], torch.from_numpy(r[p, list(moe_layers)]).to(torch.int64))
    with pytest.raises(RuntimeError, match="enable_return_routed_experts"):
        write_output_routes(str(tmp_path / "none"), [routed[0], None], moe_layers)
    assert not (tmp_path / "none").exists()


def test_stock_engine_route_source_follows_the_platform(monkeypatch, tmp_path):
    """A stock MoE engine asked for routes: vLLM's own output on CUDA (no Python hook, which a CUDA-graph replay
    would skip), the capture hook on CPU (where vLLM refuses that output)."""
    pytest.importorskip("vllm")
    import vllm

    from megatron_consistent.verify import rollout

    built = []

    class FakeLLM:
        def __init__(self, **kwargs):
            built.append(kwargs)

        def collective_rpc(self, method, args=()):
            built.append(("rpc", method))
            return [[]]

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    req = rollout.RolloutRequest(model_dir=str(tmp_path), prompts=[[1]], consistent=False, dtype="bfloat16",
                                 stock_routes_dir=str(tmp_path / "routes"), enforce_eager=True)
    for cuda in (True, False):
        built.clear()
        monkeypatch.setattr(rollout, "stock_routes_from_outputs", lambda cuda=cuda: cuda)
        rollout.engine(req)
        kwargs = built[0]
        if cuda:
            assert kwargs.get("enable_return_routed_experts") is True and "worker_extension_cls" not in kwargs
            assert len(built) == 1
        else:
            assert "enable_return_routed_experts" not in kwargs and kwargs["worker_extension_cls"].endswith("StockRouteCapture")
            assert built[1] == ("rpc", "mc_capture_routes")

"""``diagnose``: an injected non-contract op in ONE layer of the vLLM plugin is named exactly (layer and op).

Each engine case starts one real vLLM engine (prefill chunks + forced decode steps) and
compares every op's output with the Megatron model's, bit for bit (torch.equal); dense and MoE
layers.  The replay of every op from the Megatron capture reproduces it (no engine).
"""

from __future__ import annotations

import pytest
import torch

from megatron_consistent.config import ArchConfig, load_hf_config
from megatron_consistent.conversion import export_hf
from megatron_consistent.layers import build_consistent_gpt_model
from megatron_consistent.verify.capture import MAMBA_MIXER_OPS, MOE_MLP_OPS, layer_ops, op_order
from megatron_consistent.config import builtin_model_dir
from megatron_consistent.verify.diagnose import (DiagnoseConfig, _layer_inputs, _load_weights, _qkv_canonical,
                                                 megatron_capture, render, replay, run_diagnose, run_op)
from megatron_consistent.verify.inputs import resolve_device


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("diag")
    arch = ArchConfig.from_hf(load_hf_config(builtin_model_dir("tiny-llama")))
    model = build_consistent_gpt_model(arch, seed=3)
    export_hf(model, arch, root / "model")
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, arch.vocab_size, (41,), generator=g).tolist()  # 2 prefill chunks at 32 tokens per step
    response = torch.randint(3, arch.vocab_size, (5,), generator=g).tolist()  # 5 decode steps
    return root, model, prompt, response


def _run(setup, name, fault=""):
    root, model, prompt, response = setup
    cfg = DiagnoseConfig(prompt=prompt, response=response, model_dir=str(root / "model"), out_dir=str(root / name),
                         max_num_batched_tokens=32, fault=fault)
    return run_diagnose(cfg, model=model)


@pytest.mark.engine
def test_injected_fault_is_named_exactly(setup):
    report = _run(setup, "fault", fault="layer1.o_proj")
    first = report["first_divergence"]
    assert first is not None and first["op"] == "layer1.o_proj" and first["layer"] == "layer1"
    assert first["max_abs"] > 0 and first["n_diff_tokens"] >= 1
    statuses = {r["op"]: r["status"] for r in report["ops"]}
    order = [op for op in op_order(setup[1].arch_config) if op in statuses]
    before = order[: order.index("layer1.o_proj")]
    assert before and all(statuses[op] == "equal" for op in before)
    assert report["engine_tokens_match"]
    rep = replay(report["repro"])  # the kernel reproduces Megatron's value, not the faulty engine's
    assert rep == {"op": "layer1.o_proj", "kernel_equals_megatron": True, "kernel_equals_vllm": False, "vllm_equals_megatron": False}
    assert "FIRST DIVERGENCE: layer1.o_proj" in render(report)


@pytest.mark.engine
def test_no_fault_no_divergence(setup):
    report = _run(setup, "clean")
    assert report["first_divergence"] is None
    compared = [r for r in report["ops"] if r["status"] != "missing"]
    assert all(r["status"] == "equal" for r in compared)
    ops = {r["op"] for r in compared}
    assert {"embed", "layer0.qkv", "layer1.attention", "final_norm", "logits", "logprobs"} <= ops
    assert report["engine_steps"] == 2 + 4  # two prefill chunks, four decode steps (the last token is never fed back)
    assert "no divergence" in render(report)


def test_qkv_canonical_layout_splits_query_groups():
    """Megatron's per-group [q heads of group, k, v] rows become [q | k | v] in HF head order."""
    arch = ArchConfig.from_hf(load_hf_config(builtin_model_dir("tiny-llama")))  # 4 q heads, 2 kv heads, head_dim 32
    hn, gs = arch.head_dim, 2
    blocks = []
    for g in range(2):
        blocks += [torch.full((hn,), 10.0 * g + j) for j in range(gs)] + [torch.full((hn,), 100.0 + g), torch.full((hn,), 200.0 + g)]
    t = torch.cat(blocks)[None, None]  # [s=1, b=1, 256]
    c = _qkv_canonical(t, arch)[0].reshape(-1, hn)[:, 0].tolist()
    assert c == [0.0, 1.0, 10.0, 11.0, 100.0, 101.0, 200.0, 201.0]


@pytest.mark.engine
def test_hybrid_fault_in_an_mlp_layer_is_the_first_divergent_mixer(tmp_path):
    """Nemotron-H (M * M - M * - M): every layer's norm, mixer and residual are compared -- Mamba (and inside its
    mixer in_proj, dt, the SSD output, the gated norm), attention, MLP -- and a non-contract down projection in the
    engine's MLP layer 3 makes ``layer3.mixer`` the first divergence, the two Mamba layers and the attention layer
    before it equal; its replay says the mixer is compared, not recomputed."""
    from megatron_consistent.layers import build_consistent_model

    arch = ArchConfig.from_hf(load_hf_config(builtin_model_dir("tiny-nemotronh")))
    model = build_consistent_model(arch, seed=2)
    export_hf(model, arch, tmp_path / "model")
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, arch.vocab_size, (45,), generator=g).tolist()
    response = torch.randint(3, arch.vocab_size, (4,), generator=g).tolist()
    cfg = DiagnoseConfig(prompt=prompt, response=response, model_dir=str(tmp_path / "model"), out_dir=str(tmp_path / "out"),
                         max_num_batched_tokens=32, fault="layer3.down")
    report = run_diagnose(cfg, model=model)
    first = report["first_divergence"]
    assert first is not None and first["op"] == "layer3.mixer"
    statuses = {r["op"]: r["status"] for r in report["ops"]}
    order = op_order(arch)
    assert all(statuses[op] == "equal" for op in order[: order.index("layer3.mixer")])
    assert {"layer0.ssd", "layer0.mixer", "layer1.mixer", "layer2.in_proj", "layer2.dt", "layer2.gated_norm",
            "layer3.norm"} <= set(order[: order.index("layer3.mixer")])
    rep = replay(report["repro"])
    assert rep["op"] == "layer3.mixer" and rep["replayed"] is False and rep["vllm_equals_megatron"] is False


@pytest.fixture(scope="module")
def moe_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("diag_moe")
    arch = ArchConfig.from_hf(load_hf_config(builtin_model_dir("tiny-qwen2moe-top8-shared")))  # both layers MoE
    model = build_consistent_gpt_model(arch, seed=4)
    export_hf(model, arch, root / "model")
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(3, arch.vocab_size, (37,), generator=g).tolist()
    response = torch.randint(3, arch.vocab_size, (4,), generator=g).tolist()
    return root, model, prompt, response


@pytest.mark.engine
def test_moe_fault_in_the_router_is_named_exactly_after_equal_moe_ops(moe_setup):
    """An MoE model: layer 0's router logits, routes and block output are compared and equal; a non-contract router
    matmul in layer 1 of the engine is the first divergence, and its replay reproduces Megatron's logits."""
    report = _run(moe_setup, "fault_router", fault="layer1.router_logits")
    first = report["first_divergence"]
    assert first is not None and first["op"] == "layer1.router_logits"
    statuses = {r["op"]: r["status"] for r in report["ops"]}
    assert all(statuses[f"layer0.{op}"] == "equal" for op in MOE_MLP_OPS)
    order = [op for op in op_order(moe_setup[1].arch_config) if op in statuses]
    assert all(statuses[op] == "equal" for op in order[: order.index("layer1.router_logits")])
    assert replay(report["repro"]) == {"op": "layer1.router_logits", "kernel_equals_megatron": True,
                                       "kernel_equals_vllm": False, "vllm_equals_megatron": False}


@pytest.mark.parametrize("name,moe_impl", [("tiny-llama", None), ("tiny-qwen3-qknorm-tied", None),
                                           ("tiny-qwen2moe-top8-shared", None), ("tiny-qwen2moe-top8-shared", "module"),
                                           ("tiny-qwen3moe-top1", None), ("tiny-nemotronh-moe", None)])
def test_every_op_replayed_from_its_inputs_reproduces_the_capture(name, moe_impl, tmp_path):
    """What a repro folder's replay runs (``run_op`` on the op's captured inputs and its HF weights) gives each
    captured Megatron op bit for bit -- dense, q/k-norm, tied, MoE with a shared expert, mixed dense / MoE layers, a
    hybrid's norms and residuals (its mixers are refused by name: compared, not recomputed) -- so a replay that
    disagrees with Megatron points at the engine; a wrong expert weight is caught."""
    from megatron_consistent.config import UnsupportedConfigError
    from megatron_consistent.layers import build_consistent_model

    arch = ArchConfig.from_hf(load_hf_config(builtin_model_dir(name)))
    model = build_consistent_model(arch, seed=7, moe_impl=moe_impl)  # "module": our own MoE layer, else Megatron's
    export_hf(model, arch, tmp_path)
    weights = _load_weights(tmp_path)
    ids = torch.randint(3, arch.vocab_size, (23,), generator=torch.Generator().manual_seed(8)).tolist()
    caps = megatron_capture(model, arch, ids)
    ops = op_order(arch)
    assert set(ops) == set(caps)
    for op in ops:
        ins, w = _layer_inputs(op, arch)
        assert set(w) <= set(weights), op
        if arch.is_hybrid and op.split(".")[-1] in ("mixer", *MAMBA_MIXER_OPS):
            with pytest.raises(UnsupportedConfigError, match="compared"):
                run_op(op, arch, {n: caps[n] for n in ins}, weights, torch.tensor(ids))
            continue
        out = run_op(op, arch, {n: caps[n] for n in ins}, weights, torch.tensor(ids))
        assert torch.equal(out, caps[op]), op
    moe = [] if arch.is_hybrid else [i for i in range(arch.num_layers) if arch.layer_is_moe(i)]
    if moe:
        i = moe[0]
        assert "moe_out" in layer_ops(arch, i) and "down" not in layer_ops(arch, i)
        op = f"layer{i}.moe_out"
        ins, w = _layer_inputs(op, arch)
        bad = dict(weights)
        bad[w[1]] = weights[w[1]] * 2  # expert 0's up rows
        expert0 = bool((caps[f"layer{i}.routes"] == 0).any())
        out = run_op(op, arch, {n: caps[n] for n in ins}, bad, torch.tensor(ids))
        assert torch.equal(out, caps[op]) != expert0


def test_device_cuda_refused_without_a_gpu_before_any_work(tmp_path, capsys):
    """``--device cuda`` where no GPU is visible: one line, exit 2, no model folder or engine started."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the refusal is for machines without one")
    from megatron_consistent.cli import main

    with pytest.raises(ValueError, match="no CUDA device is visible"):
        resolve_device("cuda", "diagnose")
    assert resolve_device("auto", "diagnose") == "cpu"
    rc = main(["diagnose", "--device", "cuda", "--prompt", "5,6", "--response", "7", "--out-dir", str(tmp_path / "d")])
    assert rc == 2 and "no CUDA device is visible" in capsys.readouterr().err
    assert not (tmp_path / "d" / "model").exists()
    cfg = DiagnoseConfig(prompt=[5, 6], response=[7], model_dir=str(builtin_model_dir("tiny-llama")), out_dir=str(tmp_path / "e"),
                         device="cuda")
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        run_diagnose(cfg)
    assert not (tmp_path / "e" / "engine").exists()




def test_check_dir_request_is_the_first_whose_logprobs_differ(tmp_path):
    """``--check-dir`` without an index picks the first request whose engine log-probs differ from the trainer's
    recompute (one ulp in request 1's last token here), and request 0 when every request matches."""
    import json

    from megatron_consistent.verify.check import recompute
    from megatron_consistent.verify.diagnose import request_from_check_dir

    arch = ArchConfig.from_hf(load_hf_config(builtin_model_dir("tiny-llama")))
    model = build_consistent_gpt_model(arch, seed=0)
    export_hf(model, arch, tmp_path / "model")
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, arch.vocab_size, (n,), generator=g).tolist() for n in (7, 12, 5)]
    tokens = [torch.randint(3, arch.vocab_size, (n,), generator=g).tolist() for n in (4, 3, 6)]
    lps = recompute(model, prompts, tokens, 1.0, 16, stock=False).tolist()
    split = [lps[:4], lps[4:7], lps[7:]]
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "consistent.request.json").write_text(json.dumps(
        {"prompts": prompts, "temperature": 1.0, "seed": 0, "max_num_batched_tokens": 32, "block_size": 32}))

    def result(logprobs):
        (tmp_path / "engines" / "consistent.result.json").write_text(json.dumps({"tokens": tokens, "logprobs": logprobs}))

    result(split)
    prompt, response, settings = request_from_check_dir(tmp_path)
    assert (prompt, response, settings["request_index"]) == (prompts[0], tokens[0], 0)
    assert settings["selected"].startswith("no mismatch")
    bumped = [list(x) for x in split]
    bumped[1][-1] = float(torch.nextafter(torch.tensor(bumped[1][-1]), torch.tensor(0.0)))
    result(bumped)
    prompt, response, settings = request_from_check_dir(tmp_path)
    assert (prompt, response, settings["request_index"], settings["selected"]) == (prompts[1], tokens[1], 1,
                                                                                   "first mismatching request")

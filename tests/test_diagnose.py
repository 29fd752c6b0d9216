"""``diagnose``: an injected non-contract op in ONE layer of the vLLM plugin is named exactly (layer and op).

Each case starts one real vLLM engine (prefill chunks + forced decode steps) and
compares every op's output with the Megatron model's, bit for bit (torch.equal).
"""

from __future__ import annotations

import pytest
import torch

from megatron_consistent.config import ArchConfig, load_hf_config
from megatron_consistent.conversion import export_hf
from megatron_consistent.layers import build_consistent_gpt_model
from megatron_consistent.verify.capture import op_order
from megatron_consistent.config import builtin_model_dir
from megatron_consistent.verify.diagnose import DiagnoseConfig, _qkv_canonical, render, replay, run_diagnose


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
    order = [op for op in op_order(2) if op in statuses]
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


def test_hybrid_refused_by_name_before_any_engine(tmp_path):
    """Per-op capture exists for GPT models only: a hybrid model dir is refused by name, no engine started."""
    from megatron_consistent.config import UnsupportedConfigError

    cfg = DiagnoseConfig(prompt=[5, 6], response=[7], model_dir=str(builtin_model_dir("tiny-nemotronh")), out_dir=str(tmp_path))
    with pytest.raises(UnsupportedConfigError, match="NemotronHForCausalLM"):
        run_diagnose(cfg)
    assert not (tmp_path / "engine").exists()

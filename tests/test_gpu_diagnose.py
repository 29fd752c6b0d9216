"""``diagnose`` on the GPU (vllm 0.26 on CUDA): the engine on vLLM's CUDA platform, the Megatron model on the same GPU.

Needs a CUDA device and vLLM's GPU build (``../shared/gpu-vllm/``); skipped otherwise, with the reason.

* a non-contract o_proj in layer 1 of the GPU engine (``--inject-fault``) is the first divergence, every op before it
  bitwise equal, and its replay on the GPU reproduces Megatron's value, not the engine's;
* an MoE model (dense layer 0, MoE layer 1) with no fault: every captured op equal, router logits, routes and the MoE
  block's output among them;
* Nemotron-H with a fault in its MLP layer 3: ``layer3.mixer`` the first divergence, the Mamba and attention layers
  before it equal (the GPU SSD kernels inside the engine's mixer against the trainer's).
"""

from __future__ import annotations


import torch

from _gpu_engine import GPU_ENGINE_MARKS

pytestmark = GPU_ENGINE_MARKS


def _diagnose(name: str, root, fault: str = ""):
    from megatron_consistent.config import ArchConfig, builtin_model_dir, load_hf_config
    from megatron_consistent.conversion import export_hf
    from megatron_consistent.layers import build_consistent_model
    from megatron_consistent.verify.diagnose import DiagnoseConfig, run_diagnose

    arch = ArchConfig.from_hf(load_hf_config(builtin_model_dir(name)))
    model = build_consistent_model(arch, seed=3)
    export_hf(model, arch, root / "model")
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, arch.vocab_size, (41,), generator=g).tolist()  # two prefill chunks of 32 tokens
    response = torch.randint(3, arch.vocab_size, (5,), generator=g).tolist()
    cfg = DiagnoseConfig(prompt=prompt, response=response, model_dir=str(root / "model"), out_dir=str(root / "out"),
                         max_num_batched_tokens=32, block_size=16, fault=fault, device="cuda")
    return run_diagnose(cfg, model=model), arch


def test_gpu_fault_named_exactly_and_replayed_on_the_gpu(tmp_path):
    from megatron_consistent.verify.capture import op_order
    from megatron_consistent.verify.diagnose import render, replay

    report, arch = _diagnose("tiny-llama", tmp_path, fault="layer1.o_proj")
    print(render(report))
    assert report["settings"]["device"] == "cuda"
    first = report["first_divergence"]
    assert first is not None and first["op"] == "layer1.o_proj"
    statuses = {r["op"]: r["status"] for r in report["ops"]}
    order = [op for op in op_order(arch) if op in statuses]
    assert all(statuses[op] == "equal" for op in order[: order.index("layer1.o_proj")])
    assert report["engine_tokens_match"]
    assert replay(report["repro"]) == {"op": "layer1.o_proj", "kernel_equals_megatron": True, "kernel_equals_vllm": False,
                                       "vllm_equals_megatron": False}


def test_gpu_moe_every_op_equal(tmp_path):
    from megatron_consistent.verify.diagnose import render

    report, arch = _diagnose("tiny-qwen3moe-top1", tmp_path)
    print(render(report))
    assert report["first_divergence"] is None
    compared = {r["op"]: r["status"] for r in report["ops"] if r["status"] != "missing"}
    assert {"layer0.gate_up", "layer1.router_logits", "layer1.routes", "layer1.moe_out", "logits", "logprobs"} <= set(compared)
    assert set(compared.values()) == {"equal"}


def test_gpu_hybrid_fault_is_the_first_divergent_mixer(tmp_path):
    from megatron_consistent.verify.capture import op_order
    from megatron_consistent.verify.diagnose import render

    report, arch = _diagnose("tiny-nemotronh", tmp_path, fault="layer3.down")
    print(render(report))
    assert report["first_divergence"] is not None and report["first_divergence"]["op"] == "layer3.mixer"
    statuses = {r["op"]: r["status"] for r in report["ops"]}
    order = op_order(arch)
    assert all(statuses[op] == "equal" for op in order[: order.index("layer3.mixer")])

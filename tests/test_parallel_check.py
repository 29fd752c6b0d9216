"""``check --trainer-tp T --engine-tp E`` (issue #18): the consistent recompute in T gloo ranks vs a vLLM engine at TP = E.

Zero means zero: ``torch.equal`` / ``exact_fraction`` 1.0.

* fast: the report's layouts; the trainer layouts refused by name (the CLI cases are in
  ``tests/test_parallel_engine.py::test_check_refuses_tp_flags_before_any_work``).
* slow: :func:`verify.check.trainer_logprobs` at TP = 2, CP = 2 (one spawn, row chunks of ``recompute_batch``) gives the
  in-process TP = 1 log-probs and, for MoE, the same routes.
* engine: ``run_check`` at (T, E) = (2, 1) and (2, 2) on tiny-llama, zero mismatch; at trainer CP 2 (tiny-llama)
  and TP 2 + SP x CP 2 (tiny-qwen3moe-top1), zero mismatch, routes agreeing; the hybrids at engine TP = 2
  (tiny-nemotronh at (2, 2), tiny-nemotronh-moe at (1, 2)), zero mismatch, routes agreeing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from megatron_consistent.config import ArchConfig, UnsupportedConfigError, builtin_model_dir, load_hf_config
from megatron_consistent.verify.check import check_layouts, load_check_config


def _arch(name: str) -> ArchConfig:
    return ArchConfig.from_hf(load_hf_config(str(builtin_model_dir(name))))


def test_layouts_state_the_trainer_layout(tmp_path):
    cfg = load_check_config(trainer_tp=2, engine_tp=2, device="cpu", out_dir=str(tmp_path))
    lay = check_layouts(cfg, _arch("tiny-qwen3moe-top1"))
    assert lay["trainer"]["tensor_parallel_size"] == 2 and lay["trainer"]["pipeline_model_parallel_size"] == 1
    assert "gloo" in lay["trainer"]["ranks"] and "experts sharded over the TP ranks" in lay["trainer"]["moe"]
    assert "experts sharded over the TP ranks" in lay["engine"]["moe"]
    assert lay["engine"]["tensor_parallel_size"] == 2
    assert "tree of S = 8 segments" in lay["trainer"]["row"] and "tree of S = 8 segments" in lay["engine"]["row"]
    assert check_layouts(load_check_config(device="cpu", out_dir=str(tmp_path)), _arch("tiny-llama"))["trainer"] == {
        "tensor_parallel_size": 1, "pipeline_model_parallel_size": 1}


@pytest.mark.parametrize("overrides, words", [
    ({"trainer_tp": 4}, "--trainer-tp 4: TP=4, PP=1 cannot split LlamaForCausalLM: num_key_value_heads=2"),
    ({"trainer_tp": 2, "quantization": "fp8"}, "--trainer-tp 2: --quantization fp8"),
    ({"trainer_tp": 2, "kv_cache_dtype": "fp8"}, "--trainer-tp 2: --kv-cache-dtype fp8"),
    ({"trainer_tp": 1, "trainer_pp": 3}, "--trainer-tp 1 --trainer-pp 3: TP=1, PP=3 cannot split"),
    ({"trainer_ep": 2, "trainer_dp": 2},
     "--trainer-tp 1 --trainer-dp 2 --trainer-ep 2: TP=1, PP=1, EP=2 cannot split LlamaForCausalLM: expert parallelism on a "
     "model without experts"),
    ({"trainer_dp": 17}, "--trainer-tp 1 --trainer-dp 17: DP=17 replicas need at least as many sequences (--num-prompts 16)"),
])
def test_trainer_layout_refused_by_name(tmp_path, overrides, words):
    with pytest.raises(UnsupportedConfigError, match=re.escape(words)):
        check_layouts(load_check_config(device="cpu", out_dir=str(tmp_path), num_prompts=16, **overrides), _arch("tiny-llama"))


@pytest.mark.parametrize("overrides, words", [
    ({"trainer_dp": 3, "trainer_ep": 2}, "--trainer-tp 1 --trainer-dp 3 --trainer-ep 2: EP=2 must divide TP x DP = 3"),
    ({"trainer_tp": 2, "trainer_dp": 2, "trainer_ep": 2}, "--trainer-tp 2 --trainer-dp 2 --trainer-ep 2: the consistent "
     "Megatron layers do not support: expert parallelism at TP > 1 without sequence parallelism"),
    ({"trainer_sp": True}, "--trainer-tp 1 --trainer-sp: the consistent Megatron layers do not support: sequence "
     "parallelism without tensor parallelism"),
    ({"trainer_dp": 16, "trainer_ep": 16}, "EP=16 cannot split Qwen3MoeForCausalLM: num_experts=8 is not divisible by EP=16"),
])
def test_trainer_expert_parallel_layout_refused_by_name(tmp_path, overrides, words):
    with pytest.raises(UnsupportedConfigError, match=re.escape(words)):
        check_layouts(load_check_config(device="cpu", out_dir=str(tmp_path), **overrides), _arch("tiny-qwen3moe-top1"))


def test_layouts_state_the_data_and_expert_parallel_trainer(tmp_path):
    lay = check_layouts(load_check_config(trainer_tp=2, trainer_sp=True, trainer_ep=2, device="cpu", out_dir=str(tmp_path)),
                        _arch("tiny-qwen3moe-top1"))["trainer"]
    assert lay["sequence_parallel"] and lay["expert_model_parallel_size"] == 2 and "EP groups of 2 ranks" in lay["moe"]
    lay = check_layouts(load_check_config(trainer_dp=4, trainer_ep=2, device="cpu", out_dir=str(tmp_path)),
                        _arch("tiny-qwen3moe-top1"))["trainer"]
    assert lay["data_parallel_size"] == 4 and lay["expert_model_parallel_size"] == 2
    assert lay["ranks"].startswith("4 gloo processes") and "EP groups of 2 ranks" in lay["moe"]


@pytest.mark.parametrize("visible", [0, 1])
@pytest.mark.parametrize("flags, words", [
    (["--trainer-tp", "2"], "--trainer-tp 2: 2 ranks on CUDA need 2 CUDA devices (one NCCL rank per device), {} visible"),
    (["--trainer-tp", "2", "--trainer-pp", "2"],
     "--trainer-tp 2 --trainer-pp 2: 4 ranks on CUDA need 4 CUDA devices (one NCCL rank per device), {} visible"),
    (["--engine-tp", "2"], "--engine-tp 2: 2 ranks on CUDA need 2 CUDA devices (one NCCL rank per device), {} visible"),
])
def test_check_device_cuda_refuses_too_few_gpus_before_any_work(tmp_path, capsys, monkeypatch, visible, flags, words):
    """``check --device cuda`` with more trainer ranks (TP x PP, NCCL) or engine ranks than visible GPUs: one line naming
    how many are needed and visible, exit 2, nothing built (the GPU count is stubbed: the same on any machine)."""
    from megatron_consistent.cli import main as cli_main

    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible > 0)
    out = tmp_path / "o"
    assert cli_main(["check", "--device", "cuda", "--out-dir", str(out), *flags]) == 2
    err = capsys.readouterr().err.strip()
    if visible == 0 and flags == ["--engine-tp", "2"]:  # no trainer ranks: the plain no-GPU refusal comes first
        words = "--device cuda: no CUDA device is visible"
    assert words.format(visible) in err and len(err.splitlines()) == 1, err
    assert not out.exists() or not any(out.iterdir())  # nothing built, no engine started


@pytest.mark.parametrize("flags, words", [
    (["--engine-tp", "4"], "--engine-tp 4: tensor_parallel_size=4: consistent_row_parallel_segments=2: the row-parallel "
     "K tree has 2 segments, so TP must divide 2 (one of (1, 2)), got TP=4"),
    (["--trainer-tp", "4"], "--trainer-tp 4: TP=4, PP=1 cannot split LlamaForCausalLM: consistent_row_parallel_segments=2: "
     "the row-parallel K tree has 2 segments, so TP must divide 2 (one of (1, 2)), got TP=4"),
    (["--trainer-cp", "3"], "--trainer-tp 1 --trainer-cp 3: the consistent Megatron layers do not support: context "
     "parallelism of size 3 (context_parallel_size must be 1, 2 or 4)"),
])
def test_check_refuses_tp_not_dividing_the_models_s_before_any_work(tmp_path, capsys, flags, words):
    """A model whose config sets ``consistent_row_parallel_segments`` = 2 (4 KV heads: nothing else stops TP = 4): an
    engine or trainer TP of 4 is refused in one line, exit 2, nothing built."""
    import json

    from megatron_consistent.cli import main as cli_main

    model = tmp_path / "s2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**load_hf_config(builtin_model_dir("tiny-llama")), "num_key_value_heads": 4,
                                                   "consistent_row_parallel_segments": 2}))
    out = tmp_path / "o"
    assert cli_main(["check", "--hf-config", str(model), "--out-dir", str(out), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err
    assert not (out / "model").exists()  # nothing built, no engine started


def test_layouts_name_nccl_ranks_on_cuda(tmp_path, monkeypatch):
    """On CUDA the report states NCCL ranks (one GPU each); the stubbed count of 2 lets TP = 2 through."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    lay = check_layouts(load_check_config(trainer_tp=2, engine_tp=2, device="cuda", out_dir=str(tmp_path)), _arch("tiny-llama"))
    assert lay["trainer"]["ranks"].startswith("2 nccl processes (rank r on cuda:r)")


@pytest.mark.slow
@pytest.mark.parametrize("name, layout", [("tiny-llama", {"trainer_tp": 2}), ("tiny-qwen3moe-top1", {"trainer_tp": 2}),
                                          ("tiny-llama", {"trainer_dp": 2}),
                                          ("tiny-qwen3moe-top1", {"trainer_dp": 2, "trainer_ep": 2}),
                                          ("tiny-qwen3moe-top1", {"trainer_tp": 2, "trainer_sp": True, "trainer_ep": 2}),
                                          ("tiny-llama", {"trainer_cp": 2}),
                                          ("tiny-llama", {"trainer_tp": 2, "trainer_sp": True, "trainer_cp": 2}),
                                          ("tiny-qwen3moe-top1", {"trainer_cp": 2})])
def test_trainer_logprobs_parallel_equals_one_process(tmp_path, name, layout):
    """The recompute at TP = 2, at DP = 2 (shares of 3 and 2 sequences, chunks of up to 2), with the experts over EP = 2
    replicas and over TP = 2 ranks with sequence parallelism (width padded to a multiple of TP), at CP = 2 (dense and
    MoE) and TP = 2 + SP x CP = 2 (width padded to a multiple of 4) gives the in-process log-probs and, for MoE, the
    same routes per request."""
    from megatron_consistent.conversion import export_hf
    from megatron_consistent.layers import build_consistent_gpt_model
    from megatron_consistent.verify.check import trainer_logprobs
    from megatron_consistent.verify.routing import TrainerRoutes

    arch = _arch(name)
    model = build_consistent_gpt_model(arch, seed=3)
    export_hf(model, arch, tmp_path / "model")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, arch.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 12)]
    responses = [torch.randint(3, arch.vocab_size, (n,), generator=g).tolist() for n in (7, 3, 11, 4, 9)]
    one_cfg = load_check_config(device="cpu", out_dir=str(tmp_path), recompute_batch=2)
    two_cfg = load_check_config(device="cpu", out_dir=str(tmp_path), recompute_batch=2, **layout)
    one_routes, two_routes = TrainerRoutes(), TrainerRoutes()
    one = trainer_logprobs(one_cfg, model, tmp_path / "model", prompts, responses, 0.7, route_sink=one_routes)
    two = trainer_logprobs(two_cfg, None, tmp_path / "model", prompts, responses, 0.7, route_sink=two_routes)
    assert one.dtype == two.dtype == torch.float32 and one.shape == (sum(map(len, responses)),)
    assert torch.equal(one, two)
    assert one_routes.by_request.keys() == two_routes.by_request.keys()
    assert bool(one_routes.by_request) == arch.is_moe
    for r, routes in one_routes.by_request.items():
        assert torch.equal(routes, two_routes.by_request[r]), r


@pytest.mark.engine
@pytest.mark.parametrize("trainer_tp, engine_tp", [(2, 1), (2, 2)])
def test_check_trainer_tp_zero_mismatch(tmp_path: Path, trainer_tp, engine_tp):
    from megatron_consistent.verify.check import run_check

    report = run_check(load_check_config(num_prompts=8, max_tokens=12, max_num_batched_tokens=32, out_dir=str(tmp_path),
                                         max_prompt_len=40, shared_prefix_len=20, mode="consistent", device="cpu",
                                         engine_tp=engine_tp, trainer_tp=trainer_tp))
    layouts = report["settings"]["layouts"]
    assert layouts["trainer"]["tensor_parallel_size"] == trainer_tp and layouts["engine"]["tensor_parallel_size"] == engine_tp
    assert report["consistent"]["tokens"] == 8 * 12 and report["consistent"]["exact_fraction"] == 1.0
    assert report["zero_mismatch"]


@pytest.mark.engine
@pytest.mark.parametrize("name, layout", [("tiny-llama", {"trainer_cp": 2}),
                                          ("tiny-qwen3moe-top1", {"trainer_tp": 2, "trainer_sp": True, "trainer_cp": 2})])
def test_check_trainer_cp_zero_mismatch(tmp_path: Path, name, layout):
    """The recompute at context parallelism (each sequence over the CP ranks) vs the engine at TP = 1: every token's
    log-prob bitwise equal, the MoE routes agreeing; the report states the CP layout."""
    from megatron_consistent.verify.check import run_check

    report = run_check(load_check_config(hf_config=str(builtin_model_dir(name)), num_prompts=8, max_tokens=12,
                                         max_num_batched_tokens=32, out_dir=str(tmp_path), max_prompt_len=40,
                                         mode="consistent", device="cpu", **layout))
    assert report["settings"]["layouts"]["trainer"]["context_parallel_size"] == 2
    assert report["consistent"]["tokens"] == 8 * 12 and report["consistent"]["exact_fraction"] == 1.0
    assert report["zero_mismatch"]
    assert report["consistent"].get("routing_agreement", 1.0) == 1.0


@pytest.mark.engine
@pytest.mark.parametrize("name, trainer_tp", [("tiny-nemotronh", 2), ("tiny-nemotronh-moe", 1)])
def test_check_hybrid_engine_tp2_zero_mismatch(tmp_path: Path, name, trainer_tp):
    """A hybrid engine at TP = 2 (its Mamba mixers' heads, groups and state slots split over vLLM's two ranks; chunked
    prefill at 32 batched tokens, decode steps across chunk boundaries) against the recompute at trainer TP = 2 or 1:
    every token's log-prob bitwise equal, the MoE routes agreeing."""
    from megatron_consistent.verify.check import run_check

    report = run_check(load_check_config(hf_config=str(builtin_model_dir(name)), num_prompts=6, max_tokens=12,
                                         max_num_batched_tokens=32, out_dir=str(tmp_path), max_prompt_len=40,
                                         mode="consistent", device="cpu", engine_tp=2, trainer_tp=trainer_tp))
    layouts = report["settings"]["layouts"]
    assert layouts["engine"]["tensor_parallel_size"] == 2 and "state cache" in layouts["engine"]["mamba"]
    assert layouts["trainer"]["tensor_parallel_size"] == trainer_tp
    assert report["consistent"]["tokens"] == 6 * 12 and report["consistent"]["exact_fraction"] == 1.0
    assert report["zero_mismatch"]
    assert ("routing_agreement" in report["consistent"]) == name.endswith("-moe")
    assert report["consistent"].get("routing_agreement", 1.0) == 1.0

"""Block-FP8 dense and MoE models at tensor parallelism > 1, trainer and engine (docs/fp8.md, "Tensor parallelism").

* kernel level (no processes): the FP8 row-parallel linear (``kernels.fp8.fp8_linear(..., segments=S)``) split over
  t ranks (each its K shard's subtree of S/t segments, then the top of the tree) gives the one-rank bits; summing a
  rank's shard as one FP8 linear (no tree) and the plain whole-K FP8 linear do not;
* the alignment the layout needs: at a misaligned layout (tiny-llama's 64 q rows a rank) a rank that quantized its own
  slice would get other scales than the HF tensor's grid -- which is why such layouts are refused by name (trainer,
  engine, ``check``), before any work;
* gloo ranks (slow): the trainer (``recompute_logprobs_parallel`` with the FP8 forward) at TP 2 and 4 gives the TP 1
  logits and log-probs; the plugin's FP8 decoder layers at TP 2 (``tests/_tp_ranks.py``) give every layer output and
  the logits of TP 1 and of the trainer; an in-place reload at TP 2 equals TP 1 on those weights; a rank that sums
  its K shard without the tree is caught;
* FP8 MoE (``tiny-qwen2moe-fp8tp``: 8 experts, top-2, a shared expert): each rank quantizes / loads its whole experts
  (the TP = 1 values and scales; an expert cut in two on its own grid is not), its owned pairs' outputs summed over the
  ranks and combined = TP = 1 (kernel level; without the sum, or with the wrong run of experts: caught); gloo ranks
  (slow): the trainer at TP 2, 4 and 2 + SP gives the TP 1 logits and every layer's routes, the plugin's FP8 MoE
  layers at TP 2 = TP 1 = the trainer, an in-place reload at TP 2 = TP 1, and an engine without the ranks' sum or with
  the wrong expert run is caught.
"""

from __future__ import annotations

import json
import subprocess
import time
import sys
from pathlib import Path

import pytest
import torch

from megatron_consistent.config import ArchConfig, UnsupportedConfigError, builtin_model_dir, load_hf_config
from megatron_consistent.conversion.fp8 import fp8_tp_refusal, scale_part
from megatron_consistent.kernels.fp8 import E4M3_WEIGHT_128, NVFP4_WEIGHT, fp8_linear, quantize, weight_row_scales
from megatron_consistent.kernels.numerics import adjacent_tree_sum

HERE = Path(__file__).parent
FP8TP = builtin_model_dir("tiny-llama-fp8tp")  # hidden 256, 4 x 128 heads, 4 KV heads, MLP 512, S = 4
MOETP = builtin_model_dir("tiny-qwen2moe-fp8tp")  # the same attention; 8 experts (top-2, 64 wide), shared expert 128


def _arch(name: str, **fields) -> ArchConfig:
    return ArchConfig.from_hf({**load_hf_config(builtin_model_dir(name)), **fields})


def _operands(seed: int, m: int = 9, n: int = 48, k: int = 512):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * torch.logspace(-2, 1, k)).to(torch.bfloat16)  # K blocks of other amax
    q, s = quantize(w, E4M3_WEIGHT_128)
    return x, q, weight_row_scales(s, n), torch.randn(n, generator=g).to(torch.bfloat16)


def _ranks_tree(x, q, rows, bias, segments: int, t: int, per_rank: int | None = None) -> torch.Tensor:
    """t ranks: each its K shard (whole 128-wide groups) -> its float32 subtree; the tree's top; bias; one rounding."""
    k = q.shape[1]
    cut, groups = k // t, k // t // 128
    subtrees = [fp8_linear(x[:, r * cut:(r + 1) * cut], q[:, r * cut:(r + 1) * cut], rows[:, r * groups:(r + 1) * groups],
                           None, torch.float32, segments=per_rank or segments // t) for r in range(t)]
    return (adjacent_tree_sum(torch.stack(subtrees), dim=0) + bias.float()).to(x.dtype)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fp8_row_parallel_tree_split_over_ranks_is_exact(seed):
    x, q, rows, b = _operands(seed)
    whole = fp8_linear(x, q, rows, b, segments=4)
    for t in (1, 2, 4):
        assert torch.equal(_ranks_tree(x, q, rows, b, 4, t), whole), t
    x8, q8, rows8, b8 = _operands(seed, k=1024)
    whole8 = fp8_linear(x8, q8, rows8, b8, segments=8)
    for t in (2, 4, 8):
        assert torch.equal(_ranks_tree(x8, q8, rows8, b8, 8, t), whole8), t


def test_fp8_row_parallel_without_the_tree_is_caught():
    """Summing each rank's shard as one FP8 linear, or the whole-K FP8 linear, is not the tree (float32 out: the
    partials' bits show)."""
    x, q, rows, b = _operands(5, m=32, n=64, k=1024)
    b32 = b.float()
    whole = fp8_linear(x, q, rows, b32, torch.float32, segments=8)
    assert not torch.equal(fp8_linear(x, q, rows, b32, torch.float32), whole)
    no_tree = _ranks_tree(x.float(), q, rows, b32, 8, 2, per_rank=1)
    assert torch.equal(_ranks_tree(x.float(), q, rows, b32, 8, 2), fp8_linear(x.float(), q, rows, b32, torch.float32, segments=8))
    assert not torch.equal(no_tree, fp8_linear(x.float(), q, rows, b32, torch.float32, segments=8))


def test_a_rank_quantizing_its_own_slice_differs_at_a_misaligned_layout():
    """tiny-llama's q_proj at TP 2: 64 rows a rank, half a 128-row scale block -- a rank quantizing its slice on its own
    grid gets another scale than the HF tensor's block; the layout is refused (next test) rather than run."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(128, 128, generator=g).to(torch.bfloat16)
    w[64:] *= 8  # rank 1's rows hold the block's amax
    _, s_full = quantize(w, E4M3_WEIGHT_128)
    _, s_rank0 = quantize(w[:64].contiguous(), E4M3_WEIGHT_128)
    assert not torch.equal(s_rank0, s_full)
    assert "64 rows, not whole 128-wide scale blocks" in fp8_tp_refusal(_arch("tiny-llama"), 2)


@pytest.mark.parametrize("name, fields, tp, fmt, words", [
    ("tiny-llama", {}, 2, E4M3_WEIGHT_128, "q_proj.weight (128, 128) gives each rank 64 rows, not whole 128-wide scale blocks"),
    ("tiny-mistral-gqa", {}, 2, E4M3_WEIGHT_128, "k_proj.weight (64, 256) gives each rank 32 rows"),
    ("tiny-llama-fp8tp", {"consistent_row_parallel_segments": 8}, 2, E4M3_WEIGHT_128,
     "o_proj.weight K = 512 in S = 8 row-parallel segments of 64, not whole 128-wide quantization groups"),
    ("tiny-llama-fp8tp", {"intermediate_size": 384}, 2, E4M3_WEIGHT_128, "gate_proj.weight (384, 256) gives each rank 192 rows"),
    ("tiny-llama", {"intermediate_size": 200}, 2, NVFP4_WEIGHT,
     "nvfp4 quantization at TP=2: model.layers.0.mlp.down_proj.weight (128, 200) gives each rank 100 K columns, not whole "
     "16-wide scale blocks"),
    ("tiny-qwen2moe-fp8tp", {"head_dim": 100}, 2, NVFP4_WEIGHT,  # NVFP4 MoE: the attention's layout still decides
     "nvfp4 quantization at TP=2: model.layers.0.self_attn.o_proj.weight (256, 400) gives each rank 200 K columns"),
    ("tiny-qwen3moe-top1", {}, 2, E4M3_WEIGHT_128,
     "fp8 quantization at TP=2: model.layers.0.self_attn.q_proj.weight (128, 128) gives each rank 64 rows"),
    ("tiny-qwen2moe-fp8tp", {"consistent_row_parallel_segments": 8}, 2, E4M3_WEIGHT_128,
     "o_proj.weight K = 512 in S = 8 row-parallel segments of 64"),
])
def test_misaligned_fp8_layouts_refused_by_name(name, fields, tp, fmt, words):
    from megatron_consistent.vllm_plugin.parallel import tp_refusal

    arch = _arch(name, **fields)
    assert words in fp8_tp_refusal(arch, tp, fmt)
    reason = tp_refusal(arch, tp, fmt)
    assert words in reason and f"tensor_parallel_size={tp}" in reason and "\n" not in reason


def test_fp8_tp_config_accepted_at_tp_1_2_4_and_scale_parts_are_whole_blocks():
    from megatron_consistent.architectures import tp_part, weight_entries
    from megatron_consistent.vllm_plugin.parallel import tp_refusal

    arch = _arch("tiny-llama-fp8tp")
    for t in (1, 2, 4):
        assert fp8_tp_refusal(arch, t) == "" and tp_refusal(arch, t, E4M3_WEIGHT_128) == ""
        assert fp8_tp_refusal(arch, t, NVFP4_WEIGHT) == ""
    assert fp8_tp_refusal(_arch("tiny-llama"), 2, NVFP4_WEIGHT) == ""  # NVFP4: 1 x 16 blocks fit the shipped tiny model
    entries = {e.megatron.split(".", 3)[-1]: e for e in weight_entries(arch) if e.megatron.startswith("decoder.layers.0.")}
    o = entries["self_attention.linear_proj.weight"]
    assert [scale_part(tp_part(o, 0, r, 2)) for r in range(2)] == [(1, 0, 2), (1, 2, 4)]  # K 512: 4 blocks, 2 a rank
    qkv = entries["self_attention.linear_qkv.weight"]
    assert [scale_part(tp_part(qkv, 1, r, 4)) for r in range(4)] == [(0, r, r + 1) for r in range(4)]  # k rows 512


def test_check_refuses_misaligned_fp8_layouts_before_any_work(tmp_path, capsys):
    from megatron_consistent.cli import main as cli_main

    out = tmp_path / "o"
    for flags, words in ((["--engine-tp", "2"], "--engine-tp 2: LlamaForCausalLM at tensor_parallel_size=2: fp8 quantization at "
                          "TP=2: model.layers.0.self_attn.q_proj.weight (128, 128) gives each rank 64 rows"),
                         (["--trainer-tp", "2"], "--trainer-tp 2: --quantization fp8 with trainer model parallelism: fp8 "
                          "quantization at TP=2: model.layers.0.self_attn.q_proj.weight")):
        assert cli_main(["check", "--out-dir", str(out), "--quantization", "fp8", *flags]) == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, err
    assert not (out / "model").exists()


def test_enable_fp8_refuses_a_misaligned_tp_model_by_name():
    from types import SimpleNamespace

    from megatron_consistent.layers.fp8 import enable_fp8

    model = SimpleNamespace(arch_config=_arch("tiny-llama"), config=SimpleNamespace(tensor_model_parallel_size=2),
                            decoder=SimpleNamespace(layers=[]), modules=lambda: [])  # a stand-in: no layers built
    with pytest.raises(UnsupportedConfigError, match="q_proj.weight .* gives each rank 64 rows"):
        enable_fp8(model)


# ------------------------------------------------------------------------------------------------ gloo ranks
def _weights(seed: int, model_dir: Path = FP8TP) -> dict[str, torch.Tensor]:
    from megatron_consistent.architectures import hf_tensor_specs

    arch = ArchConfig.from_hf(load_hf_config(model_dir))
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(s, generator=g) * (1.0 if "norm" in n else 0.05)).to(getattr(torch, dt))
            for n, (s, dt) in hf_tensor_specs(arch).items()}


def _trainer_tp1(weights: dict, ids: torch.Tensor, formats=(), model_dir: Path = FP8TP) -> tuple[torch.Tensor, object]:
    """The one-process FP8 (``formats``: e.g. NVFP4) trainer's float32 logits and the model (for the export)."""
    from megatron_consistent.kernels import causal_positions
    from megatron_consistent.layers import build_consistent_model
    from megatron_consistent.layers.distributed import load_full_megatron_state, megatron_state_from_hf
    from megatron_consistent.layers.fp8 import enable_fp8

    model = build_consistent_model(model_dir)
    load_full_megatron_state(model, megatron_state_from_hf(model.arch_config, weights))
    enable_fp8(model, *formats)
    with torch.no_grad():
        return model(ids, causal_positions(*ids.shape), None), model


def _engine_jobs(tmp, engine_dir, secs: dict, jobs_by_tp: dict) -> dict:
    """The plugin's model classes under gloo ranks (``tests/_tp_ranks.py``), one launch per TP size: ``{tp: {name: job
    overrides}}`` (``model_dir`` defaults to ``engine_dir``) -> ``{name: {"out": tensors, "ranks": [rank reports]}}``."""
    from safetensors.torch import load_file

    engine = {}
    for tp, jobs in jobs_by_tp.items():
        jobs = {n: {**j, "model_dir": str(j.get("model_dir", engine_dir)), "out_dir": str(tmp / f"engine-{n}")}
                for n, j in jobs.items()}
        (tmp / f"jobs{tp}.json").write_text(json.dumps(list(jobs.values())))
        t0 = time.perf_counter()
        subprocess.run([sys.executable, str(HERE / "_tp_ranks.py"), "--jobs", str(tmp / f"jobs{tp}.json"), str(tp)], check=True)
        secs[f"engine_tp{tp}"] = time.perf_counter() - t0
        for n, j in jobs.items():
            out = Path(j["out_dir"])
            engine[n] = {"out": load_file(str(out / f"tp{tp}.safetensors")),
                         "ranks": [json.loads((out / f"tp{tp}.rank{r}.json").read_text()) for r in range(tp)]}
    return engine


@pytest.fixture(scope="module")
def fp8_runs(tmp_path_factory):
    """Trainer: TP 1 in this process, TP 2 and 4 (and 2 with sequence parallelism) in gloo ranks (the FP8 forward on
    the bf16 masters).  Engine: the FP8 export of the same masters at TP 1 and 2 (plain, without the tree, reloaded in
    place with a second export).  NVFP4 (W4A16): trainer TP 1 and 2, the engine on its export at TP 1 and 2."""

    from megatron_consistent.conversion.fp8 import export_hf_fp8
    from megatron_consistent.kernels.fp8 import E4M3_ACT_1x128
    from megatron_consistent.layers.distributed import recompute_logprobs_parallel

    from _tp_ranks import PROMPT

    tmp = tmp_path_factory.mktemp("fp8tp")
    weights = _weights(0)
    ids = (torch.tensor([PROMPT[:36], PROMPT[::-1][:36]]) % 512)  # 36 positions: sequence parallelism cuts them by TP
    logits1, model = _trainer_tp1(weights, ids)
    engine_dir, reload_dir = tmp / "fp8", tmp / "fp8_reload"
    export_hf_fp8(model, model.arch_config, engine_dir)
    _, model_b = _trainer_tp1(_weights(1), ids[:1])
    export_hf_fp8(model_b, model_b.arch_config, reload_dir)
    nvfp4 = (NVFP4_WEIGHT, None)
    logits1_nv, model_nv = _trainer_tp1(weights, ids, nvfp4)
    nv_dir = tmp / "nvfp4"
    export_hf_fp8(model_nv, model_nv.arch_config, nv_dir, *nvfp4)
    secs = {}
    trainer = {}
    for tp, sp in ((2, False), (4, False), (2, True)):
        t0 = time.perf_counter()
        trainer[tp, sp] = recompute_logprobs_parallel(FP8TP, weights, ids, tp=tp, return_logits=True, sequence_parallel=sp,
                                                      quantization=(E4M3_WEIGHT_128, E4M3_ACT_1x128),
                                                      workdir=tmp / f"trainer{tp}{sp}")
        secs[f"trainer_tp{tp}{'_sp' if sp else ''}"] = time.perf_counter() - t0
    trainer["nvfp4"] = recompute_logprobs_parallel(FP8TP, weights, ids, tp=2, return_logits=True, quantization=nvfp4,
                                                   workdir=tmp / "trainer_nvfp4")
    engine = _engine_jobs(tmp, engine_dir, secs, {
        1: {"tp1": {}, "tp1_reload": {"model_dir": reload_dir}, "nv_tp1": {"model_dir": nv_dir}},
        2: {"tp2": {}, "notree": {"fault": "fp8_notree"}, "reloaded": {"reload": str(reload_dir)}, "nv_tp2": {"model_dir": nv_dir}}})
    print("fp8 tp seconds:", secs)
    return {"ids": ids, "logits1": logits1, "logits1_nv": logits1_nv, "trainer": trainer, "engine": engine}


@pytest.mark.slow
@pytest.mark.parametrize("tp, sp", [(2, False), (4, False), (2, True)])
def test_fp8_trainer_tp_logits_equal_tp1(fp8_runs, tp, sp):
    """TP 2 and 4 (S / t = 2 and 1 segments a rank), and TP 2 with sequence parallelism: the TP 1 logits and log-probs."""
    from megatron_consistent.kernels import log_softmax

    lp, logits = fp8_runs["trainer"][tp, sp]
    ids = fp8_runs["ids"]
    one = fp8_runs["logits1"]  # [s, b, V] (Megatron's order) -> [b, s, V]
    one = one.transpose(0, 1) if one.shape[0] != ids.shape[0] else one
    assert torch.equal(logits, one.float())
    want = log_softmax(one.float())[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    assert torch.equal(lp, want)


def _assert_engine_tp2_equals_tp1_and_the_trainer(runs: dict) -> None:
    one, two = runs["engine"]["tp1"]["out"], runs["engine"]["tp2"]["out"]
    assert set(one) == set(two) and "logits" in one
    for k in one:
        assert torch.equal(one[k], two[k]), k
    trainer = runs["logits1"]
    trainer = trainer.transpose(0, 1) if trainer.shape[0] != 2 else trainer
    assert torch.equal(one["logits"][:36], trainer[0].float())  # the engine's prompt starts with the trainer's first row


@pytest.mark.slow
def test_fp8_engine_tp2_equals_tp1_and_the_trainer(fp8_runs):
    _assert_engine_tp2_equals_tp1_and_the_trainer(fp8_runs)
    r0, r1 = (fp8_runs["engine"]["tp2"]["ranks"][r] for r in range(2))
    assert r0["held"]["layers.0.o_proj"] == [256, 256] and r0["held"]["layers.0.o_proj_scale"] == [2, 2]
    assert r1["parts"]["model.layers.0.self_attn.o_proj.weight_scale_inv"] == [1, 2, 4]
    assert r1["parts"]["model.layers.0.mlp.gate_proj.weight_scale_inv"] == [0, 2, 4]


@pytest.mark.slow
@pytest.mark.parametrize("runs", ["fp8_runs", "fp8_moe_runs"])
def test_fp8_engine_tp2_reload_in_place_equals_tp1(runs, request):
    """Dense and MoE: an in-place reload at TP 2 serves what a TP 1 engine started on the new weights serves."""
    engine = request.getfixturevalue(runs)["engine"]
    reloaded, direct = engine["reloaded"], engine["tp1_reload"]["out"]
    assert all(r["reload_pointers_same"] for r in reloaded["ranks"])
    assert not torch.equal(direct["logits"], engine["tp1"]["out"]["logits"])  # other weights
    for k in direct:
        assert torch.equal(reloaded["out"][k], direct[k]), k


@pytest.mark.slow
def test_fp8_engine_row_parallel_without_the_tree_is_caught(fp8_runs):
    assert not torch.equal(fp8_runs["engine"]["notree"]["out"]["logits"], fp8_runs["engine"]["tp1"]["out"]["logits"])


@pytest.mark.slow
def test_nvfp4_trainer_and_engine_tp2_equal_tp1(fp8_runs):
    """NVFP4 (W4A16, 1 x 16 E4M3 block scales, one float32 global scale per HF tensor): trainer TP 2 = TP 1; the
    engine's packed codes and scales split at TP 2 = TP 1 = the trainer; NVFP4 is not the FP8 model."""
    one = fp8_runs["logits1_nv"]
    one = one.transpose(0, 1) if one.shape[0] != 2 else one
    assert torch.equal(fp8_runs["trainer"]["nvfp4"][1], one.float())
    e1, e2 = fp8_runs["engine"]["nv_tp1"]["out"], fp8_runs["engine"]["nv_tp2"]["out"]
    for k in e1:
        assert torch.equal(e1[k], e2[k]), k
    assert torch.equal(e1["logits"][:36], one[0].float())
    assert not torch.equal(e1["logits"], fp8_runs["engine"]["tp1"]["out"]["logits"])
    parts = fp8_runs["engine"]["nv_tp2"]["ranks"][1]["parts"]
    assert parts["model.layers.0.self_attn.o_proj.weight"] == [1, 128, 256]  # codes [256, 256]: K 512 / 2 a byte
    assert parts["model.layers.0.self_attn.o_proj.weight_scale"] == [1, 16, 32]  # K / 16
    assert parts["model.layers.0.self_attn.o_proj.weight_scale_2"] is None


@pytest.mark.engine
@pytest.mark.parametrize("quantization", ["fp8", "nvfp4"])
def test_quantized_engine_tp2_push_in_place_equals_the_trainer(quantization, tmp_path):
    """A live block-FP8 / NVFP4 vLLM engine at TP 2 (multiprocess, gloo) started on the export of masters A, pushed the
    export of masters B in place through the weight-sync channel (every rank keeps its part of every quantized value
    and scale tensor), refused whole a push whose one misfit is a row-parallel scale tensor cut to half its columns,
    then samples log-probs ``torch.equal`` to the trainer's quantized forward on B (not on A)."""
    from _tp_sync_engine import PROMPTS, synced_engine

    from megatron_consistent.conversion.fp8 import export_hf_fp8
    from megatron_consistent.layers import compute_token_logprobs

    formats, scale = {"fp8": ((), "weight_scale_inv"), "nvfp4": ((NVFP4_WEIGHT, None), "weight_scale")}[quantization]
    misfit = f"model.layers.0.mlp.down_proj.{scale}"  # row-parallel: rank 1 holds the last K blocks
    ids = torch.tensor([PROMPTS[0]])
    (_, model_a), (_, model_b) = (_trainer_tp1(_weights(seed), ids, formats) for seed in (0, 1))
    a, b = (export_hf_fp8(m, m.arch_config, tmp_path / n, *formats) for m, n in ((model_a, "a"), (model_b, "b")))
    synced = synced_engine(a, b, tmp_path / "tp2", misfit)
    assert synced["pushed_version"] == 1 and synced["pointers_unchanged"] and synced["version_after"] == 1, synced
    same, other = synced["matches"]  # every rank's part of the pushed tensors; a bit of rank 1's part flipped
    assert same["equal"] and same["ranks"] == 2 and same["differ"] == [], same
    assert not other["equal"] and other["differ"] == [misfit], other
    assert synced["refused"].splitlines()[0] == "engine refused weight update v2 (nothing applied; engine stays at v1):"
    assert f"wrong shape for {misfit}: update " in synced["refused"], synced["refused"]
    tokens, engine = synced["tokens"], synced["logprobs"]
    assert all(len(t) == 12 for t in tokens)
    seqs = [p + t for p, t in zip(PROMPTS, tokens)]
    width = max(len(q) for q in seqs)
    padded = torch.tensor([q + [0] * (width - len(q)) for q in seqs])  # right padding: never seen (causal)
    for model, equal in ((model_b, True), (model_a, False)):
        with torch.no_grad():
            lp = compute_token_logprobs(model, padded)
        trainer = torch.cat([lp[i, len(p) - 1 : len(p) - 1 + 12] for i, p in enumerate(PROMPTS)])
        assert torch.equal(trainer, torch.tensor([x for r in engine for x in r])) == equal


# ------------------------------------------------------------------------------------------------ FP8 MoE experts
def test_fp8_moe_tp_config_accepted_and_experts_whole_on_their_rank():
    from megatron_consistent.architectures import tp_part, weight_entries
    from megatron_consistent.vllm_plugin.parallel import tp_refusal

    arch = _arch("tiny-qwen2moe-fp8tp")
    for t in (1, 2, 4):
        assert fp8_tp_refusal(arch, t) == "" and tp_refusal(arch, t, E4M3_WEIGHT_128) == ""
        assert fp8_tp_refusal(arch, t, NVFP4_WEIGHT) == "" and tp_refusal(arch, t, NVFP4_WEIGHT) == ""  # NVFP4 experts too
    entries = {e.megatron.split(".", 3)[-1]: e for e in weight_entries(arch) if e.megatron.startswith("decoder.layers.0.")}
    fc1 = entries["mlp.experts.linear_fc1.weight"]
    assert fc1.hf[10].endswith("experts.5.gate_proj.weight")  # expert 5: rank 1's of 2, nothing of it on rank 0
    assert [scale_part(tp_part(fc1, 10, r, 2)) for r in range(2)] == [(0, 0, 0), None]
    shared = entries["mlp.shared_experts.linear_fc1.weight"]
    assert [tp_part(shared, 0, r, 2) for r in range(2)] == [None, None]  # replicated, as in the model dtype


def _moe_operands(seed: int = 0):
    """tiny-qwen2moe-fp8tp's MoE block in FP8 (the trainer's quantization, masters attached) and routed tokens."""
    from megatron_consistent.kernels import moe as kmoe
    from megatron_consistent.layers.fp8 import FP8MoEBinding

    arch = _arch("tiny-qwen2moe-fp8tp")
    g = torch.Generator().manual_seed(seed)
    E, H, inter, s = arch.num_experts, arch.hidden_size, arch.moe_intermediate_size, arch.shared_expert_intermediate_size

    def rand(*shape, scale=0.05):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    binding = FP8MoEBinding(arch)
    fc1, fc2 = binding.quantize_weight("experts_fc1", rand(E, 2 * inter, H)), binding.quantize_weight("experts_fc2", rand(E, H, inter))
    shared = (binding.quantize_weight("fc1", rand(2 * s, H)), binding.quantize_weight("copy", rand(H, s)), rand(1, H))
    x = rand(40, H, scale=1.0)
    w, experts = kmoe.route(x, rand(E, H, scale=0.3), arch.num_experts_per_tok)
    return binding, x, experts, w, fc1, fc2, shared


def test_fp8_expert_shards_quantize_as_the_whole_stack_and_a_sliced_expert_does_not():
    """A rank's whole experts quantized on their own are the TP = 1 stack's values and scales (no gather needed); a
    rank holding half of every expert's gate rows (32 of the 64-row part, a column-parallel cut) would quantize
    them on a grid of its own and get other scales -- why the experts are sharded whole."""
    arch = _arch("tiny-qwen2moe-fp8tp")
    binding, *_ = _moe_operands()
    g = torch.Generator().manual_seed(7)
    w = torch.randn(arch.num_experts, 2 * arch.moe_intermediate_size, arch.hidden_size, generator=g).to(torch.bfloat16)
    w[:, 32:64] *= 8  # the second half of each gate part holds its block's amax
    full = binding.quantize_weight("experts_fc1", w)
    for t in (2, 4):
        run = arch.num_experts // t
        for r in range(t):
            part = binding.quantize_weight("experts_fc1", w[r * run:(r + 1) * run])
            assert torch.equal(part.q.view(torch.uint8), full.q[r * run:(r + 1) * run].view(torch.uint8))
            assert torch.equal(part.rows, full.rows[r * run:(r + 1) * run])
    _, s_half = quantize(w[0, :32].contiguous(), E4M3_WEIGHT_128)
    assert not torch.equal(s_half[0], full.rows[0, 0])


@pytest.mark.parametrize("tp", [2, 4])
def test_fp8_owned_experts_summed_over_ranks_equal_tp1_and_broken_sums_are_caught(tp):
    """Engine ops (fixed shapes) and the trainer's (masters, owned pairs only): each rank's whole experts' pairs, the
    ranks' sum and the FP8 combine = ``fp8_moe_experts`` with every expert; one rank's outputs alone (no sum), or a
    rank computing its pairs with the next rank's experts, differ."""
    from megatron_consistent.kernels import inference_ops
    from megatron_consistent.kernels.fp8 import E4M3_ACT_1x128

    _, x, experts, w, fc1, fc2, shared = _moe_operands()
    specs = (E4M3_WEIGHT_128.spec, E4M3_ACT_1x128.spec)
    sh = (shared[0].q, shared[0].rows, shared[1].q, shared[1].rows, shared[2])
    one = inference_ops.fp8_moe_experts(x, experts, w, fc1.q, fc1.rows, fc2.q, fc2.rows, *sh, *specs)
    assert_owned_experts_sum_to_all(x, experts, w, fc1, fc2, sh, one, tp, specs)


def assert_owned_experts_sum_to_all(x, experts, w, fc1, fc2, sh, one, tp, specs, trainer_fmts=()):
    """Each of ``tp`` ranks' whole experts: the engine op's owned pairs (fixed shapes) == the trainer's (masters
    attached, ``trainer_fmts`` its weight / activation formats); the ranks' sum through the combine == ``one`` (every
    expert at once); one rank's outputs alone (no sum), or rank 0 computing with rank 1's experts, differ."""
    from megatron_consistent.kernels import inference_ops
    from megatron_consistent.kernels.fp8 import FP8Weights, fp8_owned_expert_outputs

    run = fc1.q.shape[0] // tp
    ranks = []
    for r in range(tp):
        cut = slice(r * run, (r + 1) * run)
        mine = inference_ops.fp8_moe_owned_expert_outputs(x, experts, r * run, fc1.q[cut], fc1.rows[cut], fc2.q[cut],
                                                         fc2.rows[cut], *specs)
        trainer = fp8_owned_expert_outputs(x, experts, r * run, *(FP8Weights(f.q[cut], f.rows[cut], f.master[cut], f.block_rows)
                                                                  for f in (fc1, fc2)), *trainer_fmts)
        assert torch.equal(mine, trainer.detach())
        ranks.append(mine)
    assert torch.equal(inference_ops.fp8_moe_combine(x, adjacent_tree_sum(torch.stack(ranks), dim=0), w, *sh, *specs), one)
    assert not torch.equal(inference_ops.fp8_moe_combine(x, ranks[0], w, *sh, *specs), one)  # no sum
    nxt = slice(run, 2 * run)
    wrong = inference_ops.fp8_moe_owned_expert_outputs(x, experts, 0, fc1.q[nxt], fc1.rows[nxt], fc2.q[nxt], fc2.rows[nxt], *specs)
    assert not torch.equal(inference_ops.fp8_moe_combine(x, adjacent_tree_sum(torch.stack([wrong, *ranks[1:]]), dim=0), w,
                                                         *sh, *specs), one)


@pytest.fixture(scope="module")
def fp8_moe_runs(tmp_path_factory):
    """tiny-qwen2moe-fp8tp in FP8.  Trainer: TP 1 here (logits and routes), TP 2, 4 and 2 + SP in gloo ranks.  Engine:
    the export at TP 1 and 2 (plain, reloaded in place with a second export, without the ranks' sum, with the next
    rank's run of experts), and TP 1 on the second export."""

    from megatron_consistent.conversion.fp8 import export_hf_fp8
    from megatron_consistent.kernels.fp8 import E4M3_ACT_1x128
    from megatron_consistent.layers.distributed import recompute_logprobs_parallel
    from megatron_consistent.layers.moe import collect_routes

    from _tp_ranks import PROMPT

    tmp = tmp_path_factory.mktemp("fp8moetp")
    weights = _weights(0, MOETP)
    ids = (torch.tensor([PROMPT[:36], PROMPT[::-1][:36]]) % 512)
    logits1, model = _trainer_tp1(weights, ids, model_dir=MOETP)
    routes1 = collect_routes(model)
    engine_dir, reload_dir = tmp / "fp8", tmp / "fp8_reload"
    export_hf_fp8(model, model.arch_config, engine_dir)
    _, model_b = _trainer_tp1(_weights(1, MOETP), ids[:1], model_dir=MOETP)
    export_hf_fp8(model_b, model_b.arch_config, reload_dir)
    secs, trainer = {}, {}
    for tp, sp in ((2, False), (4, False), (2, True)):
        t0 = time.perf_counter()
        trainer[tp, sp] = recompute_logprobs_parallel(MOETP, weights, ids, tp=tp, return_logits=True, return_routes=True,
                                                      sequence_parallel=sp, quantization=(E4M3_WEIGHT_128, E4M3_ACT_1x128),
                                                      workdir=tmp / f"trainer{tp}{sp}")
        secs[f"trainer_tp{tp}{'_sp' if sp else ''}"] = time.perf_counter() - t0
    engine = _engine_jobs(tmp, engine_dir, secs, {
        1: {"tp1": {}, "tp1_reload": {"model_dir": reload_dir}},
        2: {"tp2": {}, "reloaded": {"reload": str(reload_dir)}, "nosum": {"fault": "moe_nosum"}, "slice": {"fault": "moe_slice"}}})
    print("fp8 moe tp seconds:", secs)
    return {"ids": ids, "logits1": logits1, "routes1": routes1, "trainer": trainer, "engine": engine}


@pytest.mark.slow
@pytest.mark.parametrize("tp, sp", [(2, False), (4, False), (2, True)])
def test_fp8_moe_trainer_tp_logits_and_routes_equal_tp1(fp8_moe_runs, tp, sp):
    """The experts over the TP ranks in FP8 (2 or 4 ranks: 4 / 2 whole experts each), with and without sequence
    parallelism: the TP 1 logits and log-probs, and every MoE layer's routes."""
    from megatron_consistent.kernels import log_softmax

    lp, logits, routes = fp8_moe_runs["trainer"][tp, sp]
    ids, one = fp8_moe_runs["ids"], fp8_moe_runs["logits1"]
    one = one.transpose(0, 1) if one.shape[0] != ids.shape[0] else one
    assert torch.equal(logits, one.float())
    assert torch.equal(lp, log_softmax(one.float())[:, :-1].gather(-1, ids[:, 1:, None])[..., 0])
    (chunk,) = routes.values()  # one chunk of rows: {layer: experts [s*b, k]}
    assert set(chunk) == set(fp8_moe_runs["routes1"]) == {0, 1}
    for layer, experts in fp8_moe_runs["routes1"].items():
        assert torch.equal(chunk[layer], experts), layer


@pytest.mark.slow
def test_fp8_moe_engine_tp2_equals_tp1_and_the_trainer(fp8_moe_runs):
    _assert_engine_tp2_equals_tp1_and_the_trainer(fp8_moe_runs)
    r0, r1 = (fp8_moe_runs["engine"]["tp2"]["ranks"][r] for r in range(2))
    assert r0["held"]["layers.0.experts_fc1"] == [4, 128, 256] and r0["held"]["layers.0.experts_gate_scale"] == [4, 1, 2]
    assert r0["held"]["layers.0.shared_fc1"] == [256, 256] and r0["held"]["layers.0.o_proj_scale"] == [2, 2]
    gate7 = "model.layers.0.mlp.experts.7.gate_proj.weight"
    assert r0["parts"][gate7 + "_scale_inv"] == [0, 0, 0] and r1["parts"][gate7 + "_scale_inv"] is None
    assert r0["parts"][gate7] == [0, 0, 0] and r1["parts"][gate7] is None


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["nosum", "slice"])
def test_fp8_moe_engine_without_the_sum_or_with_the_wrong_experts_is_caught(fp8_moe_runs, fault):
    """Each rank combining only its own experts' outputs, or computing its pairs with the next rank's experts."""
    assert not torch.equal(fp8_moe_runs["engine"][fault]["out"]["logits"], fp8_moe_runs["engine"]["tp1"]["out"]["logits"])

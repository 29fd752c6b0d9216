"""Trainer tensor / pipeline parallelism (issue #18): bits equal to TP=1 / PP=1, gradients within the float64 bound.

* kernel level (no processes): the row-parallel K tree and the vocab-segmented log-softmax split by
  t ∈ {1, 2, 4, 8} simulated shards give the bits of the whole op; the tree is a real change (it differs
  from ``kernels.linear`` and from a left fold on some input);
* model level: ``tp * pp`` gloo ranks (``torch.multiprocessing`` spawn, ``FileStore`` in ``tmp_path``,
  tensors through safetensors files) — logits and token log-probs ``torch.equal`` to the single-process
  model for TP ∈ {1, 2, 4} x PP ∈ {1, 2}; TP=2 gradients vs the float64 reference; a broken row-parallel
  reduction (all-reduce of bf16 partials) is caught; Megatron ``sharded_state_dict`` TP offsets.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import pytest
import torch
from _parallel_layouts import check_layouts, reference
from _vocab_parallel import vocab_parallel
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from megatron_consistent import kernels
from megatron_consistent.config import ROW_PARALLEL_SEGMENTS_KEY, ArchConfig, UnsupportedConfigError, load_hf_config
from megatron_consistent.kernels.linear import SEGMENT_COUNTS
from megatron_consistent.kernels.numerics import adjacent_tree_sum

MODELS_DIR = Path(__file__).resolve().parents[1] / "megatron_consistent" / "configs" / "models"
LLAMA = MODELS_DIR / "tiny-llama"
QWEN2MOE = MODELS_DIR / "tiny-qwen2moe-top8-shared"  # 64 experts, top-8, a gated shared expert


# ---------------------------------------------------------------------------------------------- kernel level
def _simulated_row_parallel(x, w, bias, t, segments):
    """What t ranks compute under the contract of ``segments`` K segments: per rank the subtree of its K shard, then
    the tree's top."""
    k = w.shape[1]
    subtrees = [adjacent_tree_sum(kernels.linear_segments(x[..., r * k // t:(r + 1) * k // t], w[:, r * k // t:(r + 1) * k // t],
                                                          segments // t), dim=0) for r in range(t)]
    total = adjacent_tree_sum(torch.stack(subtrees), dim=0)
    if bias is not None:
        total = total + bias.float()
    return total.to(x.dtype)


@settings(max_examples=12)
@given(m=st.integers(1, 9), k8=st.integers(1, 40), n=st.integers(1, 24), bias=st.booleans(), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), segments=st.sampled_from(SEGMENT_COUNTS))
def test_row_parallel_linear_equals_simulated_tp_split(m, k8, n, bias, seed, dtype, segments):
    """Every S: the tree split over every t dividing S = the one-rank tree."""
    g = torch.Generator().manual_seed(seed)
    k = 8 * k8
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    whole = kernels.row_parallel_linear(x, w, segments, b)
    for t in (t for t in SEGMENT_COUNTS if t <= segments):
        assert torch.equal(_simulated_row_parallel(x, w, b, t, segments), whole), f"S={segments} TP={t}"
    assert torch.equal(kernels.inference_ops.row_parallel_linear(x, w, segments, b), whole)


def test_row_parallel_tree_is_real():
    """The 8-segment tree differs from the blocked left fold of ``kernels.linear`` and from a left fold of the
    8 segments on some input (so the tests above would catch an implementation that ignores the tree); the trees of
    S = 1, 2, 4, 8 differ from each other (so a plumbing that ignores the model's S is caught), and S = 1 is
    ``kernels.linear`` itself."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1024, generator=g)
    w = torch.randn(32, 1024, generator=g)
    tree = kernels.row_parallel_linear(x, w, 8, out_dtype=torch.float32)
    seg = kernels.linear_segments(x, w, 8)
    left = seg[0]
    for s in range(1, 8):
        left = left + seg[s]
    assert not torch.equal(tree, kernels.linear(x, w, out_dtype=torch.float32))
    assert not torch.equal(tree, left)
    trees = {s: kernels.row_parallel_linear(x, w, s, out_dtype=torch.float32) for s in SEGMENT_COUNTS}
    assert all(not torch.equal(trees[a], trees[b]) for a in SEGMENT_COUNTS for b in SEGMENT_COUNTS if a < b)
    assert torch.equal(trees[1], kernels.linear(x, w, out_dtype=torch.float32))


@settings(max_examples=12)
@given(rows=st.integers(1, 6), v8=st.integers(1, 200), scale=st.floats(0.1, 30.0), seed=st.integers(0, 2**31 - 1))
def test_log_softmax_equals_simulated_vocab_split(rows, v8, scale, seed):
    z = torch.randn(rows, 8 * v8, generator=torch.Generator().manual_seed(seed)) * scale
    whole = kernels.log_softmax(z)
    for t in (1, 2, 4, 8):
        assert torch.equal(vocab_parallel(z, t)[1], whole), f"TP={t}"


@pytest.mark.parametrize("v", [1, 7, 509, 1001])
def test_log_softmax_vocab_not_divisible_by_8_is_padded_with_minus_inf(v):
    """TP=1 with V % 8 != 0: the contract pads the last segment(s) with -inf logits (zero contributions)."""
    z = torch.randn(3, v, generator=torch.Generator().manual_seed(v)) * 5
    c = -(-v // 8)
    padded = torch.cat([z, torch.full((3, 8 * c - v), float("-inf"))], dim=-1)
    assert torch.equal(kernels.log_softmax(z), kernels.log_softmax(padded)[:, :v])


def test_log_softmax_segments_are_real():
    """The segmented sum differs from the former whole-vocabulary pairwise tree on some input."""
    from megatron_consistent.kernels.numerics import exp, log, tree_sum

    z = torch.randn(64, 4096, generator=torch.Generator().manual_seed(1)) * 4
    shifted = z - z.amax(-1, keepdim=True)
    old = shifted - log(tree_sum(exp(shifted)))[..., None]
    assert not torch.equal(old, kernels.log_softmax(z))


def test_vllm_plugin_logprobs_use_only_the_kernel_log_softmax():
    """The engine computes log-probs through ``kernels.log_softmax`` only (so the new contract is the engine's too)."""
    plugin = Path(__file__).resolve().parents[1] / "megatron_consistent" / "vllm_plugin"
    text = "\n".join(p.read_text() for p in plugin.rglob("*.py"))
    for other in ("torch.log_softmax", "F.log_softmax", "functional.log_softmax", "logsumexp", "torch.softmax"):
        assert other not in text, other
    assert "from ..kernels import log_softmax" in (plugin / "sampler.py").read_text()


# ---------------------------------------------------------------------------------------------- refusals
def test_parallel_refusals_are_named(tmp_path):
    from megatron_consistent.layers import build_consistent_model
    from megatron_consistent.layers.distributed import recompute_logprobs_parallel

    ids = torch.zeros(1, 4, dtype=torch.int64)
    three = tmp_path / "three-experts"  # the experts are sharded over the TP ranks
    three.mkdir()
    (three / "config.json").write_text(json.dumps({**load_hf_config(MODELS_DIR / "tiny-qwen3moe-top1"), "num_local_experts": 3}))
    with pytest.raises(UnsupportedConfigError, match="num_experts=3 is not divisible by TP=2"):
        recompute_logprobs_parallel(three, {}, ids, tp=2)
    with pytest.raises(UnsupportedConfigError, match="num_key_value_heads=2 is not divisible by TP=4"):
        recompute_logprobs_parallel(LLAMA, {}, ids, tp=4)
    with pytest.raises(UnsupportedConfigError, match="tensor parallelism of size 3"):
        recompute_logprobs_parallel(LLAMA, {}, ids, tp=3)
    with pytest.raises(UnsupportedConfigError, match="moe_impl='megatron' with TP/PP/EP/CP > 1 is not supported"):
        build_consistent_model(MODELS_DIR / "tiny-qwen3moe-top1", tensor_model_parallel_size=2, moe_impl="megatron")
    if not torch.cuda.is_available():
        with pytest.raises(UnsupportedConfigError, match="tied word embeddings at PP > 1 without CUDA"):
            recompute_logprobs_parallel(MODELS_DIR / "tiny-qwen3-qknorm-tied", {}, ids, pp=2)
    with pytest.raises(UnsupportedConfigError, match="sequence parallelism without tensor parallelism"):
        build_consistent_model(LLAMA, sequence_parallel=True)
    with pytest.raises(UnsupportedConfigError, match="context parallelism of size 3"):  # CP: tests/test_context_parallel.py
        build_consistent_model(LLAMA, context_parallel_size=3)
    with pytest.raises(UnsupportedConfigError, match="EP=2 cannot split LlamaForCausalLM: expert parallelism on a model "
                       "without experts"):
        build_consistent_model(LLAMA, expert_model_parallel_size=2)
    with pytest.raises(UnsupportedConfigError, match="num_experts=3 is not divisible by EP=2"):
        recompute_logprobs_parallel(three, {}, ids, dp=2, ep=2)
    with pytest.raises(UnsupportedConfigError, match="expert parallelism at TP > 1 without sequence parallelism"):
        recompute_logprobs_parallel(MODELS_DIR / "tiny-qwen3moe-top1", {}, ids, tp=2, dp=2, ep=2)
    with pytest.raises(UnsupportedConfigError, match=r"EP=2 must divide TP x DP = 3"):
        recompute_logprobs_parallel(MODELS_DIR / "tiny-qwen3moe-top1", {}, ids, dp=3, ep=2)
    with pytest.raises(UnsupportedConfigError, match=r"hybrid \(Mamba\) model with expert parallelism"):
        recompute_logprobs_parallel(MODELS_DIR / "tiny-nemotronh-moe", {}, ids, dp=2, ep=2)
    with pytest.raises(ValueError, match="1 rows cannot give each of 2 data-parallel ranks a row"):
        recompute_logprobs_parallel(LLAMA, {}, ids, dp=2)
    # one process: before torch.distributed is up (the first) or at world size 1 (after an earlier test started it)
    with pytest.raises(UnsupportedConfigError, match="EP=2 (needs torch.distributed initialized by the caller|must divide "
                       "the ranks of a pipeline stage)"):
        build_consistent_model(MODELS_DIR / "tiny-qwen3moe-top1", expert_model_parallel_size=2)


@pytest.mark.parametrize("rows,dp,batch", [(5, 2, None), (5, 2, 2), (16, 4, 3), (7, 7, None), (9, 2, 1), (4, 1, 4)])
def test_data_parallel_chunks_cover_the_rows_once_with_equal_forward_counts(rows, dp, batch):
    from megatron_consistent.layers.distributed import data_parallel_chunks

    plan = data_parallel_chunks(rows, dp, batch)
    assert len(plan) == dp and len({len(chunks) for chunks in plan}) == 1  # every rank: the same number of forwards
    flat = [c for chunks in plan for c in chunks]
    assert [r for a, b in flat for r in range(a, b)] == list(range(rows))  # contiguous, in rank order, each row once
    assert all(0 < b - a <= (batch or rows) + 1 for a, b in flat)  # + 1: where the smaller shares set the count
    if batch is not None and rows % dp == 0:
        assert all(b - a <= batch for a, b in flat)
    shares = [chunks[-1][1] - chunks[0][0] for chunks in plan]
    assert max(shares) - min(shares) <= 1


def test_rank_backend_and_device_count_refusal(tmp_path, monkeypatch):
    """CPU ranks are gloo, CUDA ranks NCCL; CUDA ranks need one visible device each, refused by name (with how many
    are needed and visible) before any process starts or any file is written; an unknown device is refused."""
    from megatron_consistent.layers.distributed import recompute_logprobs_parallel, spawn_ranks
    from megatron_consistent.layers.parallel import check_rank_devices, rank_backend

    assert (rank_backend("cpu"), rank_backend("cuda")) == ("gloo", "nccl")
    with pytest.raises(ValueError, match="rank device must be 'cpu' .* or 'cuda' .*, got 'mps'"):
        rank_backend("mps")
    check_rank_devices("cpu", 8, visible=0)
    check_rank_devices("cuda", 2, visible=2)
    with pytest.raises(UnsupportedConfigError, match=r"^2 ranks on CUDA need 2 CUDA devices \(one NCCL rank per device\), 1 visible$"):
        check_rank_devices("cuda", 2, visible=1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    ids = torch.zeros(1, 4, dtype=torch.int64)
    with pytest.raises(UnsupportedConfigError, match="4 ranks on CUDA need 4 CUDA devices .*, 1 visible"):
        recompute_logprobs_parallel(LLAMA, {}, ids, tp=2, pp=2, device="cuda", workdir=tmp_path / "job")
    with pytest.raises(UnsupportedConfigError, match="2 ranks on CUDA need 2 CUDA devices"):
        spawn_ranks(print, 2, tmp_path / "job", device="cuda")
    with pytest.raises(ValueError, match="got 'tpu'"):
        recompute_logprobs_parallel(LLAMA, {}, ids, tp=2, device="tpu", workdir=tmp_path / "job")
    assert not (tmp_path / "job").exists()


@pytest.mark.parametrize("device, backend", [("cpu", "gloo"), ("cuda", "nccl")])
def test_rank_main_selects_backend_device_and_multicast_off(tmp_path, monkeypatch, device, backend):
    """What one spawned rank sets up (collectives stubbed, in this process): gloo and nothing else on the CPU; NCCL with
    ``cuda:<rank>`` as the current and bound device and NVLink multicast off on CUDA."""
    import os

    import torch.distributed as dist

    from megatron_consistent.layers import distributed as ld

    for name in ld.NVLINK_MULTICAST_OFF:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    seen = {}
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(backend=backend, **kw))
    monkeypatch.setattr(dist, "barrier", lambda: seen.update(barrier=True))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: seen.update(destroyed=True))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.update(set_device=d))

    def worker(rank, workdir, tag):
        seen.update(worker=(rank, workdir, tag), env={k: os.environ.get(k) for k in ld.NVLINK_MULTICAST_OFF})

    ld._rank_main(1, worker, str(tmp_path), 2, device, ("x",))
    assert seen["backend"] == backend and (seen["rank"], seen["world_size"]) == (1, 2)
    assert seen["worker"] == (1, str(tmp_path), "x") and seen["barrier"] and seen["destroyed"]
    if device == "cuda":
        assert seen["set_device"] == 1 and seen["device_id"] == torch.device("cuda", 1)
        assert seen["env"] == ld.NVLINK_MULTICAST_OFF
    else:
        assert "set_device" not in seen and "device_id" not in seen
        assert seen["env"] == dict.fromkeys(ld.NVLINK_MULTICAST_OFF)


def _caller_state_worker(rank: int, workdir: str) -> None:
    import os

    # one write call: the ranks share the file, and a print may write its line and its newline in two
    os.write(1, f"rank {rank} of the job in {os.getcwd()} tagged {os.environ['MC_TEST_JOB_TAG']}\n".encode())


@contextlib.contextmanager
def _stdout_to(path: Path):
    """File descriptor 1 of this process on ``path`` inside the ``with`` (restored afterwards)."""
    import os

    saved = os.dup(1)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)


@pytest.mark.slow
def test_cpu_jobs_share_the_warm_launcher_and_take_the_callers_state(tmp_path, monkeypatch):
    """Two CPU jobs of one caller go through the same warm rank launcher, each with the caller's environment, working
    directory and stdout as they are at that job; a launcher that died is replaced."""
    from megatron_consistent.layers import distributed as ld

    launchers = []
    for tag in ("first", "second"):
        (tmp_path / tag).mkdir()
        monkeypatch.chdir(tmp_path / tag)
        monkeypatch.setenv("MC_TEST_JOB_TAG", tag)
        with _stdout_to(tmp_path / f"{tag}.out"):
            ld.spawn_ranks(_caller_state_worker, 2, tmp_path / tag)
        launchers.append(ld._RANK_LAUNCHER[1])
        assert sorted((tmp_path / f"{tag}.out").read_text().splitlines()) == [
            f"rank {r} of the job in {tmp_path / tag} tagged {tag}" for r in range(2)]
    assert launchers[0] is launchers[1] and launchers[0].is_alive()
    launchers[0].kill()  # a dead launcher is replaced at the next job
    launchers[0].join()
    with _stdout_to(tmp_path / "after.out"):
        ld.spawn_ranks(_caller_state_worker, 2, tmp_path / tag)
    assert ld._RANK_LAUNCHER[1] is not launchers[0] and len((tmp_path / "after.out").read_text().splitlines()) == 2


def _refusing_rank_worker(rank: int, workdir: str) -> None:
    """Rank 1 refuses; rank 0 waits for its tensor and fails when rank 1 leaves the group -- while rank 1 is still
    exiting (a 30 s finalizer, cut short: ``torch.multiprocessing`` ends the other ranks at the first failure it
    sees), so rank 0's failure is the one seen first."""
    import time
    from multiprocessing import util

    if rank == 1:
        util.Finalize(None, time.sleep, args=(30,), exitpriority=0)
        raise ValueError("rank 1 refuses the job")
    torch.distributed.recv(torch.empty(4), src=1)


@pytest.mark.slow
def test_the_rank_that_raised_first_is_reported(tmp_path, monkeypatch):
    """A peer that lost its connection to a refusing rank is not what :func:`spawn_ranks` reports: the refusal is
    (without the first-raised rule, the peer's connection error is)."""
    from torch.multiprocessing import ProcessRaisedException

    from megatron_consistent.layers import distributed as ld

    with pytest.raises(ProcessRaisedException, match="rank 1 refuses the job") as e:
        ld.spawn_ranks(_refusing_rank_worker, 2, tmp_path)
    assert e.value.error_index == 1
    monkeypatch.setattr(ld, "_first_raised", lambda workdir, reported: reported)
    with pytest.raises(ProcessRaisedException) as e:
        ld.spawn_ranks(_refusing_rank_worker, 2, tmp_path)
    assert e.value.error_index == 0 and "rank 1 refuses the job" not in str(e.value), str(e.value)


# ---------------------------------------------------------------------------------------------- model level
def _config_dir(tmp_path: Path, base: Path = LLAMA, **fields) -> Path:
    """``base``'s config with ``fields`` set, in a folder of its own under ``tmp_path``."""
    out = tmp_path / "-".join([base.name, *(f"{k}{v}" for k, v in fields.items())])
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps({**load_hf_config(base), **fields}))
    return out


def _mha_config(tmp_path: Path, base: Path = LLAMA) -> Path:
    """``base`` with 4 KV heads (Megatron splits KV groups across TP ranks: TP=4 needs 4 of them)."""
    return _config_dir(tmp_path, base, num_key_value_heads=4)


@pytest.mark.slow
def test_logits_and_logprobs_equal_across_tp_pp_llama(tmp_path):
    """tiny-llama (2 KV heads): TP ∈ {1, 2} x PP ∈ {1, 2} (TP=1 PP=1 spawned too: the one-rank gloo job)."""
    check_layouts(LLAMA, [(1, 1), (2, 1), (1, 2), (2, 2)], tmp_path)


@pytest.mark.slow
def test_logits_and_logprobs_equal_across_tp_pp_tp4(tmp_path):
    """tiny-llama with 4 KV heads: TP=4 x PP ∈ {1, 2} (8 ranks)."""
    check_layouts(_mha_config(tmp_path), [(4, 1), (4, 2)], tmp_path)


@pytest.mark.slow
def test_logits_and_logprobs_equal_tp2_tied_qk_norm(tmp_path):
    """tiny-qwen3-qknorm-tied (q/k RMSNorm per head, LM head = the embedding's vocabulary shard): TP=2, TP=2 + SP."""
    check_layouts(MODELS_DIR / "tiny-qwen3-qknorm-tied", [(2, 1), (2, 1, True)], tmp_path)


@pytest.mark.slow
def test_logits_and_logprobs_equal_across_tp_pp_moe(tmp_path):
    """tiny-qwen3moe-top1 (layer 0 dense, layer 1 MoE; experts sharded over the TP ranks, moe_impl='module') at
    TP=2, PP=2 and TP=2 + sequence parallelism vs the single-process model with Megatron's MoELayer (default impl)."""
    check_layouts(MODELS_DIR / "tiny-qwen3moe-top1", [(2, 1), (1, 2), (2, 1, True)], tmp_path)


@pytest.mark.slow
def test_logits_and_logprobs_equal_moe_tp4(tmp_path):
    """tiny-qwen3moe-top1 with 4 KV heads at TP=4 (two of its 8 experts a rank) and TP=4 + sequence parallelism."""
    check_layouts(_mha_config(tmp_path, MODELS_DIR / "tiny-qwen3moe-top1"), [(4, 1), (4, 1, True)], tmp_path)


# ---------------------------------------------------------------------------------------------- S, the model's segments
S_KEY = ROW_PARALLEL_SEGMENTS_KEY
TP4_NOT_IN_S2 = "consistent_row_parallel_segments=2: the row-parallel K tree has 2 segments, so TP must divide 2"
# S's trees differ in float32 rounding (~1 ulp); in a bf16 model those differences rarely survive the rounding of a
# tiny model's few linear outputs to bf16 (tiny-llama at S = 4 and S = 8: the same bf16 logits), so the S tests run
# float32 models, whose row-parallel outputs keep them
FLOAT32 = {"dtype": "float32"}  # transformers writes the dtype as "dtype"


def test_row_parallel_segments_read_written_kept_and_refused():
    """S comes from the HF key (absent: 8, and to_hf writes no key: every existing config and its bits unchanged), is
    written back by to_hf when it is not 8 and kept by as_dict / from_dict (through JSON too), dense and hybrid; any S
    but 1, 2, 4, 8 is refused by name in from_hf."""
    for name in ("tiny-llama", "tiny-nemotronh"):
        hf = load_hf_config(MODELS_DIR / name)
        arch = ArchConfig.from_hf(hf)
        assert arch.row_parallel_segments == 8 and S_KEY not in arch.to_hf()
        for segments in (1, 2, 4):
            arch = ArchConfig.from_hf({**hf, S_KEY: segments})
            assert arch.row_parallel_segments == segments and arch.to_hf()[S_KEY] == segments
            assert ArchConfig.from_hf(arch.to_hf()) == arch
            assert ArchConfig.from_dict(json.loads(json.dumps(arch.as_dict()))) == arch
        for bad in (3, 16, 0, "4", 4.0, True):
            with pytest.raises(UnsupportedConfigError, match=re.escape(f"{S_KEY}={bad!r}: the row-parallel K tree's "
                                                                       "segment count must be one of (1, 2, 4, 8)")):
                ArchConfig.from_hf({**hf, S_KEY: bad})


def test_row_parallel_segments_change_the_trainer_bits(tmp_path):
    """The same seeded weights at S = 4 and S = 8 give different logits and log-probs (float32 tiny-llama, K = 128 /
    256: segments of 32 / 64 columns against 16 / 32 sum in another order), so a plumbing that ignores the key is caught
    by the TP test of the S = 4 model; S = 1 (one segment: the plain linear) runs at TP = 1, with other bits again."""
    from safetensors.torch import load_file

    out = {}
    for segments in (8, 4, 1):
        config = _config_dir(tmp_path, LLAMA, **FLOAT32, **({} if segments == 8 else {S_KEY: segments}))
        out[segments] = reference(config, tmp_path / f"s{segments}", dtype=torch.float32)
    weights = {s: load_file(str(o[0] / "model.safetensors")) for s, o in out.items()}
    assert all(torch.equal(weights[s][n], w) for s in (4, 1) for n, w in weights[8].items())  # the same weights
    assert all(torch.equal(out[s][1], out[8][1]) for s in (4, 1))  # the same tokens
    for segments in (4, 1):
        assert torch.isfinite(out[segments][2]).all()
        assert not torch.equal(out[segments][2], out[8][2]) and not torch.equal(out[segments][3], out[8][3]), segments
    assert not torch.equal(out[4][2], out[1][2])


def test_entry_point_layers_take_s_from_the_framework_config(tmp_path):
    """The framework entry point (``consistent_layer_spec_provider``) builds its row-parallel layers with the config's
    ``consistent_row_parallel_segments``: the S = 4 model's logits; the same weights under an S = 8 config differ."""
    from megatron_consistent.layers import as_arch_config
    from megatron_consistent.layers.distributed import stage_forward

    eight, s4 = _config_dir(tmp_path, LLAMA, **FLOAT32), _config_dir(tmp_path, LLAMA, **FLOAT32, **{S_KEY: 4})
    weights, ids, logits, _ = reference(s4, tmp_path, dtype=torch.float32)
    with torch.no_grad():
        got = stage_forward(_entry_point_model(as_arch_config(s4), weights), ids)
        eight = stage_forward(_entry_point_model(as_arch_config(eight), weights), ids)
    assert torch.equal(got, logits) and not torch.equal(eight, logits)


def test_a_model_built_with_another_s_than_its_architecture_refused_by_name(tmp_path):
    """A framework config without ``consistent_row_parallel_segments`` builds S = 8 layers; with a checkpoint whose
    ``config.json`` says S = 4 the trainer would run another tree than the engine (other bits, silently): export, push
    (``hf_state_dict``), import and ``enable_fp8`` refuse it by name before any work, and the import leaves every
    weight as it was; the same model with its own architecture passes."""
    from megatron_consistent.conversion import hf_state_dict, import_hf
    from megatron_consistent.layers import as_arch_config
    from megatron_consistent.layers.fp8 import enable_fp8

    eight, s4 = _config_dir(tmp_path, LLAMA, **FLOAT32), _config_dir(tmp_path, LLAMA, **FLOAT32, **{S_KEY: 4})
    weights, _, _, _ = reference(s4, tmp_path, dtype=torch.float32)
    arch8, arch4 = as_arch_config(eight), as_arch_config(s4)
    model = _entry_point_model(arch8, weights)  # the framework's config lacks the key: S = 8 layers
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    message = re.escape(f"{S_KEY}: the model's row-parallel layers were built with S = 8, its architecture says S = 4")
    for attempt in (lambda: hf_state_dict(model, arch4), lambda: import_hf(model, arch4, weights)):
        with pytest.raises(UnsupportedConfigError, match=message):
            attempt()
    model.arch_config = arch4
    with pytest.raises(UnsupportedConfigError, match=message):
        enable_fp8(model)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert hf_state_dict(model, arch8).keys() == hf_state_dict(_entry_point_model(arch4, weights), arch4).keys()


def test_tp_not_dividing_the_models_s_refused_by_name(tmp_path):
    """S = 2 at TP = 4 (4 KV heads: nothing else stops it) and S = 1 at TP = 2, before any work: the parallel recompute,
    the build, and a framework's config through the entry point."""
    from megatron_consistent.layers import as_arch_config, build_consistent_model, make_transformer_config
    from megatron_consistent.layers.distributed import recompute_logprobs_parallel
    from megatron_consistent.layers.entry_points import consistent_layer_spec_provider

    ids = torch.zeros(1, 4, dtype=torch.int64)
    s2 = _config_dir(tmp_path, LLAMA, num_key_value_heads=4, **{S_KEY: 2})
    with pytest.raises(UnsupportedConfigError, match=f"TP=4, PP=1 cannot split LlamaForCausalLM: {TP4_NOT_IN_S2}"):
        recompute_logprobs_parallel(s2, {}, ids, tp=4)
    with pytest.raises(UnsupportedConfigError, match=TP4_NOT_IN_S2):
        build_consistent_model(s2, tensor_model_parallel_size=4)
    config = make_transformer_config(as_arch_config(s2), torch.bfloat16, consistent=False, tensor_model_parallel_size=4)
    with pytest.raises(UnsupportedConfigError, match=TP4_NOT_IN_S2):
        consistent_layer_spec_provider(config)
    with pytest.raises(UnsupportedConfigError, match="segments=1: the row-parallel K tree has 1 segments, so TP must "
                       "divide 1"):
        recompute_logprobs_parallel(_config_dir(tmp_path, LLAMA, **{S_KEY: 1}), {}, ids, tp=2)


@pytest.mark.slow
def test_row_parallel_segments_4_logits_equal_at_tp_1_2_4(tmp_path):
    """float32 tiny-llama with 4 KV heads at S = 4: TP = 2 and TP = 4 (S / t = 2 and 1 segments a rank) give the
    one-process S = 4 model's logits and log-probs (which differ from S = 8: the test above)."""
    check_layouts(_config_dir(tmp_path, LLAMA, num_key_value_heads=4, **FLOAT32, **{S_KEY: 4}), [(2, 1), (4, 1)], tmp_path,
                  dtype=torch.float32)


def _gradient_errors(grads_file: Path, weights: Path, ids: torch.Tensor) -> dict[str, float]:
    """Relative Frobenius error of every gradient (full Megatron tensors in ``grads_file``) vs the float64 reference;
    where the reference has none (an expert no token was routed to), the largest magnitude of ours (it must be 0)."""
    from megatron_consistent.config import ArchConfig
    from megatron_consistent.conversion.hf import _plan, _split
    from megatron_consistent.verify.reference import reference_logprobs_f64

    arch = ArchConfig.from_hf(load_hf_config(weights))
    grads = load_file(str(grads_file))
    hf_grads = {}
    for mname, hf_names, kind in _plan(arch):
        for n, part in zip(hf_names, _split(arch, kind, grads[mname])):
            hf_grads[n] = part
    w64 = {k: v.double().requires_grad_(True) for k, v in load_file(str(weights / "model.safetensors")).items()}
    (-reference_logprobs_f64(w64, arch, ids).mean()).backward()
    return {k: hf_grads[k].abs().max().item() if t.grad is None else
            ((hf_grads[k].double() - t.grad).norm() / t.grad.norm()).item() for k, t in w64.items()}


def _sp_worker(rank: int, workdir: str) -> None:
    """TP=2 with sequence parallelism: logits (gathered over the vocabulary) and float32 gradients."""
    import torch.distributed as dist

    from megatron_consistent.layers import tensor_parallel as tpar
    from megatron_consistent.layers.distributed import build_parallel_model, gather_vocab, stage_forward, stage_logprobs

    work = Path(workdir)
    ids = load_file(str(work / "inputs.safetensors"))["input_ids"]
    cfg = work / "weights" / "config.json"
    model = build_parallel_model(cfg, work / "weights", tp=2, dtype=torch.bfloat16, sequence_parallel=True)
    with torch.no_grad():
        logits = gather_vocab(stage_forward(model, ids)).contiguous()
    model32 = build_parallel_model(cfg, work / "weights", tp=2, dtype=torch.float32, sequence_parallel=True)
    (-stage_logprobs(model32, ids).mean()).backward()
    for p in model32.parameters():  # what Megatron's finalize_model_grads does for sequence-parallel parameters
        if getattr(p, "sequence_parallel", False):
            dist.all_reduce(p.grad, group=tpar.tp_group())
    grads = {name: tpar.unshard_like(p.grad, p).contiguous() for name, p in model32.named_parameters()}
    if rank == 0:
        save_file({"logits": logits}, str(work / "out.safetensors"))
        save_file(grads, str(work / "grads.safetensors"))


@pytest.mark.slow
def test_sequence_parallel_tp2_bits_and_gradients(tmp_path):
    """TP=2 + sequence parallelism: logits torch.equal to TP=1 (and TP=2 PP=2 + SP through the recompute helper);
    gradients (norm weights all-reduced as Megatron's finalize_model_grads does) within GRAD_REL_TOL of float64."""
    from megatron_consistent.layers.distributed import recompute_logprobs_parallel, spawn_ranks
    from megatron_consistent.verify.reference import GRAD_REL_TOL

    weights, ids, logits, lp = reference(LLAMA, tmp_path)
    save_file({"input_ids": ids}, str(tmp_path / "inputs.safetensors"))
    spawn_ranks(_sp_worker, 2, tmp_path)
    assert torch.equal(load_file(str(tmp_path / "out.safetensors"))["logits"], logits)
    errs = _gradient_errors(tmp_path / "grads.safetensors", weights, ids)
    print(f"TP=2 SP gradients: max relative error vs float64 {max(errs.values()):.3g} ({max(errs, key=errs.get)})")
    assert max(errs.values()) < GRAD_REL_TOL, errs
    got_lp, got_logits = recompute_logprobs_parallel(LLAMA, weights, ids, tp=2, pp=2, sequence_parallel=True,
                                                     return_logits=True, workdir=tmp_path / "tp2pp2sp")
    assert torch.equal(got_logits, logits) and torch.equal(got_lp, lp)


def _tp2_worker(rank: int, workdir: str) -> None:
    """One TP=2 job: correct forward + gradients, sharded_state_dict offsets, then the broken reduction."""
    import torch.distributed as dist

    from megatron_consistent.layers import tensor_parallel as tpar
    from megatron_consistent.layers.distributed import build_parallel_model, stage_forward, stage_logprobs

    work = Path(workdir)
    ids = load_file(str(work / "inputs.safetensors"))["input_ids"]
    out = {}
    model = build_parallel_model(work / "weights" / "config.json", work / "weights", tp=2, dtype=torch.bfloat16)
    with torch.no_grad():
        out["logits"] = stage_forward(model, ids).contiguous()
        # Megatron's VocabParallelEmbedding: lookup in the rank's vocabulary shard, zeros elsewhere, all-reduce SUM
        out["embedding"] = model.embedding(input_ids=ids, position_ids=kernels.causal_positions(*ids.shape)).contiguous()

    # sharded_state_dict: Megatron's TP offsets (global shape = full shape, offset = rank * local rows/cols)
    meta = {}
    for key, sh in model.sharded_state_dict().items():
        if hasattr(sh, "local_shape") and hasattr(sh, "global_offset"):
            meta[key] = {"global_shape": list(sh.global_shape), "global_offset": list(sh.global_offset),
                         "local_shape": list(sh.local_shape)}
        else:
            meta[key] = {"kind": type(sh).__name__}

    # Megatron dist_checkpointing (torch_dist) save of the TP=2 shards; the test loads it at TP=1
    from megatron.core import dist_checkpointing

    from megatron_consistent.layers.cpu_shims import cuda_stubs_for_checkpoint

    (work / "dist").mkdir(exist_ok=True)
    dist.barrier()
    with cuda_stubs_for_checkpoint():
        dist_checkpointing.save(model.sharded_state_dict(), str(work / "dist"))

    # gradients (float32 model) of -mean(log-probs), gathered to full Megatron tensors
    model32 = build_parallel_model(work / "weights" / "config.json", work / "weights", tp=2, dtype=torch.float32)
    loss = -stage_logprobs(model32, ids).mean()
    loss.backward()
    grads = {name: tpar.unshard_like(p.grad, p).contiguous() for name, p in model32.named_parameters()}

    # broken variant: a row-parallel layer that all-reduces (SUM) its bf16-rounded partial products
    def broken(x, weight, bias, group, segments, out_dtype=None):
        y = kernels.linear(x, weight, None).contiguous()
        dist.all_reduce(y, group=group)
        return y if bias is None else y + bias

    tpar.row_parallel_forward = broken
    with torch.no_grad():
        out["broken_logits"] = stage_forward(model, ids).contiguous()
    if rank == 0:
        save_file(out, str(work / "out.safetensors"))
        save_file(grads, str(work / "grads.safetensors"))
        (work / "sharded.json").write_text(json.dumps(meta))


@pytest.mark.slow
def test_tp2_bits_gradients_checkpoint_offsets_and_broken_reduction(tmp_path):
    """TP=2 in one gloo job of 2 ranks: logits torch.equal to TP=1; gradients vs float64 within GRAD_REL_TOL; the
    sharded_state_dict carries Megatron's TP offsets; an all-reduce of bf16 partials is caught (logits differ)."""
    from megatron_consistent.config import ArchConfig
    from megatron_consistent.layers.distributed import spawn_ranks
    from megatron_consistent.verify.reference import GRAD_REL_TOL

    weights, ids, logits, _ = reference(LLAMA, tmp_path)
    save_file({"input_ids": ids}, str(tmp_path / "inputs.safetensors"))
    spawn_ranks(_tp2_worker, 2, tmp_path)
    out = load_file(str(tmp_path / "out.safetensors"))
    full = out["logits"]
    assert full.shape[-1] == logits.shape[-1] // 2  # rank 0's vocabulary shard
    assert torch.equal(full, logits[..., : logits.shape[-1] // 2])
    assert not torch.equal(out["broken_logits"], full), "the broken all-reduce of bf16 partials was not caught"
    # the vocab-parallel embedding's all-reduce adds one looked-up value and zeros: exact
    table = load_file(str(weights / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(out["embedding"], table[ids].transpose(0, 1))

    errs = _gradient_errors(tmp_path / "grads.safetensors", weights, ids)
    print(f"TP=2 gradients: max relative error vs float64 {max(errs.values()):.3g} ({max(errs, key=errs.get)})")
    assert max(errs.values()) < GRAD_REL_TOL, errs

    meta = json.loads((tmp_path / "sharded.json").read_text())
    qkv = meta["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv["global_shape"][-2:] == [256, 128] and qkv["local_shape"] == [128, 128]
    proj = meta["decoder.layers.0.self_attention.linear_proj.weight"]
    assert proj["global_shape"][-2:] == [128, 128] and proj["local_shape"] == [128, 64] and proj["global_offset"][-1] == 0
    emb = meta["embedding.word_embeddings.weight"]
    assert emb["global_shape"] == [512, 128] and emb["local_shape"] == [256, 128]
    out_layer = meta["output_layer.weight"]
    assert out_layer["global_shape"] == [512, 128] and out_layer["local_shape"] == [256, 128]
    assert "decoder.layers.0.mlp.linear_fc1.weight" in meta  # Megatron's swiglu factory (gate shard | up shard)

    # the TP=2 dist checkpoint loads into a TP=1 model as the full tensors (Megatron resharding), bit for bit
    from megatron_consistent.checkpoint import _load_dist_staged
    from megatron_consistent.layers import build_consistent_model
    from megatron_consistent.layers.distributed import megatron_state_from_hf, read_hf_tensors

    loaded = _load_dist_staged(build_consistent_model(LLAMA, seed=1), tmp_path / "dist")
    want = megatron_state_from_hf(ArchConfig.from_hf(load_hf_config(LLAMA)), read_hf_tensors(weights))
    for name, tensor in want.items():
        assert torch.equal(loaded[name], tensor), name


# ---------------------------------------------------------------------------------------------- framework entry points
def _entry_point_model(arch, weights: Path, tp: int = 1, pp: int = 1, sp: bool = False, ep: int = 1, dtype=None,
                       dispatcher: str = "allgather"):
    """A GPTModel built the way Megatron-Bridge / Megatron-LM 0.19 build one from ``consistent_layer_spec_provider``
    (the framework's own TransformerConfig at TP / PP / EP -- a MoE config with Megatron's MoE fields, ``moe_layer_freq``
    from the architecture --, its GPTModel call with Megatron's RoPE arguments), the reference weights loaded as the
    rank's shards."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_consistent.layers import apply_cpu_shims, init_cpu_process_group, make_transformer_config
    from megatron_consistent.layers.distributed import load_full_megatron_state, megatron_state_from_hf, read_hf_tensors
    from megatron_consistent.layers.entry_points import consistent_layer_spec_provider
    from megatron_consistent.layers.moe_megatron import megatron_moe_config_kwargs

    init_cpu_process_group(tp, pp, expert_model_parallel_size=ep, sequence_parallel=sp)
    apply_cpu_shims()  # Megatron's own RotaryEmbedding (computed, then ignored, under 'rope') asks for CUDA otherwise
    moe = {}
    if arch.is_moe:
        moe = {**megatron_moe_config_kwargs(arch, dispatcher), "expert_model_parallel_size": ep,
               "moe_layer_freq": [int(arch.layer_is_moe(i)) for i in range(arch.num_layers)]}
    cfg = make_transformer_config(arch, dtype or arch.torch_dtype, consistent=False, tensor_model_parallel_size=tp,
                                  pipeline_model_parallel_size=pp, sequence_parallel=sp, **moe)
    cfg.consistent_rope = arch.rope
    model = GPTModel(config=cfg, transformer_layer_spec=consistent_layer_spec_provider(cfg), vocab_size=arch.vocab_size,
                     max_sequence_length=arch.max_position_embeddings, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(), parallel_output=True,
                     share_embeddings_and_output_weights=arch.tie_word_embeddings, position_embedding_type="rope",
                     rotary_base=arch.rope_theta)
    model.sequence_parallel = sp  # what stage_forward reads for a stage's received chunk
    load_full_megatron_state(model, megatron_state_from_hf(arch, read_hf_tensors(weights)))
    return model


def _entry_point_worker(rank: int, workdir: str, config: str, tp: int, pp: int, sp: bool) -> None:
    """The entry-point model (:func:`_entry_point_model`) at TP / PP, the logits gathered over the vocabulary."""
    from megatron.core import parallel_state as ps

    from megatron_consistent.layers import as_arch_config
    from megatron_consistent.layers.distributed import gather_vocab, stage_forward

    work = Path(workdir)
    model = _entry_point_model(as_arch_config(config), work / "weights", tp, pp, sp)
    with torch.no_grad():
        logits = stage_forward(model, load_file(str(work / "inputs.safetensors"))["input_ids"])
    if logits is not None:
        logits = gather_vocab(logits)
        if ps.get_tensor_model_parallel_rank() == 0:
            save_file({"logits": logits.contiguous()}, str(work / "out.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp, sp", [(2, 1, False), (1, 2, False), (2, 2, False), (2, 1, True), (2, 2, True)])
def test_entry_point_spec_at_tp_and_pp_gives_the_one_process_logits(tmp_path, tp, pp, sp):
    """The framework entry point (``consistent_layer_spec_provider``) at TP 2, PP 2, TP 2 x PP 2, with and without
    sequence parallelism, on tiny-llama: the logits of the model the framework builds are the single-process model's,
    bit for bit."""
    from megatron_consistent.layers.distributed import spawn_ranks

    weights, ids, logits, _ = reference(LLAMA, tmp_path)
    save_file({"input_ids": ids}, str(tmp_path / "inputs.safetensors"))
    spawn_ranks(_entry_point_worker, tp * pp, tmp_path, str(LLAMA), tp, pp, sp)
    assert torch.equal(load_file(str(tmp_path / "out.safetensors"))["logits"], logits)


# ---------------------------------------------------------------------------------------------- data / expert parallelism
@pytest.mark.slow
def test_logits_equal_across_data_and_expert_parallel_layouts(tmp_path):
    """DP = 2 replicas (5 rows: shares of 3 and 2) and DP = 4 (one or two rows each), dense and MoE, and the MoE
    experts sharded over EP = 2 / 4 of those replicas (their batches differ: the EP layer's gathers and sums carry
    unequal row counts; PP = 2 at EP = 2 on an untied MoE config too), over TP = 2 ranks with sequence parallelism
    (EP = 2: the EP group is the TP group, each rank its chunk; EP = 4: two replicas of TP = 2), in one forward or in
    chunks of 2 rows: every row's logits and log-probs are the single-process bits."""
    from megatron_consistent.layers.distributed import recompute_logprobs_parallel

    qwen3moe = MODELS_DIR / "tiny-qwen3moe-top1"  # untied: PP > 1 on the CPU
    for config, layouts in ((LLAMA, [{"dp": 2}]),
                            (QWEN2MOE, [{"dp": 2}, {"dp": 2, "ep": 2}, {"dp": 2, "ep": 2, "batch": 2}, {"dp": 4, "ep": 4},
                                        {"tp": 2, "ep": 2, "sequence_parallel": True},
                                        {"tp": 2, "dp": 2, "ep": 4, "sequence_parallel": True}]),
                            (qwen3moe, [{"dp": 2, "ep": 2, "pp": 2}])):
        weights, ids, logits, lp = reference(config, tmp_path / config.name, batch=5)
        for layout in layouts:
            where = f"{config.name} " + " ".join(f"{k}={v}" for k, v in layout.items())
            got_lp, got_logits = recompute_logprobs_parallel(config, weights, ids, return_logits=True, **layout,
                                                             workdir=tmp_path / where.replace(" ", "_"))
            assert torch.equal(got_logits, logits), f"logits differ at {where}"
            assert torch.equal(got_lp, lp), f"log-probs differ at {where}"


def _data_parallel_gradients(model, mine: torch.Tensor, tokens: int, only_experts: bool = False) -> dict:
    """Float32 gradients of ``-sum(log-probs of this replica's rows mine) / tokens`` (the DP replicas' losses sum to the
    batch mean; the TP ranks of a replica compute the same loss; at PP > 1 backpropagated stage by stage,
    ``stage_backward``), summed as Megatron's ``finalize_model_grads`` does:
    sequence-parallel weights over the TP ranks, the replicated weights over the DP (x CP) ranks, the experts
    (``allreduce=False``) over the expert-data-parallel ranks (an expert's already covers its EP group's tokens);
    gathered to the full tensors of this pipeline stage by global name (``only_experts``: the experts' alone)."""
    import torch.distributed as dist

    from megatron.core import parallel_state as ps

    from megatron_consistent.layers import tensor_parallel as tpar
    from megatron_consistent.layers.distributed import stage_backward
    from megatron_consistent.layers.parallel import global_layer_name

    stage_backward(model, mine, lambda logprobs: -logprobs.sum() / tokens)
    for p in model.parameters():
        if not getattr(p, "allreduce", True):
            dist.all_reduce(p.grad, group=ps.get_expert_data_parallel_group())
            continue
        if getattr(p, "sequence_parallel", False):  # finalize_model_grads: over the TP ranks
            dist.all_reduce(p.grad, group=tpar.tp_group())
        dist.all_reduce(p.grad, group=ps.get_data_parallel_group(with_context_parallel=True))
    return {global_layer_name(model, name): tpar.unshard_like(p.grad, p).contiguous() for name, p in model.named_parameters()
            if not only_experts or not getattr(p, "allreduce", True)}


@contextlib.contextmanager
def _experts_without_other_ranks_gradients(ep_rank: int):
    """BROKEN on purpose, inside the ``with``: the backward of ``tensor_parallel.exchange_rows`` sends the other ranks
    no gradient back, so this rank's experts miss the gradients of the other ranks' tokens (the consistent MoE layer:
    the outputs' way back; Megatron's MoELayer path: the products')."""
    from megatron_consistent.layers import tensor_parallel as tpar

    real = tpar._RowsToRanks.backward
    tpar._RowsToRanks.backward = staticmethod(lambda ctx, g: real(ctx, torch.cat(
        [block if r == ep_rank else torch.zeros_like(block) for r, block in enumerate(g.split(ctx.recv))])))
    try:
        yield
    finally:
        tpar._RowsToRanks.backward = real


def _own_rows_only(ep_rank: int):
    """BROKEN on purpose: ``tensor_parallel.exchange_rows`` whose rows from the other ranks arrive as zeros (the
    consistent MoE layer: each rank's pairs through its own experts only; Megatron's MoELayer path: the slot-0 row
    without the other ranks' products)."""

    def exchange(x, send, recv, group):
        got = x.new_zeros(sum(recv), *x.shape[1:])
        start = sum(recv[:ep_rank])
        got[start:start + recv[ep_rank]] = x[sum(send[:ep_rank]):sum(send[:ep_rank + 1])]
        return got

    return exchange


def _moe_ep2_worker(rank: int, workdir: str, tp: int) -> None:
    """EP=2 over the DP ranks (2 or 4: one or two expert-data-parallel replicas), or over the two ranks of TP = 2 with
    sequence parallelism, on the MoE config, the 5 rows split over the DP ranks by ``data_parallel_chunks`` (unequal
    shares): float32 gradients (summed as Megatron does: sequence-parallel weights over the TP ranks, the replicated
    weights over the DP ranks, the experts over the expert-data-parallel ranks; an expert's already covers its EP
    group's tokens), the experts' sharded_state_dict offsets and replica ids, a dist checkpoint, the logits with each rank's own
    expert outputs only (a broken forward) and the experts' gradients without the other ranks' tokens (a broken
    backward)."""
    import torch.distributed as dist

    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megatron_consistent.layers import tensor_parallel as tpar
    from megatron_consistent.layers.cpu_shims import cuda_stubs_for_checkpoint
    from megatron_consistent.layers.distributed import (build_parallel_model, data_parallel_chunks, gather_vocab,
                                                        stage_forward)

    work = Path(workdir)
    ids = load_file(str(work / "inputs.safetensors"))["input_ids"]
    sp = tp > 1
    cfg, weights = work / "weights" / "config.json", work / "weights"
    model32 = build_parallel_model(cfg, weights, tp=tp, ep=2, dtype=torch.float32, sequence_parallel=sp)
    [(b0, b1)] = data_parallel_chunks(ids.shape[0], ps.get_data_parallel_world_size(), None)[ps.get_data_parallel_rank()]
    mine = ids[b0:b1]
    ep_rank = ps.get_expert_model_parallel_rank()

    def gradients(only_experts=False):
        model32.zero_grad()
        return _data_parallel_gradients(model32, mine, ids[:, 1:].numel(), only_experts)

    grads = gradients()
    with _experts_without_other_ranks_gradients(ep_rank):
        broken_grads = gradients(only_experts=True)
    model = build_parallel_model(cfg, weights, tp=tp, ep=2, dtype=torch.bfloat16, sequence_parallel=sp)
    fc1 = model.decoder.layers[1].mlp.experts.linear_fc1.weight
    sharded = model.sharded_state_dict()["decoder.layers.1.mlp.experts.linear_fc1.weight"]
    meta = {"ep_rank": ep_rank, "local": list(fc1.shape), "allreduce": fc1.allreduce,
            "global_shape": list(sharded.global_shape), "global_offset": list(sharded.global_offset),
            "replica_id": list(sharded.replica_id)}
    (work / "dist").mkdir(exist_ok=True)
    dist.barrier()
    with cuda_stubs_for_checkpoint():
        dist_checkpointing.save(model.sharded_state_dict(), str(work / "dist"))
    tpar.exchange_rows = _own_rows_only(ep_rank)
    with torch.no_grad():
        broken = gather_vocab(stage_forward(model, mine)).contiguous()
    if ps.get_tensor_model_parallel_rank() == 0:
        save_file({"broken_logits": broken}, str(work / f"broken{ps.get_data_parallel_rank()}.safetensors"))
    if rank == 0:
        save_file(grads, str(work / "grads.safetensors"))
        save_file({**grads, **broken_grads}, str(work / "grads_broken.safetensors"))
    (work / f"experts{rank}.json").write_text(json.dumps(meta))


@pytest.mark.slow
@pytest.mark.parametrize("tp, world", [(1, 2), (1, 4), (2, 2)])
def test_moe_experts_over_ep_ranks_gradients_checkpoint_and_broken_sum(tmp_path, tp, world):
    """EP=2 over DP=2 or 4, or over TP=2 with sequence parallelism: each rank holds 32 of the 64 experts
    (allreduce=False, Megatron's expert mark; offsets 0 / 32 by EP rank in the sharded_state_dict, replica id = the
    expert-data-parallel rank); gradients within GRAD_REL_TOL of float64; the dist checkpoint loads at EP=1 bit for
    bit; ranks that keep only their own experts' outputs, and experts' gradients without the other ranks' tokens, are
    caught."""
    from megatron_consistent.checkpoint import _load_dist_staged
    from megatron_consistent.config import ArchConfig
    from megatron_consistent.layers import build_consistent_model
    from megatron_consistent.layers.distributed import megatron_state_from_hf, read_hf_tensors, spawn_ranks
    from megatron_consistent.verify.reference import GRAD_REL_TOL

    weights, ids, logits, _ = reference(QWEN2MOE, tmp_path, batch=5)
    save_file({"input_ids": ids}, str(tmp_path / "inputs.safetensors"))
    spawn_ranks(_moe_ep2_worker, world, tmp_path, tp)
    dp = world // tp
    broken = torch.cat([load_file(str(tmp_path / f"broken{d}.safetensors"))["broken_logits"] for d in range(dp)])
    assert not torch.equal(broken, logits), "expert outputs kept on the computing rank were not caught"
    errs = _gradient_errors(tmp_path / "grads.safetensors", weights, ids)
    print(f"EP=2 TP={tp} DP={dp} MoE gradients: max relative error vs float64 {max(errs.values()):.3g} "
          f"({max(errs, key=errs.get)})")
    assert max(errs.values()) < GRAD_REL_TOL, errs
    broken_errs = _gradient_errors(tmp_path / "grads_broken.safetensors", weights, ids)
    print(f"EP=2 TP={tp} DP={dp}, the other ranks' tokens left out of the experts' gradients: max relative error "
          f"{max(broken_errs.values()):.3g}")
    assert max(broken_errs.values()) > 1e3 * GRAD_REL_TOL, "experts' gradients missing the other ranks' tokens not caught"
    for rank in range(world):
        meta = json.loads((tmp_path / f"experts{rank}.json").read_text())
        assert meta["local"][0] == 32 and meta["allreduce"] is False, meta
        # global shape [layers, E, 2I, H] (the decoder's layer axis first): EP rank e holds experts 32 e .. 32 e + 31
        assert meta["global_shape"][1] == 64 and meta["global_offset"][1] == 32 * meta["ep_rank"], meta
    replicas = sorted((m["ep_rank"], m["replica_id"][-1]) for m in
                      (json.loads((tmp_path / f"experts{r}.json").read_text()) for r in range(world)))
    assert replicas == sorted((e, d) for e in range(2) for d in range(world // 2)), replicas  # one replica 0 a shard
    loaded = _load_dist_staged(build_consistent_model(QWEN2MOE, seed=1, moe_impl="module"), tmp_path / "dist")
    want = megatron_state_from_hf(ArchConfig.from_hf(load_hf_config(QWEN2MOE)), read_hf_tensors(weights))
    for name, tensor in want.items():
        assert torch.equal(loaded[name], tensor), name


def _export_worker(rank: int, workdir: str, config: str, tp: int, pp: int, ep: int) -> None:
    from megatron_consistent.layers.distributed import build_parallel_model, export_hf_parallel

    work = Path(workdir)
    model = build_parallel_model(config, work / "weights", tp=tp, pp=pp, ep=ep, sequence_parallel=tp > 1 and ep > 1)
    export_hf_parallel(model, work / "export")


@pytest.mark.slow
@pytest.mark.parametrize("config, tp, pp, dp, ep", [(LLAMA, 2, 2, 1, 1), (QWEN2MOE, 2, 1, 1, 1), (QWEN2MOE, 1, 1, 2, 2),
                                                    (QWEN2MOE, 2, 1, 2, 4), (MODELS_DIR / "tiny-qwen3moe-top1", 1, 2, 2, 2),
                                                    (MODELS_DIR / "tiny-nemotronh", 2, 2, 1, 1)])
def test_export_from_a_parallel_layout_is_the_one_process_checkpoint(tmp_path, config, tp, pp, dp, ep):
    """A model loaded at TP / PP / DP / EP (EP at TP 2 with sequence parallelism) and exported by every rank (TP and EP
    pieces gathered, one file a pipeline stage and an index at PP > 1) is the one-process HF checkpoint tensor for
    tensor, bit for bit, and imports back; a second export into the same folder is refused by every rank before any
    collective."""
    from torch.multiprocessing import ProcessRaisedException

    from megatron_consistent.config import ArchConfig
    from megatron_consistent.conversion import import_hf
    from megatron_consistent.layers import build_consistent_model
    from megatron_consistent.layers.distributed import read_hf_tensors, spawn_ranks

    weights, *_ = reference(config, tmp_path)
    spawn_ranks(_export_worker, tp * pp * dp, tmp_path, str(config), tp, pp, ep)
    want, got = read_hf_tensors(weights), read_hf_tensors(tmp_path / "export")
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert tensor.dtype == got[name].dtype and torch.equal(tensor, got[name]), name
    assert (tmp_path / "export" / "model.safetensors.index.json").exists() == (pp > 1)
    assert ArchConfig.from_hf(load_hf_config(tmp_path / "export")) == ArchConfig.from_hf(load_hf_config(weights))
    model = build_consistent_model(config, seed=1, moe_impl="module" if ep > 1 or tp > 1 else None)
    import_hf(model, model.arch_config, tmp_path / "export")  # the exported folder as a checkpoint: complete, loadable
    with pytest.raises(ProcessRaisedException, match="already holds"):
        spawn_ranks(_export_worker, tp * pp * dp, tmp_path, str(config), tp, pp, ep)


# ---------------------------------------------------------------------------------------------- experts over TP ranks
def _moe_tp2_worker(rank: int, workdir: str) -> None:
    """TP=2 on the MoE config, experts sharded over the two ranks: float32 gradients without and with sequence
    parallelism, the experts' sharded_state_dict offsets, a dist checkpoint, and the logits with the ranks' expert
    outputs left unsummed (the broken variant)."""
    import torch.distributed as dist

    from megatron.core import dist_checkpointing

    from megatron_consistent.layers import tensor_parallel as tpar
    from megatron_consistent.layers.cpu_shims import cuda_stubs_for_checkpoint
    from megatron_consistent.layers.distributed import build_parallel_model, stage_forward, stage_logprobs

    work = Path(workdir)
    ids = load_file(str(work / "inputs.safetensors"))["input_ids"]
    cfg, weights = work / "weights" / "config.json", work / "weights"
    grads = {}
    for sp in (False, True):
        model32 = build_parallel_model(cfg, weights, tp=2, dtype=torch.float32, sequence_parallel=sp)
        (-stage_logprobs(model32, ids).mean()).backward()
        for p in model32.parameters():  # what Megatron's finalize_model_grads does for sequence-parallel parameters
            if sp and getattr(p, "sequence_parallel", False):
                dist.all_reduce(p.grad, group=tpar.tp_group())
        grads[sp] = {name: tpar.unshard_like(p.grad, p).contiguous() for name, p in model32.named_parameters()}
    model = build_parallel_model(cfg, weights, tp=2, dtype=torch.bfloat16)
    fc1 = model.decoder.layers[1].mlp.experts.linear_fc1.weight
    sharded = model.sharded_state_dict()["decoder.layers.1.mlp.experts.linear_fc1.weight"]
    meta = {"local": list(fc1.shape), "global_shape": list(sharded.global_shape),
            "global_offset": list(sharded.global_offset)}
    (work / "dist").mkdir(exist_ok=True)
    dist.barrier()
    with cuda_stubs_for_checkpoint():
        dist_checkpointing.save(model.sharded_state_dict(), str(work / "dist"))
    tpar.sum_owned_slots = lambda y, group, sequence_parallel=False: y  # broken: each rank's own experts only
    with torch.no_grad():
        broken = stage_forward(model, ids).contiguous()
    if rank == 0:
        save_file({"broken_logits": broken}, str(work / "out.safetensors"))
        save_file(grads[False], str(work / "grads.safetensors"))
        save_file(grads[True], str(work / "grads_sp.safetensors"))
    (work / f"experts{rank}.json").write_text(json.dumps(meta))


@pytest.mark.slow
def test_moe_experts_over_tp_ranks_gradients_checkpoint_and_broken_sum(tmp_path):
    """TP=2 shards the 64 experts (32 a rank, expert offsets 0 / 32 in the sharded_state_dict); the logits are TP=1's
    (test_logits_and_logprobs_equal_across_tp_pp_moe and the check), the gradients with and without sequence
    parallelism within GRAD_REL_TOL of float64, the TP=2 dist checkpoint loads at TP=1 bit for bit, and ranks that
    skip the sum of their expert outputs are caught (logits differ)."""
    from megatron_consistent.checkpoint import _load_dist_staged
    from megatron_consistent.config import ArchConfig
    from megatron_consistent.layers import build_consistent_model
    from megatron_consistent.layers.distributed import megatron_state_from_hf, read_hf_tensors, spawn_ranks
    from megatron_consistent.verify.reference import GRAD_REL_TOL

    weights, ids, logits, _ = reference(QWEN2MOE, tmp_path)
    save_file({"input_ids": ids}, str(tmp_path / "inputs.safetensors"))
    spawn_ranks(_moe_tp2_worker, 2, tmp_path)
    broken = load_file(str(tmp_path / "out.safetensors"))["broken_logits"]
    assert not torch.equal(broken, logits[..., : logits.shape[-1] // 2]), "unsummed expert outputs were not caught"
    for name in ("grads.safetensors", "grads_sp.safetensors"):
        errs = _gradient_errors(tmp_path / name, weights, ids)
        print(f"TP=2 MoE {name}: max relative error vs float64 {max(errs.values()):.3g} ({max(errs, key=errs.get)})")
        assert max(errs.values()) < GRAD_REL_TOL, errs
    for rank in (0, 1):
        meta = json.loads((tmp_path / f"experts{rank}.json").read_text())
        # global shape [layers, E, 2I, H] (the decoder's layer axis first): rank r holds experts 32 r .. 32 r + 31
        assert meta["local"][0] == 32 and meta["global_shape"][1] == 64 and meta["global_offset"][1] == 32 * rank, meta
    loaded = _load_dist_staged(build_consistent_model(QWEN2MOE, seed=1, moe_impl="module"), tmp_path / "dist")
    want = megatron_state_from_hf(ArchConfig.from_hf(load_hf_config(QWEN2MOE)), read_hf_tensors(weights))
    for name, tensor in want.items():
        assert torch.equal(loaded[name], tensor), name


# ---------------------------------------------------------------------------------------------- Megatron's MoELayer at EP > 1
def _gloo_moe_dispatch_collectives() -> None:
    """TEST-ONLY shim (CPU gloo ranks): Megatron's ``tensor_parallel.mappings._gather_along_first_dim`` /
    ``_reduce_scatter_along_first_dim`` -- the all-gather / reduce-scatter of its allgather token dispatcher, forward and
    backward -- allocate on ``torch.cuda.current_device()``; here they are the package's row exchanges over the same
    group (``tensor_parallel.gather_rows``: concatenation in rank order; a reduce-scatter: each rank's blocks from
    the ranks by ``exchange_rows``, summed).  The forward's reduce-scatter adds, per element, one value and zeros (the
    consistent experts' combine), so it is exact in any order; the backward's sums are gradients (float64-reference
    bound)."""
    import megatron.core.tensor_parallel.mappings as mappings

    from megatron_consistent.layers.tensor_parallel import _exchange_rows, gather_rows

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        e = group.size()
        return input_ if e == 1 else gather_rows(input_, list(output_split_sizes or [input_.shape[0]] * e), group)

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        e = group.size()
        if e == 1:
            return input_
        counts = list(input_split_sizes or [input_.shape[0] // e] * e)
        mine = counts[group.rank()]
        return _exchange_rows(input_, counts, [mine] * e, group).view(e, mine, *input_.shape[1:]).sum(0)

    mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim = gather, reduce_scatter


def _megatron_moe_ep_worker(rank: int, workdir: str, config: str, tp: int, ep: int, dispatcher: str) -> None:
    """TP (with sequence parallelism at TP > 1) x DP ranks, the experts over EP of them (DP = EP at TP = 1: the
    replicas; TP = 2, EP = 2: the TP group itself), each replica its own rows, the model built through the entry point
    with Megatron's MoELayer and its ``dispatcher`` (alltoall: its CUDA calls TEST-ONLY stubbed,
    ``_cuda_on_cpu.alltoall_dispatcher_stubs``): the logits (bf16, gathered over the vocabulary), a dist
    checkpoint and the experts' sharded offsets, float32 gradients summed as Megatron does; then, at EP > 1, three
    broken variants -- the experts' gradients without the other ranks' tokens, the slot-0 row left without the other
    ranks' products (the owners' sum skipped), the layout derived from this rank's routes alone (the verification must
    raise) (FP8 at EP > 1: tests/test_fp8_ep.py)."""
    from _cuda_on_cpu import alltoall_dispatcher_stubs

    from megatron_consistent.layers import apply_cpu_shims, as_arch_config, init_cpu_process_group

    stubs = alltoall_dispatcher_stubs if dispatcher == "alltoall" else lambda claim_cuda=False: contextlib.nullcontext()
    init_cpu_process_group(tp, 1, expert_model_parallel_size=ep, sequence_parallel=tp > 1)  # both before claiming CUDA
    apply_cpu_shims()
    with stubs():
        _megatron_moe_ep_job(rank, Path(workdir), as_arch_config(config), tp, ep, dispatcher, stubs)


def _megatron_moe_ep_job(rank: int, work: Path, arch, tp: int, ep: int, dispatcher: str, stubs) -> None:
    """:func:`_megatron_moe_ep_worker`'s job (inside the dispatcher's stubs)."""
    import torch.distributed as dist

    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megatron_consistent.layers import tensor_parallel as tpar
    from megatron_consistent.layers.cpu_shims import cuda_stubs_for_checkpoint
    from megatron_consistent.layers.distributed import gather_vocab, stage_forward

    ids = load_file(str(work / "inputs.safetensors"))["input_ids"]
    _gloo_moe_dispatch_collectives()
    with stubs(claim_cuda=True):  # the product refuses 'alltoall' without CUDA
        model = _entry_point_model(arch, work / "weights", tp=tp, sp=tp > 1, ep=ep, dispatcher=dispatcher)
        model32 = _entry_point_model(arch, work / "weights", tp=tp, sp=tp > 1, ep=ep, dtype=torch.float32,
                                     dispatcher=dispatcher)
    replica, ep_rank = ps.get_data_parallel_rank(), ps.get_expert_model_parallel_rank()
    n = ids.shape[0] // ps.get_data_parallel_world_size()
    mine = ids[replica * n:(replica + 1) * n]

    def logits():
        with torch.no_grad():
            return gather_vocab(stage_forward(model, mine)).contiguous()

    out = {"logits": logits()}
    moe_layer = next(i for i in range(arch.num_layers) if arch.layer_is_moe(i))
    key = f"decoder.layers.{moe_layer}.mlp.experts.linear_fc1.weight"
    fc1, sharded = model.get_parameter(key), model.sharded_state_dict()[key]
    meta = {"ep_rank": ep_rank, "local": list(fc1.shape), "allreduce": fc1.allreduce,
            "global_shape": list(sharded.global_shape), "global_offset": list(sharded.global_offset)}
    (work / "dist").mkdir(exist_ok=True)
    dist.barrier()
    with cuda_stubs_for_checkpoint():
        dist_checkpointing.save(model.sharded_state_dict(), str(work / "dist"))

    grads = _data_parallel_gradients(model32, mine, ids[:, 1:].numel())
    if rank == 0:
        save_file(grads, str(work / "grads.safetensors"))
    if ep > 1:
        model32.zero_grad()
        with _experts_without_other_ranks_gradients(ep_rank):
            broken_grads = _data_parallel_gradients(model32, mine, ids[:, 1:].numel(), only_experts=True)
        if rank == 0:
            save_file({**grads, **broken_grads}, str(work / "grads_broken.safetensors"))
        real_exchange, real_gather = tpar.exchange_rows, tpar.gather_rows
        tpar.exchange_rows = _own_rows_only(ep_rank)
        out["broken_logits"] = logits()
        tpar.exchange_rows = real_exchange
        tpar.gather_rows = lambda x, counts, group: x  # broken: this rank's routes and tokens taken for the EP group's
        try:
            logits()
        except RuntimeError as err:
            meta["layout_error"] = str(err)
        tpar.gather_rows = real_gather
    if ps.get_tensor_model_parallel_rank() == 0:
        save_file(out, str(work / f"out{replica}.safetensors"))
    (work / f"experts{rank}.json").write_text(json.dumps(meta))


@pytest.mark.slow
@pytest.mark.parametrize("config, tp, ep, world, dispatcher", [
    (QWEN2MOE, 1, 2, 2, "allgather"), (MODELS_DIR / "tiny-qwen3moe-top1", 1, 2, 2, "allgather"),
    (QWEN2MOE, 1, 4, 4, "allgather"), (QWEN2MOE, 2, 2, 2, "allgather"), (QWEN2MOE, 2, 4, 4, "allgather"),
    (QWEN2MOE, 2, 1, 2, "allgather"), (QWEN2MOE, 1, 2, 2, "alltoall"), (QWEN2MOE, 2, 4, 4, "alltoall")],
    ids=["qwen2moe-dp2-ep2", "qwen3moe-top1-dp2-ep2", "qwen2moe-dp4-ep4", "qwen2moe-tp2sp-ep2", "qwen2moe-tp2sp-dp2-ep4",
         "qwen2moe-tp2sp-ep1", "qwen2moe-dp2-ep2-alltoall", "qwen2moe-tp2sp-dp2-ep4-alltoall"])
def test_entry_point_megatron_moelayer_at_ep_bits_gradients_checkpoint_and_broken_combine(tmp_path, config, tp, ep,
                                                                                        world, dispatcher):
    """Megatron's own MoELayer built through ``consistent_layer_spec_provider`` at EP = ``ep`` over DP replicas, or
    over TP = 2 ranks with sequence parallelism, with the allgather or the alltoall dispatcher (TEST-ONLY on the CPU:
    the allgather's all-gather / reduce-scatter through :func:`_gloo_moe_dispatch_collectives`, the alltoall's CUDA
    streams and allocation through ``_cuda_on_cpu.alltoall_dispatcher_stubs``), each replica its own rows: the logits are the
    one-process ``build_consistent_model``'s bit for bit; float32 gradients (every expert's included) within
    GRAD_REL_TOL of float64; each rank holds its E/ep experts (``allreduce=False``, offset ``ep_rank E/ep`` in the
    sharded_state_dict) and the dist checkpoint loads at EP = TP = 1 bit for bit.  At EP > 1: the slot-0 row left
    without the other ranks' products changes the logits and experts' gradients without the other ranks' tokens are
    caught (top-k > 1; at top-1 no product moves, and neither changes anything), a layout not the EP group's is
    refused."""
    from megatron_consistent.checkpoint import _load_dist_staged
    from megatron_consistent.config import ArchConfig
    from megatron_consistent.layers.distributed import megatron_state_from_hf, read_hf_tensors, spawn_ranks
    from megatron_consistent.verify.reference import GRAD_REL_TOL

    dp = world // tp
    weights, ids, logits, _ = reference(config, tmp_path, batch=max(2, dp))
    save_file({"input_ids": ids}, str(tmp_path / "inputs.safetensors"))
    spawn_ranks(_megatron_moe_ep_worker, world, tmp_path, str(config), tp, ep, dispatcher)
    outs = [load_file(str(tmp_path / f"out{d}.safetensors")) for d in range(dp)]
    assert torch.equal(torch.cat([o["logits"] for o in outs]), logits)
    arch = ArchConfig.from_hf(load_hf_config(config))
    errs = _gradient_errors(tmp_path / "grads.safetensors", weights, ids)
    print(f"{config.name} Megatron MoELayer TP={tp} DP={dp} EP={ep}: max relative gradient error vs float64 "
          f"{max(errs.values()):.3g} ({max(errs, key=errs.get)})")
    assert max(errs.values()) < GRAD_REL_TOL, errs
    per = arch.num_experts // ep
    for rank in range(world):
        meta = json.loads((tmp_path / f"experts{rank}.json").read_text())
        assert meta["local"][0] == per and meta["allreduce"] is False, meta
        # per-layer keys (moe_layer_freq a list: Megatron's non-homogeneous layers): [E, 2I, H], offset per * ep_rank
        assert meta["global_shape"][0] == arch.num_experts and meta["global_offset"][0] == per * meta["ep_rank"], meta
        assert ("expert-major, token-ascending" in meta.get("layout_error", "")) == (ep > 1), meta
    # the checkpoint into the same framework's model at TP = EP = 1 (fresh buffers: the model's own weights untouched)
    loaded = _load_dist_staged(_entry_point_model(arch, weights), tmp_path / "dist")
    want = megatron_state_from_hf(arch, read_hf_tensors(weights))
    for name, tensor in want.items():
        assert torch.equal(loaded[name], tensor), name
    if ep > 1:
        moved = arch.num_experts_per_tok > 1  # top-1: a token's one product is formed on its owner, nothing moves
        broken = torch.cat([o["broken_logits"] for o in outs])
        assert moved == (not torch.equal(broken, logits)), "the slot-0 row without the other ranks' products"
        broken_errs = _gradient_errors(tmp_path / "grads_broken.safetensors", weights, ids)
        print(f"  the other ranks' tokens left out of the experts' gradients: max relative error "
              f"{max(broken_errs.values()):.3g}")
        assert moved == (max(broken_errs.values()) > 1e3 * GRAD_REL_TOL), "experts' gradients without the other ranks' tokens"


@pytest.mark.parametrize("fields, words", [
    ({"tensor_model_parallel_size": 2}, "tensor parallelism without sequence parallelism (tensor_model_parallel_size=2"),
    ({"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2},
     "expert parallelism at TP > 1 without sequence parallelism"),
    ({"expert_model_parallel_size": 3}, "expert_model_parallel_size=3 with num_moe_experts=64"),
    ({"expert_model_parallel_size": 2, "expert_tensor_parallel_size": 2}, "expert tensor parallelism"),
])
def test_entry_point_megatron_moelayer_refusals_by_name(fields, words):
    """What the entry point's Megatron MoELayer does not implement at EP > 1 is refused in one line by the spec call,
    before any module is built (no process group needed)."""
    from megatron_consistent.layers import as_arch_config, make_transformer_config
    from megatron_consistent.layers.entry_points import consistent_layer_spec_provider
    from megatron_consistent.layers.moe_megatron import megatron_moe_config_kwargs

    arch = as_arch_config(QWEN2MOE)
    config = make_transformer_config(arch, arch.torch_dtype, consistent=False, **megatron_moe_config_kwargs(arch))
    for name, value in fields.items():
        setattr(config, name, value)
    with pytest.raises(UnsupportedConfigError, match=re.escape(words)):
        consistent_layer_spec_provider(config)

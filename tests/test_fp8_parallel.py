"""The FP8 / NVFP4 trainer forward (``layers.fp8.enable_fp8`` on the loaded masters) at pipeline, data and context
parallelism (docs/fp8.md, "Pipeline, data and context parallelism").

* refusals by name, before any work: FP8 at EP > 1 (``enable_fp8``, ``recompute_logprobs_parallel``, ``check``); PP 2,
  DP 2 and CP 2 accepted by ``check``;
* gloo ranks (slow): block-FP8 logits and log-probs at PP 2, DP 2, CP 2 (tiny-llama), TP 2 x PP 2 and TP 2 x CP 2
  (tiny-llama-fp8tp), PP 2 x DP 2 (tiny-qwen3moe-top1: FP8 experts) and CP 2 (tiny-qwen2moe-fp8tp: FP8 experts and
  shared expert), NVFP4 at PP 2, CP 2 and DP 2 (tiny-llama), ``torch.equal`` to the one-process FP8 / NVFP4 forward;
  broken
  variants caught: the last pipeline stage looking its layers up at the wrong global numbers (it quantizes none of
  them), and activations quantized in groups over all of a call's tokens (a CP / DP rank's group grid then depends on
  the rows it holds: it differs from the one-process forward, which has the same bug, too).
"""

from __future__ import annotations

import re
import time

import pytest
import torch
from _parallel_layouts import reference
from safetensors.torch import load_file
from test_context_parallel import LLAMA, QWEN3MOE, SEQ
from test_fp8_tp import FP8TP, MOETP

from megatron_consistent import kernels
from megatron_consistent.kernels.fp8 import E4M3_ACT_1x128, E4M3_WEIGHT_128, NVFP4_WEIGHT

FP8 = (E4M3_WEIGHT_128, E4M3_ACT_1x128)
NVFP4 = (NVFP4_WEIGHT, None)


# ---------------------------------------------------------------------------------------------- check layouts
@pytest.mark.parametrize("config, quantization, layout", [
    (LLAMA, "fp8", {"trainer_pp": 2}), (LLAMA, "fp8", {"trainer_dp": 2}), (LLAMA, "fp8", {"trainer_cp": 2}),
    (LLAMA, "nvfp4", {"trainer_pp": 2}), (FP8TP, "fp8", {"trainer_tp": 2, "trainer_pp": 2}),
    (QWEN3MOE, "fp8", {"trainer_pp": 2, "trainer_dp": 2}), (QWEN3MOE, "fp8", {"trainer_dp": 2, "trainer_ep": 2}),
    (FP8TP, "fp8", {"trainer_tp": 2, "trainer_cp": 2}), (MOETP, "fp8", {"trainer_cp": 2}), (LLAMA, "nvfp4", {"trainer_cp": 2}),
    (LLAMA, "nvfp4", {"trainer_dp": 2})])
def test_check_accepts_fp8_at_pipeline_data_context_and_expert_parallelism(tmp_path, config, quantization, layout):
    from megatron_consistent.verify.check import check_layouts, load_check_config

    cfg = load_check_config(device="cpu", out_dir=str(tmp_path), quantization=quantization, **layout)
    assert "FP8 forward (layers.fp8.enable_fp8)" in check_layouts(cfg, _arch(config))["trainer"]["ranks"]


@pytest.mark.parametrize("quantization, name, scales", [("fp8", "block-FP8", "weight_scale_inv"),
                                                        ("nvfp4", "NVFP4", "weight_scale_2")])
def test_check_report_names_the_quantization_of_its_tp_split(tmp_path, quantization, name, scales):
    """The layout report at TP 2 says which format each rank splits (an NVFP4 run said block-FP8 / weight_scale_inv)."""
    from megatron_consistent.verify.check import check_layouts, load_check_config

    cfg = load_check_config(device="cpu", out_dir=str(tmp_path), quantization=quantization, trainer_tp=2, engine_tp=2)
    report = check_layouts(cfg, _arch(FP8TP))
    assert report["engine"]["fp8"].startswith(f"{name} at TP > 1") and scales in report["engine"]["fp8"]
    assert report["trainer"]["fp8"].startswith(f"{name} at TP > 1")


def _arch(config):
    from megatron_consistent.config import ArchConfig, load_hf_config

    return ArchConfig.from_hf(load_hf_config(config))


# ---------------------------------------------------------------------------------------------- gloo ranks
def _wrong_stage_layers(model, name: str) -> str:
    """Broken ``global_layer_name``: a stage's layers offset by the model's layer count per stage (not by the stage's):
    the last stage looks its layers up at numbers the model lacks, so it would quantize none of them -- ``enable_fp8``
    refuses it by name (the table's modules of a held layer not found)."""
    from megatron.core import parallel_state as ps

    parts = name.split(".")
    if len(parts) > 3 and parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + ps.get_pipeline_model_parallel_rank() * model.arch_config.num_layers)
    return ".".join(parts)


def _call_wide_groups(x2d, w_q, w_row_scales, w_fmt, a_fmt):
    """Broken activation quantizer: one scale per 128 columns over all of the call's tokens (not per token), so the
    group grid depends on which rows a rank holds."""
    from megatron_consistent.kernels import fp8

    wide = fp8.QuantFormat(a_fmt.name, (x2d.shape[0], a_fmt.block[1]), a_fmt.scale_format)
    xq, xs = fp8.quantize(x2d, wide)
    return fp8.dequantize(xq, xs, wide), fp8.dequantize_rows(w_q, w_row_scales, w_fmt)


def _broken_worker(rank: int, workdir: str, tp: int, pp: int, cp: int, breakage: str) -> None:
    """``layers.distributed``'s recompute worker (on the job files a run left in ``workdir``) with one piece broken."""
    from megatron_consistent.kernels import fp8 as kfp8
    from megatron_consistent.layers import distributed
    from megatron_consistent.layers import fp8 as lfp8

    if breakage == "stage_layers":
        lfp8.global_layer_name = _wrong_stage_layers
    else:
        kfp8._dequantized_operands = _call_wide_groups
    distributed._recompute_worker(rank, workdir, tp, pp, 1, cp)


CASES = {  # name: (config, formats, layout)
    "fp8-pp2": (LLAMA, FP8, {"pp": 2}), "fp8-dp2": (LLAMA, FP8, {"dp": 2}), "fp8-cp2": (LLAMA, FP8, {"cp": 2}),
    "nvfp4-pp2": (LLAMA, NVFP4, {"pp": 2}), "fp8tp-tp2-pp2": (FP8TP, FP8, {"tp": 2, "pp": 2}),
    "fp8-moe-pp2-dp2": (QWEN3MOE, FP8, {"pp": 2, "dp": 2}),  # FP8 experts (TP = EP = 1), one MoE layer a stage
    "fp8tp-tp2-cp2": (FP8TP, FP8, {"tp": 2, "cp": 2}), "fp8-moe-cp2": (MOETP, FP8, {"cp": 2}),  # FP8 experts + shared
    "nvfp4-cp2": (LLAMA, NVFP4, {"cp": 2}), "nvfp4-dp2": (LLAMA, NVFP4, {"dp": 2}),
}
BROKEN = {"fp8-pp2": "stage_layers", "fp8-cp2": "wide_groups", "fp8-dp2": "wide_groups"}


@pytest.fixture(scope="module")
def fp8_parallel_runs(tmp_path_factory):
    """Every case's one-process reference (``_parallel_layouts.reference`` with the FP8 / NVFP4 forward bound: 2
    sequences of 16 tokens, bf16 masters), its gloo-rank run, and the broken variants re-run on the same job files."""
    from megatron_consistent.layers.distributed import recompute_logprobs_parallel, spawn_ranks
    from megatron_consistent.layers.fp8 import enable_fp8

    tmp = tmp_path_factory.mktemp("fp8par")
    refs, runs, broken, secs = {}, {}, {}, {}
    for name, (config, formats, layout) in CASES.items():
        key = (config, formats)
        if key not in refs:
            refs[key] = reference(config, tmp / f"ref-{len(refs)}", seq=SEQ, prepare=lambda m, f=formats: enable_fp8(m, *f))
        weights, ids, _, _ = refs[key]
        work = tmp / name
        t0 = time.perf_counter()
        runs[name] = recompute_logprobs_parallel(config, weights, ids, return_logits=True, quantization=formats,
                                                 workdir=work, **layout)
        secs[name] = time.perf_counter() - t0
        if name in BROKEN:
            sizes = {"tp": 1, "pp": 1, "dp": 1, "cp": 1, **layout}
            try:
                spawn_ranks(_broken_worker, sizes["tp"] * sizes["pp"] * sizes["dp"] * sizes["cp"], work, sizes["tp"],
                            sizes["pp"], sizes["cp"], BROKEN[name])
            except Exception as e:  # a rank refused the broken layout (torch.multiprocessing's ProcessRaisedException)
                broken[name] = str(e)
                continue
            broken[name] = torch.cat([load_file(str(work / f"out.dp{d}.safetensors"))["logits"] for d in range(sizes["dp"])])
    print("fp8 parallel seconds:", {k: round(v, 1) for k, v in secs.items()})
    return {"refs": refs, "runs": runs, "broken": broken}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_fp8_parallel_logits_and_logprobs_equal_one_process(fp8_parallel_runs, name):
    config, formats, _ = CASES[name]
    _, ids, logits, lp = fp8_parallel_runs["refs"][config, formats]
    got_lp, got_logits = fp8_parallel_runs["runs"][name]
    assert torch.equal(got_logits, logits), f"logits differ at {name}"
    assert torch.equal(got_lp, lp), f"log-probs differ at {name}"


@pytest.mark.slow
def test_fp8_is_not_the_model_dtype_nor_nvfp4(fp8_parallel_runs, tmp_path):
    """The references are quantized forwards: FP8, NVFP4 and bf16 give three different sets of logits."""
    refs = fp8_parallel_runs["refs"]
    bf16 = reference(LLAMA, tmp_path, seq=SEQ)[2]
    assert not torch.equal(refs[LLAMA, FP8][2], bf16) and not torch.equal(refs[LLAMA, NVFP4][2], bf16)
    assert not torch.equal(refs[LLAMA, FP8][2], refs[LLAMA, NVFP4][2])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BROKEN))
def test_fp8_parallel_broken_variants_caught(fp8_parallel_runs, name, monkeypatch):
    """The broken run is refused (a stage's layers looked up at the wrong numbers) or differs from the one-process
    forward; for the call-wide activation groups also from the one-process forward with the same bug (the grid moved
    with the rows the rank holds)."""
    from megatron_consistent.kernels import fp8 as kfp8
    from megatron_consistent.layers import build_consistent_model
    from megatron_consistent.layers.distributed import load_full_megatron_state, megatron_state_from_hf, read_hf_tensors
    from megatron_consistent.layers.fp8 import enable_fp8

    weights, ids, logits, _ = fp8_parallel_runs["refs"][LLAMA, FP8]
    got = fp8_parallel_runs["broken"][name]
    if BROKEN[name] == "stage_layers":  # refused by name before the forward (it would have run the stage in bf16)
        assert re.search(r"FP8: the weight table's decoder\.layers\.\d+\.\S+ is not a module of the model", got), got
        return
    assert not torch.equal(got, logits), f"{name}: {BROKEN[name]} not caught"
    if BROKEN[name] == "wide_groups":
        model = build_consistent_model(LLAMA, dtype=torch.bfloat16)
        load_full_megatron_state(model, megatron_state_from_hf(model.arch_config, read_hf_tensors(weights)))
        enable_fp8(model)
        monkeypatch.setattr(kfp8, "_dequantized_operands", _call_wide_groups)
        with torch.no_grad():
            same_bug = model(ids, kernels.causal_positions(*ids.shape), None).float()
        assert not torch.equal(same_bug, logits) and not torch.equal(got, same_bug)

"""Block-FP8 (issue #9): quantizer properties, batch-invariant FP8 linear, trainer forward == export, end to end check.

Zero means zero: every comparison of the consistent path is ``torch.equal``
(bit for bit; fp8 tensors compared through their uint8 bit patterns).
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from megatron_consistent.config import UnsupportedConfigError
from megatron_consistent.conversion.fp8 import QUANT_KEY, export_hf_fp8, quantized_parts
from megatron_consistent.conversion.hf import _join, _plan
from megatron_consistent.kernels.fp8 import (
    E4M3_ACT_1x128, E4M3_MAX, E4M3_WEIGHT_128, QuantFormat, block_amax, compute_scales, constant_row_block, dequantize,
    dequantize_rows, fp8_linear, fp8_linear_ste, quantize, row_block_of_parts, weight_row_scales)
from megatron_consistent.layers import build_consistent_gpt_model, compute_token_logprobs
from megatron_consistent.layers.fp8 import enable_fp8
from megatron_consistent.verify import check as check_module
from megatron_consistent.verify.check import builtin_model_dir, cpu_fp8_kv_cache_supported, load_check_config, run_check

POW2_W = QuantFormat("e4m3", (128, 128), "pow2")
POW2_A = QuantFormat("e4m3", (1, 128), "pow2")


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def _rand(*shape, dtype=torch.bfloat16, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


# ------------------------------------------------------------------------------------------- quantizer
@pytest.mark.parametrize("fmt", [E4M3_WEIGHT_128, POW2_W], ids=["fp32", "pow2"])
def test_quantize_documented_order_of_operations(fmt):
    """q == cast_e4m3(clamp(float32(x) / scale, -448, 448)), scale from the exact block amax."""
    x = _rand(200, 300, scale=3.0)
    q, s = quantize(x, fmt)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (2, 3)
    for bi in range(2):
        for bj in range(3):
            blk = x[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128].float()
            amax = blk.abs().max()
            want_s = amax / 448.0
            if fmt.scale_format == "pow2":
                want_s = torch.tensor(2.0) ** torch.ceil(torch.log2(want_s.double())).float()
            assert torch.equal(s[bi, bj], want_s)
            want_q = (blk / want_s).clamp(-448, 448).to(torch.float8_e4m3fn)
            assert torch.equal(_bits(q[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128]), _bits(want_q))


def test_zero_block_gets_unit_scale_and_pow2_is_exact():
    x = torch.zeros(256, 128, dtype=torch.bfloat16)
    x[128:] = _rand(128, 128)
    q, s = quantize(x, POW2_W)
    assert s[0, 0] == 1.0 and not _bits(q[:128]).any()
    m, _ = torch.frexp(s)
    assert torch.all(m == 0.5)  # powers of two
    # pow2: dequantization is exact, so quantize(dequantize(.)) gives back the same dequantized values
    dq = dequantize(q, s, POW2_W)
    q2, s2 = quantize(dq, POW2_W)
    assert torch.equal(dequantize(q2, s2, POW2_W), dq)


@given(rows=st.integers(1, 300), cols=st.integers(1, 300), mag=st.sampled_from([1e-3, 1.0, 100.0]), seed=st.integers(0, 2**16),
       pow2=st.booleans())
@settings(max_examples=15)
def test_round_trip_error_bound_and_symmetry(rows, cols, mag, seed, pow2):
    """|x - dq(q(x))| <= 2^-4 |x| + scale * 2^-10 (e4m3: 3 mantissa bits, RNE; subnormal step 2^-9); q(-x) == -q(x)."""
    fmt = POW2_W if pow2 else E4M3_WEIGHT_128
    x = _rand(rows, cols, dtype=torch.float32, seed=seed, scale=mag)
    q, s = quantize(x, fmt)
    assert q.float().abs().max() <= E4M3_MAX
    dq = dequantize(q, s, fmt)
    per_elem_scale = weight_row_scales(s, rows, fmt).repeat_interleave(128, dim=1)[:, :cols]
    err = (x - dq).abs()
    bound = x.abs() * 2.0**-4 * (1 + 2.0**-20) + per_elem_scale * 2.0**-10
    assert torch.all(err <= bound)
    qn, sn = quantize(-x, fmt)
    assert torch.equal(sn, s) and torch.equal(qn.float(), -q.float())
    assert torch.equal(dequantize_rows(q, weight_row_scales(s, rows, fmt), fmt), dq)


def test_activation_scales_are_per_token_groups():
    x = _rand(3, 5, 300)
    q, s = quantize(x, E4M3_ACT_1x128)
    assert q.shape == x.shape and s.shape == (3, 5, 3)
    assert torch.equal(s, compute_scales(block_amax(x, (1, 128)), E4M3_ACT_1x128).reshape(3, 5, 3))
    for i in range(3):
        qi, si = quantize(x[i, 2], E4M3_ACT_1x128)
        assert torch.equal(_bits(qi), _bits(q[i, 2])) and torch.equal(si, s[i, 2])


# ------------------------------------------------------------------------------------------- FP8 linear
@pytest.mark.parametrize("n, k, fmts", [(384, 128, (E4M3_WEIGHT_128, E4M3_ACT_1x128)), (300, 200, (E4M3_WEIGHT_128, E4M3_ACT_1x128)),
                                        (256, 256, (POW2_W, POW2_A))], ids=["aligned", "partial-blocks", "pow2"])
def test_fp8_linear_row_alone_equals_row_in_batch(n, k, fmts):
    w_fmt, a_fmt = fmts
    w = _rand(n, k, seed=1, scale=0.05)
    b = _rand(n, seed=2)
    w_q, s = quantize(w, w_fmt)
    rows = weight_row_scales(s, n, w_fmt)
    x = _rand(37, k, seed=3)
    x[5] *= 1000  # an outlier token must not change the other tokens' scales
    full = fp8_linear(x, w_q, rows, b, w_fmt=w_fmt, a_fmt=a_fmt)
    for i in range(37):
        assert torch.equal(fp8_linear(x[i:i + 1], w_q, rows, b, w_fmt=w_fmt, a_fmt=a_fmt), full[i:i + 1])
    perm = torch.randperm(37, generator=torch.Generator().manual_seed(0))
    assert torch.equal(fp8_linear(x[perm], w_q, rows, b, w_fmt=w_fmt, a_fmt=a_fmt), full[perm])
    ste = fp8_linear_ste(x.view(1, 37, k), w, b, w_q, rows, w_fmt=w_fmt, a_fmt=a_fmt)
    assert torch.equal(ste[0], full)


# ------------------------------------------------------------------------------------------- trainer == export
@pytest.fixture(scope="module", params=["tiny-llama", "tiny-mistral-gqa"])
def fp8_model(request, tmp_path_factory):
    model = build_consistent_gpt_model(builtin_model_dir(request.param), seed=0)
    bound = enable_fp8(model)
    assert len(bound) == 4 * model.arch_config.num_layers
    out = tmp_path_factory.mktemp(f"fp8-{request.param}")
    export_hf_fp8(model, model.arch_config, out)
    return model, out


def test_exported_fp8_weights_are_the_trainer_forward_weights(fp8_model):
    model, out = fp8_model
    arch = model.arch_config
    tensors = load_file(str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
                                          "fmt": "e4m3"}
    assert cfg[QUANT_KEY]["weight"]["scale_format"] == "fp32"
    params = dict(model.named_parameters())
    checked = 0
    for mname, hf_names, kind in _plan(arch):
        if not mname.endswith(("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")):
            assert tensors[hf_names[0]].dtype == torch.bfloat16
            continue
        module = model.get_submodule(mname.rsplit(".", 1)[0])
        w_q, rows = module.fp8.quantize_weight(params[mname])  # what the trainer's forward computes with
        file_q = _join(arch, kind, [tensors[h] for h in hf_names])
        file_rows = _join(arch, kind, [weight_row_scales(tensors[h + "_scale_inv"], tensors[h].shape[0]) for h in hf_names])
        assert file_q.dtype == torch.float8_e4m3fn and torch.equal(_bits(file_q), _bits(w_q))
        assert all(tensors[h + "_scale_inv"].dtype == torch.float32 for h in hf_names)
        assert torch.equal(file_rows, rows)
        for h, (q, s) in zip(hf_names, quantized_parts(arch, kind, params[mname])):
            assert torch.equal(_bits(tensors[h]), _bits(q)) and torch.equal(tensors[h + "_scale_inv"], s)
        # the trainer's linear output == fp8_linear on the exported tensors (what the vLLM plugin runs)
        x = _rand(5, 1, module.input_size, seed=checked)
        y, _ = module(x)
        assert torch.equal(y, fp8_linear(x, file_q, file_rows, module.bias))
        checked += 1
    assert checked == 4 * arch.num_layers


def _longest_constant_run(rows: torch.Tensor, limit: int = 256) -> int:
    """Brute force: the largest power of two P <= limit with ``rows`` (per-row scales) equal over aligned P-row runs."""
    best, p = 1, 2
    while p <= limit:
        if not all(torch.equal(rows[i : i + p], rows[i : i + 1].expand_as(rows[i : i + p])) for i in range(0, rows.shape[0], p)):
            break
        best, p = p, 2 * p
    return best


def test_scale_block_runs_follow_the_quantized_parts(fp8_model):
    """``w_block_rows`` (the CUDA FP8 GEMM loads one weight scale per tile of that many rows) is exactly the longest
    aligned run of equal row scales of the weight the trainer's forward uses -- fused qkv interleaved per query group,
    [gate; up] with parts not a multiple of 128 rows -- found by brute force on random weights (distinct block
    scales); the format's block alone (128) would be wrong for parts of 64 rows."""
    model, _ = fp8_model
    params = dict(model.named_parameters())
    seen = set()
    for name, module in model.named_modules():
        if getattr(module, "fp8", None) is None or not hasattr(module.fp8, "kind"):
            continue
        _, rows = module.fp8.quantize_weight(params[name + ".weight"])
        assert module.fp8.block_rows == _longest_constant_run(rows), (name, module.fp8.block_rows)
        seen.add((module.fp8.kind, module.fp8.block_rows))
    assert {kind for kind, _ in seen} == {"qkv", "copy", "fc1"}
    assert row_block_of_parts((64, 64), 128) == 64 and row_block_of_parts((768, 768), 128) == 128
    assert row_block_of_parts((4096, 1024, 1024), 128) == 128 and row_block_of_parts((96, 96), 128) == 32
    assert constant_row_block(torch.tensor([0, 0, 1, 1, 1])) == 2 and constant_row_block(torch.tensor([0, 0, 0, 1])) == 1
    assert constant_row_block(torch.zeros(5)) == 256


def test_fp8_trainer_logprobs_batch_invariant_and_trainable(fp8_model):
    model, _ = fp8_model
    vocab = model.arch_config.vocab_size
    ids = torch.randint(3, vocab, (3, 20), generator=torch.Generator().manual_seed(0))
    model.train()
    full = compute_token_logprobs(model, ids)
    for i in range(3):
        assert torch.equal(compute_token_logprobs(model, ids[i:i + 1]).detach(), full[i:i + 1].detach())
    full.sum().backward()
    w = model.decoder.layers[0].self_attention.linear_qkv.weight
    assert w.grad is not None and w.grad.dtype == torch.bfloat16 and torch.isfinite(w.grad.float()).all() and w.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)


# ------------------------------------------------------------------------------------------- end to end (real vLLM engine)
@pytest.mark.engine
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral-gqa"])
def test_check_fp8_zero_mismatch(tmp_path, name):
    cfg = load_check_config(hf_config=str(builtin_model_dir(name)), quantization="fp8", mode="consistent", num_prompts=6, max_tokens=12,
                            max_num_batched_tokens=32, out_dir=str(tmp_path), max_prompt_len=60, shared_prefix_len=40, prefix_groups=2)
    report = run_check(cfg)
    c = report["consistent"]
    assert c["tokens"] == 6 * 12
    assert c["exact_fraction"] == 1.0 and c["max_abs"] == 0.0
    assert report["zero_mismatch"]
    log = open(tmp_path / "engines" / "consistent.log").read()
    assert "megatron-consistent plugin active" in log


def test_kv_round_trip_is_exact_in_bf16():
    from megatron_consistent.kernels.fp8 import kv_dequantize, kv_quantize, kv_round_trip

    x = _rand(64, 2, 32, scale=4.0)
    q = kv_quantize(x)
    assert q.dtype == torch.float8_e4m3fn
    assert torch.equal(kv_round_trip(x), kv_dequantize(q, torch.bfloat16))
    assert torch.equal(kv_quantize(kv_round_trip(x)).view(torch.uint8), q.view(torch.uint8))  # e4m3 values are exact in bf16


# vLLM's CPU engine holds an E4M3 KV cache only on x86 with AVX-512 or AMX (e.g. not on an AMD EPYC without AVX-512)
NEEDS_CPU_FP8_KV_CACHE = pytest.mark.skipif(
    not cpu_fp8_kv_cache_supported(), reason="this CPU has neither AVX-512 nor AMX: vLLM's CPU engine cannot hold an FP8 "
    "KV cache here (check refuses it: test_check_refuses_an_fp8_kv_cache_the_cpu_engine_cannot_hold)")


def test_check_refuses_an_fp8_kv_cache_the_cpu_engine_cannot_hold(tmp_path, monkeypatch, capsys):
    """Without AVX-512 / AMX, ``check --kv-cache-dtype fp8`` on the CPU exits 2 with one line, before any work; with
    them the same arguments pass the layout checks."""
    from megatron_consistent.cli import main as cli_main
    from megatron_consistent.verify.inputs import hf_arch

    out = tmp_path / "out"
    cfg = load_check_config(kv_cache_dtype="fp8", device="cpu", out_dir=str(out))
    arch = hf_arch(builtin_model_dir())  # the arch the CLI's validation builds
    monkeypatch.setattr(check_module, "cpu_fp8_kv_cache_supported", lambda: True)
    check_module.check_layouts(cfg, arch)
    monkeypatch.setattr(check_module, "cpu_fp8_kv_cache_supported", lambda: False)
    assert cli_main(["check", "--device", "cpu", "--kv-cache-dtype", "fp8", "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--kv-cache-dtype fp8 on the CPU" in err and "AVX-512 or AMX" in err and len(err.strip().splitlines()) == 1, err
    assert not (out / "model").exists()  # nothing was built


@NEEDS_CPU_FP8_KV_CACHE
@pytest.mark.engine
def test_check_fp8_kv_cache_zero_mismatch(tmp_path):
    """bf16 weights, E4M3 KV cache in the engine; the trainer round-trips its K/V the same way."""
    cfg = load_check_config(hf_config=str(builtin_model_dir("tiny-mistral-gqa")), kv_cache_dtype="fp8", mode="consistent", num_prompts=6,
                            max_tokens=12, max_num_batched_tokens=32, out_dir=str(tmp_path), max_prompt_len=60, shared_prefix_len=40,
                            prefix_groups=2)
    report = run_check(cfg)
    assert report["consistent"]["tokens"] == 72 and report["consistent"]["max_abs"] == 0.0 and report["zero_mismatch"]
    assert "kv_cache_dtype=fp8" in open(tmp_path / "engines" / "consistent.log").read()


# ------------------------------------------------------------------------------------------- baseline trainer fake quant
def test_stock_fake_quant_is_vllm_online_per_channel():
    """The baseline trainer's fake quant is bitwise stock vLLM's own fp8_per_channel quantizers (weights per output channel,
    activations per token via QuantFP8.forward_native), dequantized to bf16."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.online.fp8 import _fp8_channel_scale, _fp8_quant_per_channel
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape, weight_amax

    from megatron_consistent.layers.fp8 import _stock_fake_quant_rows

    w = _rand(96, 160, seed=4, scale=0.05)
    w[3] = 0
    s = _fp8_channel_scale(weight_amax(w, dim=-1, keepdim=True))
    assert torch.equal((_fp8_quant_per_channel(w, s).float() * s).bfloat16(), _stock_fake_quant_rows(w, reciprocal=False))
    x = _rand(7, 160, seed=5)
    with set_current_vllm_config(VllmConfig()):
        xq, xs = QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN).forward_native(x)
    assert torch.equal((xq.float() * xs).bfloat16(), _stock_fake_quant_rows(x, reciprocal=True))


def test_stock_fp8_trainer_hooks_change_the_stock_forward():
    from megatron_consistent.layers import build_stock_gpt_model, compute_stock_token_logprobs
    from megatron_consistent.layers.fp8 import enable_stock_fp8_fake_quant, enable_stock_fp8_kv

    model = build_stock_gpt_model(builtin_model_dir("tiny-llama"), seed=0)
    ids = torch.randint(3, model.arch_config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    model.train()
    plain = compute_stock_token_logprobs(model, ids).detach()
    assert enable_stock_fp8_kv(model) == model.arch_config.num_layers
    kv = compute_stock_token_logprobs(model, ids).detach()
    assert len(enable_stock_fp8_fake_quant(model)) == 4 * model.arch_config.num_layers
    both = compute_stock_token_logprobs(model, ids).detach()
    assert not torch.equal(plain, kv) and not torch.equal(kv, both)
    assert (both - plain).abs().max() < 0.5  # a fake quant, not garbage


def test_enable_fp8_refuses_a_held_layer_without_the_tables_module():
    """A layer the model holds whose linear is not where the weight table says (renamed, replaced) is refused by name,
    not left in the model dtype while the engine runs it in FP8."""
    model = build_consistent_gpt_model(builtin_model_dir("tiny-llama"), seed=0)
    attn = model.decoder.layers[1].self_attention
    attn.renamed_qkv = attn.linear_qkv
    del attn.linear_qkv
    with pytest.raises(UnsupportedConfigError, match=r"decoder\.layers\.1\.self_attention\.linear_qkv is not a module"):
        enable_fp8(model)

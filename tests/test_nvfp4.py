"""NVFP4 (issue #9): E2M1 round-to-nearest-even, two-level scales, W4A16 linear, STE gradients, trainer == export, check.

Zero means zero: the consistent comparisons are ``torch.equal``.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from megatron_consistent.conversion.fp8 import export_hf_fp8
from megatron_consistent.conversion.hf import _join, _plan
from megatron_consistent.kernels.fp8 import NVFP4_WEIGHT, QuantFormat, dequantize, fp8_linear, fp8_linear_ste, quantize
from megatron_consistent.kernels.nvfp4 import (
    E2M1_GRID, decode_e2m1, encode_e2m1, nvfp4_effective_scales, nvfp4_quantize, pack_e2m1, unpack_e2m1)
from megatron_consistent.layers import build_consistent_gpt_model, compute_token_logprobs
from megatron_consistent.layers.fp8 import enable_fp8
from megatron_consistent.verify.check import builtin_model_dir, load_check_config, run_check

GRID = torch.tensor(E2M1_GRID, dtype=torch.float64)


def _reference_e2m1(y: torch.Tensor) -> torch.Tensor:
    """float64 reference: nearest grid magnitude (saturating at 6); exact ties -> the even code index."""
    a = y.double().abs().clamp(max=6.0)
    d = (a[..., None] - GRID).abs()
    best = d.min(-1, keepdim=True).values
    cand = d == best  # one or two (a tie) candidates
    idx = torch.arange(8).expand_as(cand)
    even_tie = cand & (idx % 2 == 0)
    pick = torch.where(cand.sum(-1, keepdim=True) > 1, even_tie, cand).to(torch.int64).argmax(-1)
    return pick.to(torch.uint8) | ((y < 0).to(torch.uint8) << 3)


def _rand(*shape, dtype=torch.bfloat16, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _ties_away(y):  # a deliberately broken encoder: ties away from zero
    a = y.abs()
    code = torch.zeros(y.shape, dtype=torch.uint8)
    for m in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
        code += (a >= m).to(torch.uint8)
    return code | ((y < 0).to(torch.uint8) << 3)


# ------------------------------------------------------------------------------------------- codec
def test_e2m1_rne_on_grid_midpoints_and_neighbours():
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32)
    mids = (grid[1:] + grid[:-1]) / 2
    pts = torch.cat([grid, mids, torch.nextafter(mids, torch.zeros_like(mids)), torch.nextafter(mids, torch.full_like(mids, 9.0)),
                     torch.tensor([6.5, 100.0, float("inf"), 1e-30])])
    pts = torch.cat([pts, -pts])
    assert torch.equal(encode_e2m1(pts), _reference_e2m1(pts))
    assert torch.equal(decode_e2m1(encode_e2m1(grid)), grid)  # grid values are exact
    assert encode_e2m1(torch.tensor([0.25]))[0] == 0 and encode_e2m1(torch.tensor([2.5]))[0] == 4  # ties to even: 0, 2
    assert not torch.equal(_ties_away(pts), _reference_e2m1(pts))  # the check catches a ties-away encoder
    with pytest.raises(ValueError, match="NaN"):
        encode_e2m1(torch.tensor([float("nan")]))


@given(seed=st.integers(0, 2**16), mag=st.sampled_from([0.1, 1.0, 7.0]))
@settings(max_examples=20, deadline=None)
def test_e2m1_matches_float64_reference(seed, mag):
    y = _rand(4096, dtype=torch.float32, seed=seed, scale=mag)
    assert torch.equal(encode_e2m1(y), _reference_e2m1(y))


def test_decode_of_every_code_is_the_grid_bitwise():
    """The arithmetic decode (no host table) gives every code's grid value, signed zero included."""
    ref = torch.tensor([*E2M1_GRID, *(-v for v in E2M1_GRID)], dtype=torch.float32)
    assert torch.equal(decode_e2m1(torch.arange(16, dtype=torch.uint8)).view(torch.int32), ref.view(torch.int32))


def test_pack_unpack_round_trip():
    codes = torch.randint(0, 16, (7, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_e2m1(codes)
    assert packed.shape == (7, 16) and packed.dtype == torch.uint8
    assert torch.equal(packed[:, 0], codes[:, 0] | (codes[:, 1] << 4))
    assert torch.equal(unpack_e2m1(packed), codes)


# ------------------------------------------------------------------------------------------- two-level scales
@given(rows=st.integers(1, 40), cols=st.integers(1, 100), seed=st.integers(0, 2**16), mag=st.sampled_from([1e-3, 1.0, 300.0]))
@settings(max_examples=20, deadline=None)
def test_nvfp4_quantize_documented_order_and_error_bound(rows, cols, seed, mag):
    x = _rand(rows, cols, dtype=torch.float32, seed=seed, scale=mag)
    x[0, 0] = 0.0
    codes, sb, g = nvfp4_quantize(x)
    assert codes.dtype == torch.uint8 and sb.dtype == torch.float8_e4m3fn and g.dtype == torch.float32 and g.dim() == 0
    want_g = x.abs().max() / torch.tensor(6.0 * 448.0)
    assert torch.equal(g, want_g if want_g > 0 else torch.tensor(1.0))  # all-zero tensor: global scale 1
    cb = -(-cols // 16)
    for j in range(cb):
        blk = x[:, j * 16:(j + 1) * 16]
        amax_b = blk.abs().amax(-1)
        want_sb = ((amax_b / 6.0) / g).clamp(0, 448).to(torch.float8_e4m3fn)
        want_sb = torch.where(amax_b == 0, torch.ones_like(amax_b), want_sb.float()).to(torch.float8_e4m3fn)
        assert torch.equal(sb[:, j].view(torch.uint8), want_sb.view(torch.uint8))
        s = sb[:, j].float() * g
        y = torch.where(s[:, None] == 0, torch.zeros_like(blk), blk / torch.where(s == 0, 1.0, s)[:, None])
        assert torch.equal(codes[:, j * 16:(j + 1) * 16], _reference_e2m1(y))
    q, eff = quantize(x, NVFP4_WEIGHT)
    assert torch.equal(q, codes) and torch.equal(eff, nvfp4_effective_scales(sb, g))
    dq = dequantize(q, eff, NVFP4_WEIGHT)
    s_el = eff.repeat_interleave(16, dim=1)[:, :cols].double()
    ys = x.double().abs() / torch.where(s_el == 0, 1.0, s_el)
    bound = s_el * torch.maximum(torch.full_like(ys, 0.25), ys / 4) * (1 + 2.0**-20) + 2.0**-126
    bound = torch.where(s_el == 0, x.double().abs(), bound)  # an underflowed block scale stores zeros
    assert torch.all((x.double() - dq.double()).abs() <= bound)


def test_nvfp4_activation_quantization_refused():
    w = _rand(32, 32)
    q, s = quantize(w, NVFP4_WEIGHT)
    with pytest.raises(ValueError, match="NVFP4 activations"):
        fp8_linear(_rand(2, 32), q, s, w_fmt=NVFP4_WEIGHT, a_fmt=NVFP4_WEIGHT)
    with pytest.raises(ValueError, match="e2m1"):
        QuantFormat("e2m1", (16, 16), "e4m3")


# ------------------------------------------------------------------------------------------- W4A16 linear
@given(t=st.integers(1, 30), n=st.integers(1, 80), k=st.sampled_from([16, 48, 130, 256]), seed=st.integers(0, 2**16))
@settings(max_examples=15, deadline=None)
def test_nvfp4_linear_rows_independent_of_batch(t, n, k, seed):
    w = _rand(n, k, seed=seed, scale=0.05)
    q, s = quantize(w, NVFP4_WEIGHT)
    x = _rand(t, k, seed=seed + 1)
    x[0] *= 1000
    full = fp8_linear(x, q, s, w_fmt=NVFP4_WEIGHT, a_fmt=None)
    for i in range(t):
        assert torch.equal(fp8_linear(x[i:i + 1], q, s, w_fmt=NVFP4_WEIGHT, a_fmt=None), full[i:i + 1])
    ste = fp8_linear_ste(x, w, None, q, s, w_fmt=NVFP4_WEIGHT, a_fmt=None)
    assert torch.equal(ste, full)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nvfp4_ste_gradients_match_float64_reference(dtype):
    """Reference: float64 ``y = x @ wd^T + b`` with ``wd = dq(q(W))`` (the same quantizer; W4A16 so x is unquantized) and
    the STE.  Tolerance as tests/test_fp8_gradients.py: float32 accumulation <= K 2^-24 (|g| @ |wd|) plus one rounding
    to the parameter dtype."""
    m, n, k = 11, 72, 160
    g0 = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g0).to(dtype).requires_grad_()
    w = (torch.randn(n, k, generator=g0) * 0.05).to(dtype).requires_grad_()
    b = torch.randn(n, generator=g0).to(dtype).requires_grad_()
    gy = torch.randn(m, n, generator=g0).to(dtype)
    q, s = quantize(w.detach(), NVFP4_WEIGHT)
    fp8_linear_ste(x, w, b, q, s, w_fmt=NVFP4_WEIGHT, a_fmt=None).backward(gy)
    wd = dequantize(q, s, NVFP4_WEIGHT).double()
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    (x64 @ (w64 + (wd - w64).detach()).t() + b64).backward(gy.double())
    rel = {torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}[dtype]
    g = gy.double().abs()
    assert torch.all((x.grad.double() - x64.grad).abs() <= k * 2.0**-24 * (g @ wd.abs()) + rel * x64.grad.abs() + 1e-30)
    assert torch.all((w.grad.double() - w64.grad).abs() <= m * 2.0**-24 * (g.t() @ x64.detach().abs()) + rel * w64.grad.abs() + 1e-30)
    assert torch.all((b.grad.double() - b64.grad).abs() <= m * 2.0**-24 * g.sum(0) + rel * b64.grad.abs() + 1e-30)
    # the STE through the *quantized* weight is what is checked: the master weight would be far off
    master_grad_x = gy.double() @ w.detach().double()
    assert not torch.all((x.grad.double() - master_grad_x).abs() <= k * 2.0**-24 * (g @ wd.abs()) + rel * x64.grad.abs())


# ------------------------------------------------------------------------------------------- trainer == export
def test_nvfp4_export_is_the_trainer_forward(tmp_path):
    model = build_consistent_gpt_model(builtin_model_dir("tiny-llama"), seed=0)
    arch = model.arch_config
    assert len(enable_fp8(model, NVFP4_WEIGHT, None)) == 4 * arch.num_layers
    export_hf_fp8(model, arch, tmp_path, NVFP4_WEIGHT, None)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["megatron_consistent_quantization"]["method"] == "nvfp4"
    assert cfg["megatron_consistent_quantization"]["activation"] is None
    tensors = load_file(str(tmp_path / "model.safetensors"))
    params = dict(model.named_parameters())
    checked = 0
    for mname, hf_names, kind in _plan(arch):
        if not mname.endswith(("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")):
            continue
        for h in hf_names:
            assert tensors[h].dtype == torch.uint8 and tensors[h + "_scale"].dtype == torch.float8_e4m3fn
            assert tensors[h + "_scale_2"].dtype == torch.float32 and tensors[h + "_scale_2"].dim() == 0
        module = model.get_submodule(mname.rsplit(".", 1)[0])
        w_q, rows = module.fp8.quantize_weight(params[mname])
        file_q = _join(arch, kind, [unpack_e2m1(tensors[h]) for h in hf_names])
        file_rows = _join(arch, kind, [nvfp4_effective_scales(tensors[h + "_scale"], tensors[h + "_scale_2"]) for h in hf_names])
        assert torch.equal(file_q, w_q) and torch.equal(file_rows, rows)
        x = _rand(5, 1, module.input_size, seed=checked)
        y, _ = module(x)
        assert torch.equal(y, fp8_linear(x, file_q, file_rows, module.bias, w_fmt=NVFP4_WEIGHT, a_fmt=None))
        checked += 1
    assert checked == 4 * arch.num_layers
    ids = torch.randint(3, arch.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    model.train()
    full = compute_token_logprobs(model, ids)
    for i in range(3):
        assert torch.equal(compute_token_logprobs(model, ids[i:i + 1]).detach(), full[i:i + 1].detach())
    full.sum().backward()
    assert model.decoder.layers[0].mlp.linear_fc1.weight.grad.abs().sum() > 0


@pytest.mark.engine
def test_check_nvfp4_zero_mismatch(tmp_path):
    cfg = load_check_config(hf_config=str(builtin_model_dir("tiny-llama")), quantization="nvfp4", mode="consistent", num_prompts=6,
                            max_tokens=12, max_num_batched_tokens=32, out_dir=str(tmp_path), max_prompt_len=60, shared_prefix_len=40,
                            prefix_groups=2)
    report = run_check(cfg)
    c = report["consistent"]
    assert c["tokens"] == 72 and c["exact_fraction"] == 1.0 and c["max_abs"] == 0.0 and report["zero_mismatch"]
    assert "megatron-consistent plugin active" in open(tmp_path / "engines" / "consistent.log").read()

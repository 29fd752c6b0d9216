"""The plugin's version adapter accepts exactly the tested vLLM builds and refuses the rest by name."""

from __future__ import annotations

import pytest

from megatron_consistent.config import UnsupportedConfigError
from megatron_consistent.vllm_plugin.compat import TESTED_VLLM, check_platform


@pytest.mark.parametrize("device, version", [("cpu", "0.32.0"), ("cpu", "0.32.0+cpu"), ("cuda", "0.26.0"), ("cuda", "0.26.0+cu130")])
def test_tested_versions_accepted(device, version):
    check_platform(device, version)


@pytest.mark.parametrize("device, version", [("cuda", "0.25.1"), ("cuda", "0.32.0"), ("cpu", "0.26.0"), ("cpu", "0.33.0")])
def test_untested_version_refused_with_the_tested_range(device, version):
    with pytest.raises(UnsupportedConfigError) as e:
        check_platform(device, version)
    msg = str(e.value)
    assert version in msg and "untested" in msg
    assert all(v in msg for vs in TESTED_VLLM.values() for v in vs)


def test_untested_platform_refused_by_name():
    with pytest.raises(UnsupportedConfigError, match="'xpu' is not supported"):
        check_platform("xpu", "0.26.0")


def _engine_config(hf: dict, device: str, compile_mode=None):
    """The parts of a ``VllmConfig`` that ``check_engine_config`` reads (an eager engine unless ``compile_mode``)."""
    from types import SimpleNamespace

    from vllm.config import CompilationMode, CUDAGraphMode

    from megatron_consistent.config import ArchConfig

    arch = ArchConfig.from_hf(hf)
    return arch, SimpleNamespace(
        model_config=SimpleNamespace(dtype=arch.torch_dtype, max_model_len=64, hf_config=SimpleNamespace(to_dict=lambda: hf)),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        device_config=SimpleNamespace(device_type=device),
        compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode.NONE, mode=compile_mode or CompilationMode.NONE))


@pytest.mark.parametrize("device, head_dim, refused", [("cuda", 320, True), ("cuda", 256, False), ("cpu", 320, False)])
def test_cuda_engine_refuses_a_head_dim_its_attention_does_not_serve(device, head_dim, refused):
    """A CUDA engine whose heads are wider than the CUDA attention serves is refused by name at engine build, before
    any weight is loaded or kernel compiled; head dim 256 and the CPU platform pass."""
    from megatron_consistent.config import builtin_model_dir, load_hf_config
    from megatron_consistent.vllm_plugin.model import check_engine_config

    arch, vllm_config = _engine_config({**load_hf_config(builtin_model_dir("tiny-llama")), "head_dim": head_dim}, device)
    if refused:
        with pytest.raises(UnsupportedConfigError, match=f"head_dim {head_dim}: .* up to 256") as e:
            check_engine_config(arch, vllm_config)
        assert "\n" not in str(e.value)
    else:
        check_engine_config(arch, vllm_config)


@pytest.mark.parametrize("compiled, cache_off, refused", [(True, False, True), (True, True, False), (False, False, False)])
def test_compiled_engine_recording_routes_needs_the_compile_cache_off(monkeypatch, tmp_path, compiled, cache_off, refused):
    """vLLM's compile-cache key does not see the route recorder: a compiled MoE engine that records routes is refused by
    name unless VLLM_DISABLE_COMPILE_CACHE=1 (a cached graph without the recorder would be loaded); eager engines pass."""
    from vllm.config import CompilationMode

    from megatron_consistent.config import builtin_model_dir, load_hf_config
    from megatron_consistent.vllm_plugin.model import check_engine_config
    from megatron_consistent.vllm_plugin.moe import ROUTES_ENV

    monkeypatch.setenv(ROUTES_ENV, str(tmp_path))
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1" if cache_off else "0")
    arch, vllm_config = _engine_config(load_hf_config(builtin_model_dir("tiny-qwen3moe-top1")), "cuda",
                                       CompilationMode.VLLM_COMPILE if compiled else None)
    if refused:
        with pytest.raises(UnsupportedConfigError, match="VLLM_DISABLE_COMPILE_CACHE=1") as e:
            check_engine_config(arch, vllm_config)
        assert "\n" not in str(e.value)
    else:
        check_engine_config(arch, vllm_config)


@pytest.mark.parametrize("model, formats, eager", [
    ("tiny-llama", "fp8", False), ("tiny-llama", "nvfp4", False), ("tiny-qwen3moe-top1", "fp8", False),
    ("tiny-qwen3moe-top1", "fp8-group64", True), ("tiny-llama", "fp8-group64", False), ("tiny-qwen3moe-top1", "", False),
    ("tiny-qwen3moe-top1", "nvfp4", True)])
def test_quantized_models_compile_on_cuda_unless_their_experts_read_the_host(model, formats, eager):
    """Block-FP8 and NVFP4 models compile with CUDA graphs (their linears and FP8 experts are opaque ops with no host
    read); MoE experts in a format the CUDA FP8 GEMM does not serve run per expert (a host read): that model runs
    eager, with the format named, and a CUDA engine with graphs is refused before any weight is loaded."""
    from vllm.config import CompilationMode, CUDAGraphMode

    from megatron_consistent.config import ArchConfig, builtin_model_dir, load_hf_config
    from megatron_consistent.conversion.fp8 import QUANT_KEY, quantization_entry
    from megatron_consistent.kernels import fp8
    from megatron_consistent.vllm_plugin.model import check_engine_config, eager_only_reason

    pairs = {"fp8": (fp8.E4M3_WEIGHT_128, fp8.E4M3_ACT_1x128), "nvfp4": (fp8.NVFP4_WEIGHT, None),
             "fp8-group64": (fp8.QuantFormat("e4m3", (64, 64)), fp8.QuantFormat("e4m3", (1, 64)))}
    hf = load_hf_config(builtin_model_dir(model))
    if formats:
        hf = {**hf, QUANT_KEY: quantization_entry(*pairs[formats])}
    reason = eager_only_reason(ArchConfig.from_hf(hf), hf)
    assert bool(reason) == eager
    if eager:
        assert pairs[formats][0].spec in reason  # e4m3:64x64:fp32, e2m1:1x16:e4m3
        arch, vllm_config = _engine_config(hf, "cuda", CompilationMode.VLLM_COMPILE)
        vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
        with pytest.raises(UnsupportedConfigError, match="runs eager on CUDA"):
            check_engine_config(arch, vllm_config)


def test_cuda_attention_takes_manager_blocks_vllm_cuts_into_its_pages():
    """A hybrid's attention block is raised to hold a Mamba state (hundreds of tokens at real widths); vLLM 0.26 cuts
    a manager block into kernel pages of the largest listed size dividing it, so the backend must accept every
    multiple of a served page -- and only those (refused: vLLM then names the block size)."""
    from megatron_consistent.kernels.triton.paged_attention import PAGE_SIZES
    from megatron_consistent.vllm_plugin.cuda_attention import ConsistentCudaAttentionBackend as backend

    assert backend.get_supported_kernel_block_sizes() == list(PAGE_SIZES)
    for block in range(1, 2049):
        pages = [p for p in backend.get_supported_kernel_block_sizes() if block % p == 0]
        assert backend.supports_block_size(block) == bool(pages), block
    assert backend.supports_block_size(528) and backend.supports_block_size(None)  # 528 = 33 pages of 16
    assert not backend.supports_block_size(24) and not backend.supports_block_size(1000)


def test_cuda_attention_asks_vllm_for_decodes_first():
    """With the Gluon kernels on (the default; ``MC_GLUON=0`` off) the CUDA backend hands a step's requests after its
    leading one-token ones to the Gluon prefill kernel (``paged_attention.leading_decodes``): it asks vLLM's runner to put those first, as vLLM's own
    Mamba-2 builder does (``reorder_batch_threshold = 1``; the runner takes the smallest of its builders')."""
    from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionMetadataBuilder

    from megatron_consistent.vllm_plugin.cuda_attention import ConsistentCudaAttentionMetadataBuilder as builder

    assert builder.reorder_batch_threshold == 1 == Mamba2AttentionMetadataBuilder.reorder_batch_threshold

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


@pytest.mark.parametrize("device, head_dim, refused", [("cuda", 320, True), ("cuda", 256, False), ("cpu", 320, False)])
def test_cuda_engine_refuses_a_head_dim_its_attention_does_not_serve(device, head_dim, refused):
    """A CUDA engine whose heads are wider than the CUDA attention serves is refused by name at engine build, before
    any weight is loaded or kernel compiled; head dim 256 and the CPU platform pass."""
    from types import SimpleNamespace

    from vllm.config import CUDAGraphMode

    from megatron_consistent.config import ArchConfig, builtin_model_dir, load_hf_config
    from megatron_consistent.vllm_plugin.model import check_engine_config

    hf = {**load_hf_config(builtin_model_dir("tiny-llama")), "head_dim": head_dim}
    arch = ArchConfig.from_hf(hf)
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(dtype=arch.torch_dtype, max_model_len=64, hf_config=SimpleNamespace(to_dict=lambda: hf)),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        device_config=SimpleNamespace(device_type=device),
        compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode.NONE))
    if refused:
        with pytest.raises(UnsupportedConfigError, match=f"head_dim {head_dim}: .* up to 256") as e:
            check_engine_config(arch, vllm_config)
        assert "\n" not in str(e.value)
    else:
        check_engine_config(arch, vllm_config)

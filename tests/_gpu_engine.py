"""The marks of the tests that start vLLM's GPU engine: skipped, with the reason, without a CUDA device or vLLM's
CUDA build (``../shared/gpu-vllm/``)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

GPU_ENGINE_MARKS = [
    pytest.mark.gpu,
    pytest.mark.engine,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU vLLM engine)"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None or torch.version.cuda is None,
                       reason="needs vLLM's CUDA build (see ../shared/gpu-vllm/README.md)"),
]

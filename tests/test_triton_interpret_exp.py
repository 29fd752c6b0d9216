"""The contract's ``exp`` in one Triton launch (``kernels/triton/exp.py``, what :func:`kernels.numerics.exp` hands CUDA
tensors) in Triton's interpreter on CPU tensors: bitwise :func:`kernels.numerics.exp_torch` (the CPU contract) over
the whole range, its clamps, NaN and infinities, every floating input dtype, non-contiguous and empty tensors; a
kernel with the hardware's own ``exp`` is caught.  Run with ``TRITON_INTERPRET=1`` (``make test-interpret``)."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=1 runs these on CPU tensors)", allow_module_level=True)

import triton.language as tl  # noqa: E402

from megatron_consistent.kernels import numerics  # noqa: E402
from megatron_consistent.kernels.triton.exp import exp_triton  # noqa: E402


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    edges = torch.tensor([0.0, -0.0, 1.0, -1.0, 88.0, 89.9, 90.0, 95.0, -103.0, -109.9, -110.0, -120.0,
                          numerics.LN2 / 2, -numerics.LN2 / 2, float("inf"), float("-inf"), float("nan")])
    return torch.cat([edges, torch.rand(3000, generator=g) * 220 - 120, torch.randn(1000, generator=g)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_exp_kernel_is_the_contract_exp(dtype):
    x = _inputs().to(dtype)
    if dtype == torch.bfloat16:  # Triton 3.9's interpreter takes a bf16 NaN for equal to itself (on the GPU
        x = x[~x.isnan()]        # the kernel keeps it: tests/test_gpu_exp.py)
    assert torch.equal(_bits(exp_triton(x)), _bits(numerics.exp_torch(x)))


def test_shapes_views_and_empty():
    x = _inputs()[:1200].reshape(30, 40)
    for view in (x, x.t(), x[:, ::3], x[None, 5:9]):
        assert torch.equal(_bits(exp_triton(view)), _bits(numerics.exp_torch(view)))
        assert exp_triton(view).shape == view.shape
    assert exp_triton(torch.empty(0, 7)).shape == (0, 7)
    with pytest.raises(TypeError, match="floating"):
        exp_triton(torch.arange(4))


def test_the_hardware_exp_is_caught():
    """The comparison can fail: the same launch with Triton's own ``exp`` (float32) differs from the contract."""

    @triton.jit
    def native_exp_kernel(X, Y, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Y + i, tl.exp(tl.load(X + i, mask=i < n, other=0.0)), mask=i < n)

    x = _inputs()[17:]
    y = torch.empty_like(x)
    native_exp_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    assert not torch.equal(_bits(y), _bits(numerics.exp_torch(x)))

"""Small helpers shared by the Triton kernels."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..dispatch import env_switch

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:  # pragma: no cover
    TensorDescriptor = None


# The Gluon kernels (.gluon_segment_tree, .gluon_fp8_gemm, .gluon_attention: Hopper, warp-specialised, the committed
# kernels' bits) take the calls they are measured ahead on: on by default since session 31 (`check` zero at b, b8, d,
# d8 with them; rollout b8 1.045x the committed kernels with the same tokens, (c) equal); MC_GLUON=0 turns them off.
# Read once, when the CUDA backend is imported.
GLUON_DEFAULT = True
GLUON = env_switch("MC_GLUON", GLUON_DEFAULT)


@functools.lru_cache(maxsize=None)
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def on_hopper(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on an sm_90 GPU (``wgmma``, TMA, warp specialisation: what the Gluon kernels are written
    for); a CPU tensor (Triton's interpreter) is not."""
    return t.device.type == "cuda" and _is_hopper(device_index(t))


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@functools.lru_cache(maxsize=None)
def float32_scalar(v: float) -> float:
    """``v`` rounded to float32 (to nearest), as torch rounds a Python scalar in an op on a float32 tensor."""
    return torch.tensor(float(v), dtype=torch.float32).item()


def tma_ok(t: torch.Tensor) -> bool:
    """Whether ``t`` (any rank, last dim contiguous) can back a host-side TMA descriptor: 16-byte aligned base and
    leading strides."""
    es = t.element_size()
    return (TensorDescriptor is not None and t.stride(-1) == 1 and all(s * es % 16 == 0 for s in t.stride()[:-1])
            and t.data_ptr() % 16 == 0)


def tma_sources(a: torch.Tensor, b: torch.Tensor, bm: int, bn: int, bk: int, use_tma: bool):
    """The GEMM operand sources ``(a, b)``: TMA descriptors of ``[bm, bk]`` / ``[bn, bk]`` blocks, or the tensors."""
    if use_tma:
        return TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(b, [bn, bk])
    return a, b


def gemm_output(m: int, n: int, k: int, bias: torch.Tensor | None, out_dtype: torch.dtype, device):
    """``(out [m, n], done)``: a fresh output, and whether it is already final (empty, or ``K == 0``: the bias)."""
    out = torch.empty((m, n), dtype=out_dtype, device=device)
    if m == 0 or n == 0:
        return out, True
    if k == 0:
        out.zero_()
        if bias is not None:
            out += bias.to(out_dtype)
        return out, True
    return out, False


@triton.jit
def tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """(M tile, N tile) of linear tile index ``tile`` in grouped order (``GROUP_M`` M tiles per band, for L2 reuse)."""
    group = GROUP_M * num_n
    gid = tile // group
    first_m = gid * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % group) % gsize
    pid_n = (tile % group) // gsize
    return pid_m, pid_n

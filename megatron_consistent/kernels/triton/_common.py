"""Small helpers shared by the Triton kernels."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

TORCH_TO_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))

"""Run Megatron-Core's GPU-only distributed optimizer on a CPU machine, for tests (``tests/_megatron_restore.py
--emulate-cuda-on-cpu``): one gloo rank that answers to the name NCCL, and a torch-function mode that puts every
tensor Megatron asks to have on ``cuda`` on the CPU instead.

What Megatron-Core (0.16.1) needs for that: ``device="cuda"`` in factory calls and ``.to("cuda")`` / ``.cuda()``
land on the CPU; ``Tensor.type()`` answers ``torch.cuda.*Tensor`` (its type checks on wrapped parameters) and
``Tensor.is_cuda`` is true; ``torch.cuda.current_device()`` answers ``"cpu"`` (DDP's buffers);
``torch.cuda.nccl.version()`` answers (the checkpoint logger of an "nccl" group asks).  The arithmetic is the CPU's;
what is under test is the optimizer's state handling (save, restore, next step), which is device-free.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode


_IS_CUDA = torch.Tensor.is_cuda.__get__


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "cuda" in str(kwargs.get("device", "")):
            kwargs["device"] = "cpu"
        name = getattr(func, "__name__", "")
        if func == _IS_CUDA:
            return True
        if name == "cuda":
            return args[0]
        if name == "to" and len(args) > 1 and "cuda" in str(args[1]):
            args = (args[0], "cpu", *args[2:])
        out = func(*args, **kwargs)
        if name == "type" and len(args) == 1 and not kwargs and isinstance(out, str):
            return out.replace("torch.", "torch.cuda.", 1)
        return out


def emulate_cuda_on_cpu() -> None:
    """One gloo rank (reported as ``nccl``), Megatron's parallel state, and the CUDA→CPU mode, for the process."""
    from megatron_consistent.layers.parallel import init_cpu_process_group

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.get_backend = lambda group=None: "nccl"
    torch.cuda.nccl.version = lambda: (0, 0, 0)  # torch's checkpoint logger asks an "nccl" group for it
    torch.cuda.current_device = lambda: "cpu"
    init_cpu_process_group()
    _CudaToCpu().__enter__()

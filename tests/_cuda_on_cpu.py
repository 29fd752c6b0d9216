"""Run Megatron-Core's GPU-only distributed optimizer on a CPU machine, for tests (``tests/_megatron_restore.py
--emulate-cuda-on-cpu``): one gloo rank that answers to the name NCCL, and a torch-function mode that puts every
tensor Megatron asks to have on ``cuda`` on the CPU instead.

What Megatron-Core (0.16.1) needs for that: ``device="cuda"`` in factory calls and ``.to("cuda")`` / ``.cuda()``
land on the CPU; ``Tensor.type()`` answers ``torch.cuda.*Tensor`` (its type checks on wrapped parameters) and
``Tensor.is_cuda`` is true; ``torch.cuda.current_device()`` answers ``"cpu"`` (DDP's buffers);
``torch.cuda.nccl.version()`` answers (the checkpoint logger of an "nccl" group asks).  The arithmetic is the CPU's;
what is under test is the optimizer's state handling (save, restore, next step), which is device-free.

:func:`alltoall_dispatcher_stubs`: the CUDA stream calls (and, at EP > 1, the output allocation) of Megatron's
all-to-all token dispatcher, as no-ops / on the CPU.
"""

from __future__ import annotations

import contextlib
import types

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


class NoopStream:
    """Stand-in for ``torch.cuda.Stream`` on a CPU-only machine: CPU ops are synchronous, so every stream
    operation Megatron's all-to-all dispatcher issues (side-stream D2H copies, wait, record/sync event) is a no-op."""

    def __init__(self, *a, **k):
        pass

    def wait_stream(self, other):
        pass

    def record_event(self, *a):
        return types.SimpleNamespace(synchronize=lambda: None)


@contextlib.contextmanager
def alltoall_dispatcher_stubs(*, claim_cuda: bool = False):
    """TEST-ONLY, inside the ``with`` on a CPU-only machine (a no-op where CUDA is available): what Megatron's
    ``MoEAlltoAllTokenDispatcher`` asks of CUDA -- ``torch.cuda.Stream`` / ``current_stream`` / ``stream`` as no-ops,
    ``torch.cuda.current_device()`` answering ``"cpu"`` (its all-to-all's output at EP > 1), and its device-to-host
    copy of the all-to-all split sizes giving numpy arrays from CPU tensors too (what it gives from CUDA tensors;
    ``all_to_all_single`` takes no tensor as split sizes); ``claim_cuda``: ``torch.cuda.is_available()`` answers True
    (only for the product's build-time refusal of 'alltoall' without CUDA).  Restored on exit."""
    if torch.cuda.is_available():
        yield
        return
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    real_dtoh = token_dispatcher.maybe_move_tensor_to_cpu
    current = NoopStream()
    stubs = {(torch.cuda, "Stream"): NoopStream, (torch.cuda, "current_stream"): lambda *a: current,
             (torch.cuda, "stream"): lambda s: contextlib.nullcontext(), (torch.cuda, "current_device"): lambda: "cpu",
             (token_dispatcher, "maybe_move_tensor_to_cpu"): lambda t, as_numpy=False, record_stream=False: (
                 t.numpy() if as_numpy and torch.is_tensor(t) else real_dtoh(t, as_numpy, record_stream))}
    if claim_cuda:
        stubs[(torch.cuda, "is_available")] = lambda: True
    saved = {key: getattr(*key) for key in stubs}
    for (owner, name), stub in stubs.items():
        setattr(owner, name, stub)
    try:
        yield
    finally:
        for (owner, name), real in saved.items():
            setattr(owner, name, real)

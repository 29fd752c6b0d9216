"""Shared test configuration: hypothesis profiles and small generic fixtures.

Profiles (select with ``HYPOTHESIS_PROFILE=<name>``):

* ``ci`` (loaded unless the variable says otherwise) — what CI runs: 20
  examples per property, no deadline (CPU kernels written in plain torch are
  slow and their timing varies with machine load).
* ``thorough`` — many more examples, for a local soak run.

Property tests normally rely on the profile's ``max_examples``; a test that is
expensive may lower it with its own ``@settings``.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("thorough", parent=settings.get_profile("ci"), max_examples=300)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# vLLM CPU engines started by tests (in subprocesses, which inherit this): a 1 GiB KV cache, ample for the tiny models
# (a soak's num_gpu_blocks_override still shrinks it).  Otherwise vLLM sizes it as gpu_memory_utilization (0.3) of
# the machine's memory, several GiB that take ~15 s to allocate at every engine start.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _row_invariant_interpreter_dot() -> None:
    """Under ``TRITON_INTERPRET=1``, ``tl.dot`` as a stack of one-row products.  The interpreter computes a dot with
    ``np.matmul``, whose BLAS kernel may round a row differently with the number of rows (OpenBLAS 0.3.30's Haswell /
    Zen sgemm does: rows 0-15 of a 32 x 16 @ 16 x 16 product differ from the 16 x 16 product), so a test of a kernel's
    row tiles would test the BLAS; each row as its own ``1 x K`` product gives it the same arithmetic whatever the tile.
    The GPU tests check the tensor cores themselves."""
    import numpy as np
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        rows = interpreter.TensorHandle(a.data[..., :, None, :], a.dtype.scalar)
        cols = interpreter.TensorHandle(b.data[..., None, :, :], b.dtype.scalar)
        acc = interpreter.TensorHandle(d.data[..., :, None, :], d.dtype.scalar)
        out = dot(self, rows, cols, acc, input_precision, max_num_imprecise_acc)
        return interpreter.TensorHandle(np.ascontiguousarray(out.data[..., 0, :]), out.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _row_invariant_interpreter_dot()


@contextlib.contextmanager
def _torch_threads(n: int):
    """Run the body with ``torch.set_num_threads(n)``; the previous count is restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def torch_threads():
    """Context-manager factory ``with torch_threads(n): ...`` (session-scoped, so usable under @given)."""
    return _torch_threads


@pytest.fixture(autouse=True, scope="module")
def _restore_torch_state():
    """Safety net: whatever a test module does to the thread count or the default RNG is undone after it."""
    threads = torch.get_num_threads()
    rng = torch.get_rng_state()
    yield
    torch.set_num_threads(threads)
    torch.set_rng_state(rng)

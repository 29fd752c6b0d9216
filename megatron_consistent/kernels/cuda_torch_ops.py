"""CUDA registrations of the Mamba-2 / Nemotron-H ops: Triton kernels that evaluate the CPU contract code's
operations in its order (so its bits on the same device), and the CPU contract code itself run on GPU tensors.

Part of the CUDA backend (:data:`.dispatch.LAZY_BACKENDS`, imported on the first CUDA tensor beside :mod:`.triton`).

``mamba_dt``, ``causal_conv1d`` and ``gated_rms_norm`` are registered for ``"cuda"`` with one Triton launch each
(:mod:`.triton.mamba_dt`, :mod:`.triton.causal_conv1d`, :mod:`.triton.gated_rms_norm`, session 25): the torch
functions registered for ``"cpu"`` take dozens of float64 elementwise launches a call for ``numerics.exp`` /
``log`` (measured on the H200: 3-52x slower, `benchmarks/bench_gpu_mamba_ops.py`); the kernels' bits are the torch
functions' on the same GPU (``tests/test_gpu_conv1d.py``, ``tests/test_gpu_gated_norm_dt.py``) and on the CPU in
Triton's interpreter.  ``relu_squared`` runs the CPU function on GPU tensors, and the SSD scan's steps
(``ssd_steps``: hence ``ssd_scan``, ``ssd_continue``, ``ssd_outputs_at``) the fused Triton kernels by default
(below).  The torch forwards use only elementwise torch ops, fixed-shape slicing / gathers, the float64
:mod:`.numerics` ``exp`` / ``log`` (``exp`` of a CUDA tensor in one Triton launch, :mod:`.triton.exp`) and
fixed-length :func:`.numerics.tree_sum` trees — no matmul / einsum, no cumsum, no scatter / index_add, no reduction
over a length that varies. Index and mask tensors are created on the data's device.

Contract on the GPU: deterministic and batch-invariant (each element is computed by the same sequence of separate
IEEE operations whatever the batch, the sequence length or the prefill / decode split), so a sequence's outputs are
the same bits alone or in a batch, whole or token by token.  GPU bits are not required to equal CPU bits (CUDA's
float64 ``exp`` / ``floor`` / division need not round like the CPU's); tests compare them with a tolerance
(tests/test_gpu_ssm.py).  Backwards are the ops' own float32 recompute (cumsum / einsum; correct, not
batch-invariant), as on the CPU.

The SSD scan's bulk (the prefix sums, the outputs and the chunks' state terms) is evaluated by the fused Triton
kernels of :mod:`.triton.ssd_scan` (``MC_SSD_SCAN=triton``, the default): the same IEEE operations in the same
order, so the same bits as the torch evaluation (bitwise in Triton's interpreter on the CPU; on the H200 by
tests/test_gpu_ssm.py, ``benchmarks/bench_gpu_ssd.py`` at Nemotron-H 8B's widths and the whole ``check`` at shape
``h``, session 23), 100-260 times faster at prefill.  ``MC_SSD_SCAN=torch`` runs the torch evaluation instead (the
reference, minutes per step at real widths).  The same switch picks the decode step's ``ssd_step_outputs`` and
``ssd_step_end_states`` (session 25: the same kernels reading the mixer's state cache in place; bitwise in the
interpreter, their GPU tests pending) or their torch references.  It is read once, when the CUDA backend is imported (the first CUDA
tensor of a process); the trainer and the engine processes inherit it alike.
"""

from __future__ import annotations

from .dispatch import register
from .relu_squared import _relu_squared_cpu
from .ssd import TORCH_STEPS, _ssd_step_end_states_cpu, _ssd_step_outputs_cpu, torch_ssd_evaluation
from .triton.causal_conv1d import causal_conv1d_triton
from .triton.gated_rms_norm import gated_rms_norm_triton
from .triton.mamba_dt import mamba_dt_triton
from .triton.ssd_scan import TRITON_STEPS
from .triton.ssd_scan import ssd_step_end_states as ssd_step_end_states_triton
from .triton.ssd_scan import ssd_step_outputs as ssd_step_outputs_triton


def _ssd_evaluation() -> dict:
    """The SSD scan's steps and the decode step's in-place outputs and end states that ``MC_SSD_SCAN`` names (module
    docstring): the Triton kernels, or the torch evaluation (the decode step's replay built, its states gathered and
    scattered by torch ops)."""
    torch_ops = torch_ssd_evaluation()
    return {"ssd_steps": TORCH_STEPS if torch_ops else TRITON_STEPS,
            "ssd_step_outputs": _ssd_step_outputs_cpu if torch_ops else ssd_step_outputs_triton,
            "ssd_step_end_states": _ssd_step_end_states_cpu if torch_ops else ssd_step_end_states_triton}


OPS = {
    "mamba_dt": mamba_dt_triton,
    **_ssd_evaluation(),
    "causal_conv1d": causal_conv1d_triton,
    "gated_rms_norm": gated_rms_norm_triton,
    "relu_squared": _relu_squared_cpu,
}

for _op, _fn in OPS.items():
    register(_op, "cuda")(_fn)

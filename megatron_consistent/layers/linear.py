"""Column/row parallel linears for Megatron's TransformerLayer spec (TP = 1, 2, 4, 8), calling :func:`kernels.linear`.

Numerics contract: the column-parallel forward is exactly ``kernels.linear(x,
weight, bias)`` (batch-invariant blocked float32 accumulation, bias added in
float32 before the single rounding to the input dtype); the row-parallel
forward is ``kernels.row_parallel_linear`` (the K reduction as a fixed tree of
S K segments, the shape any tensor-parallel degree dividing S can split; S is the
model's, read from the config by :func:`.parallel.row_parallel_segments`).  Because every output feature is an
independent dot product, the fused ``linear_qkv`` / ``linear_fc1`` weights
give bitwise the same values as the separate q/k/v or gate/up projections of
the HF layout.  Backward: the kernel's float32 matmuls; gradients land in
``param.grad`` (Megatron's DDP hooks then accumulate ``.grad`` into
``main_grad``; gradient_accumulation_fusion is not used).

Interface (Megatron's): ``forward(x [s, b, in]) -> (out [s, b, out], bias_or_None)``;
with ``skip_bias_add=True`` the bias is returned instead of added.  Parameter
names are ``weight`` ``[out, in]`` and ``bias`` ``[out]`` so state-dict keys match
Megatron's ColumnParallelLinear / RowParallelLinear.

Tensor parallelism (Megatron's sharding and parameter attributes; contract in
:mod:`.tensor_parallel`): the column-parallel layer holds ``output_size / t``
rows (``linear_fc1`` with stride 2: its gate shard then its up shard), runs
``kernels.linear`` on them and all-reduces ``grad_x`` in backward; the
row-parallel layer holds ``input_size / t`` columns and runs
:func:`.tensor_parallel.row_parallel_forward` (rank subtree of the S-segment K
tree, float32 all-gather in rank order, top of the tree) — the bits of TP=1.
Initialization follows Megatron's CPU recipe (float32 master of the full
shape, then the rank's split), so a seeded build has the same full weights at
every TP.  ``gather_output`` / ``input_is_parallel=False``
at TP > 1, expert linears and FP8 at TP > 1 are refused by name.  Sequence
parallelism: the column-parallel input is all-gathered along the sequence and
the row-parallel output is the rank's sequence chunk of the same tree
(:func:`.tensor_parallel.gather_tree_scatter_sequence`).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from ..kernels.linear import check_segments
from ..config import UnsupportedConfigError
from .parallel import check_parallel_config, row_parallel_segments
from . import tensor_parallel as tpar

__all__ = ["ConsistentColumnParallelLinear", "ConsistentRowParallelLinear", "sharded_state_dict_tp1"]


def _set_tp_attributes(param: nn.Parameter, partition_dim: int, stride: int = 1, sections=None) -> None:
    """The attributes Megatron's DDP / optimizer / checkpointing read from TP parameters (``sections``: our
    ``partition_sections``, unequal sub-blocks each split over the ranks: :func:`.tensor_parallel.shard_like`)."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride
    if sections is not None:
        param.partition_sections = tuple(sections)
    param.allreduce = True
    param.sequence_parallel = False


def sharded_state_dict_tp1(module: nn.Module, prefix: str, sharded_offsets, metadata, axis_map: dict) -> dict:
    """Megatron dist-checkpointing entries for a TP=1 module (weights are whole)."""
    from megatron.core import parallel_state
    from megatron.core.transformer import utils as tutils

    state = module.state_dict(prefix="", keep_vars=True)
    kwargs = {}
    if hasattr(tutils, "ensure_metadata_has_dp_cp_group"):
        metadata = tutils.ensure_metadata_has_dp_cp_group(metadata)
        kwargs = {"tp_group": parallel_state.get_tensor_model_parallel_group(), "dp_cp_group": metadata["dp_cp_group"]}
    try:
        return tutils.make_sharded_tensors_for_checkpoint(state, prefix, axis_map, sharded_offsets, **kwargs)
    except TypeError:  # older/newer signature without the group keywords
        return tutils.make_sharded_tensors_for_checkpoint(state, prefix, axis_map, sharded_offsets)


class _ConsistentLinearBase(nn.Module):
    _partition_dim = 0
    _row_parallel = False

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method=None,
        bias: bool = True,
        skip_bias_add: bool = False,
        is_expert: bool = False,
        stride: int = 1,
        tp_comm_buffer_name: str | None = None,
        tp_group=None,
        skip_weight_param_allocation: bool = False,
        gather_output: bool = False,
        input_is_parallel: bool = True,
        partition_sections: tuple[int, ...] | None = None,
        **unused,
    ):
        super().__init__()
        check_parallel_config(config)
        group = tpar.tp_group(tp_group)
        t, rank = tpar.tp_size(group), tpar.tp_rank(group)
        self.tp_group, self.tp_size, self.tp_rank = group, t, rank
        if t > 1 and gather_output:
            raise UnsupportedConfigError("gather_output=True at TP > 1 is not supported by the consistent column-parallel linear")
        if t > 1 and self._row_parallel and not input_is_parallel:
            raise UnsupportedConfigError("input_is_parallel=False at TP > 1 is not supported by the consistent row-parallel linear")
        split = input_size if self._row_parallel else output_size
        if split % (t * stride):
            raise UnsupportedConfigError(f"{'input' if self._row_parallel else 'output'} size {split} is not divisible by TP={t}"
                                         + (f" x stride {stride}" if stride > 1 else ""))
        if self._row_parallel:
            self.row_parallel_segments = row_parallel_segments(config)  # S, the model's (TP divides it: checked above)
            check_segments(input_size, self.row_parallel_segments)
        if partition_sections is not None and (self._row_parallel or stride != 1 or sum(partition_sections) != output_size
                                               or any(n % t for n in partition_sections)):
            raise UnsupportedConfigError(f"partition_sections {tuple(partition_sections)}: column-parallel rows of "
                                         f"{output_size} in blocks that TP={t} divides, stride 1")
        if is_expert:
            raise UnsupportedConfigError("expert (MoE) linears are not supported by the consistent layers")
        if skip_weight_param_allocation:
            raise UnsupportedConfigError("skip_weight_param_allocation is not supported by the consistent linear")
        self.input_size, self.output_size = input_size, output_size
        self.skip_bias_add = skip_bias_add
        self.is_expert = False
        self.sequence_parallel = bool(getattr(config, "sequence_parallel", False)) and t > 1
        self.tp_comm_buffer_name = tp_comm_buffer_name
        dtype = config.params_dtype
        local_out = output_size if self._row_parallel else output_size // t
        local_in = input_size // t if self._row_parallel else input_size
        self.weight = nn.Parameter(torch.empty(local_out, local_in, dtype=dtype))
        _set_tp_attributes(self.weight, self._partition_dim, stride, partition_sections)
        if getattr(config, "perform_initialization", True) and init_method is not None:
            # Same recipe (and RNG consumption) as Megatron's CPU initialization: float32 master of the full shape,
            # cast, then this rank's split (tensor_parallel.shard_like, Megatron's _initialize_affine_weight_cpu split).
            master = torch.empty(output_size, input_size, dtype=torch.float32)
            init_method(master)
            with torch.no_grad():
                self.weight.copy_(tpar.shard_like(master.to(dtype), self.weight, rank, t))
        if bias:
            self.bias = nn.Parameter(torch.zeros(local_out, dtype=dtype))
            if self._row_parallel:  # replicated (added once, after the gather), as Megatron's RowParallelLinear;
                # under sequence parallelism each rank adds it to its chunk: partial gradient, all-reduced by Megatron
                self.bias.sequence_parallel = self.sequence_parallel
            else:
                _set_tp_attributes(self.bias, 0, stride, partition_sections)
        else:
            self.register_parameter("bias", None)

        # Same state-dict keys as Megatron's linears: an empty ``_extra_state`` (TE compatibility).
        self._register_load_state_dict_pre_hook(lambda sd, prefix, *a, **k: sd.setdefault(f"{prefix}_extra_state"))

    def get_extra_state(self):
        return None

    def set_extra_state(self, state):
        pass

    def forward(self, x: torch.Tensor):
        # layers/fp8.py enable_fp8: block-FP8 forward on the bf16 master (the row-parallel tree's segments too), STE backward
        fp8 = getattr(self, "fp8", None)
        bias = None if self.skip_bias_add else self.bias
        if self._row_parallel:
            s = self.row_parallel_segments
            # keywords only when used: a patched row_parallel_forward may not take them
            kw = {**({"sequence_parallel": True} if self.sequence_parallel else {}),
                  **({"subtree": fp8.subtree} if fp8 is not None else {})}
            y = tpar.row_parallel_forward(x, self.weight, bias, self.tp_group, s, **kw)
        else:
            x = tpar.gather_sequence(x, self.tp_group) if self.sequence_parallel else tpar.copy_to_tp(x, self.tp_group)
            y = kernels.linear(x, self.weight, bias) if fp8 is None else fp8(x, self.weight, bias)
        return (y, self.bias) if self.skip_bias_add else (y, None)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        axis = {"weight": 0, "bias": 0} if self._partition_dim == 0 else {"weight": 1}
        return sharded_state_dict_tp1(self, prefix, sharded_offsets, metadata, axis)

    def backward_dw(self):  # called by Megatron only with delay_wgrad_compute; grads are already in .grad
        return None

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, skip_bias_add={self.skip_bias_add}"


class ConsistentColumnParallelLinear(_ConsistentLinearBase):
    """``linear_qkv`` / ``linear_fc1`` at TP=1 (``gather_output`` is moot with one rank)."""

    _partition_dim = 0


class ConsistentRowParallelLinear(_ConsistentLinearBase):
    """``linear_proj`` / ``linear_fc2`` at TP=1 (``input_is_parallel`` is moot with one rank)."""

    _partition_dim = 1
    _row_parallel = True

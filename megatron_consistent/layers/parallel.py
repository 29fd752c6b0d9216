"""Megatron process groups of the consistent layers, the parallel sizes they accept, and the ranks' backend.

Supported: tensor parallelism TP ∈ {1, 2, 4, 8} (the vocabulary log-softmax tree has 8 segments, so t must divide
8, and t must divide the model's row-parallel segment count S, :func:`row_parallel_segments`; shapes must divide
too — checked where the layer is built), pipeline parallelism
(stages pass activations unchanged, so any PP size is neutral; tested at 2),
data parallelism (replicas run their own batches: every op is batch-invariant),
expert parallelism (Megatron's EP groups with expert-tensor-parallel size 1, experts sharded over them:
``layers/moe.py``; at TP > 1 with sequence parallelism), and context parallelism CP ∈ {2, 4} for GPT models (dense and MoE)
(Megatron's load-balanced sequence layout, the keys / values all-gathered in position order:
``layers/context_parallel.py``; at TP 1 / 2 / 4 / 8 with or without sequence parallelism, any PP and DP; not with EP),
for the GPT layers (dense, and MoE with ``moe_impl="module"``: at TP > 1 experts sharded over
the TP ranks, the router and shared expert replicated).  See ``docs/parallel.md`` for the contract.

Sequence parallelism (TP > 1) is supported by the same layers.

Refused by name (:class:`UnsupportedConfigError`): sequence parallelism at TP = 1, context parallelism other than
1, 2, 4 or with EP > 1, expert
parallelism at TP > 1 without sequence parallelism, TP other than 1/2/4/8 or not dividing the model's S, hybrid
(Mamba) models at EP > 1 or CP > 1 (their modules call :func:`check_parallel_config` with a ``feature`` name; at TP / PP > 1
and with sequence parallelism they run: ``layers/hybrid.py``), FP8 / NVFP4 at TP > 1 where a rank's parts are not
whole scale blocks (``layers/fp8.py``), and
``build_consistent_model(moe_impl="megatron")`` (Megatron's MoELayer at EP > 1 / TP > 1 + SP: the framework entry
points, ``layers/moe_megatron.py``).

Initialization: world size 1 uses gloo over an in-process ``HashStore`` (no
TCP port, no file), so concurrent pytest processes never collide; a larger
world must already be initialized by the caller (e.g.
:func:`megatron_consistent.layers.tensor_parallel.recompute_logprobs_parallel`)
with a world size that TP * CP * PP divides (the quotient is the data-parallel size DP; EP must divide TP * DP, the
ranks of a pipeline stage, as Megatron's expert groups at expert-tensor-parallel size 1).
Megatron's ``parallel_state`` is initialized once with those sizes, and checked against them when already
initialized.

Ranks (:func:`rank_backend`, :func:`check_rank_devices`): on the CPU gloo, on CUDA NCCL with one CUDA device
per rank (rank r on ``cuda:r``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..config import ROW_PARALLEL_SEGMENTS_KEY, ArchConfig, UnsupportedConfigError, row_parallel_refusal

__all__ = ["HYBRID_FEATURE", "RANK_BACKENDS", "SUPPORTED_CP_SIZES", "SUPPORTED_TP_SIZES", "check_parallel_config",
           "check_parallel_sizes", "check_rank_devices", "global_layer_name", "init_cpu_process_group", "rank_backend",
           "row_parallel_segments"]

SUPPORTED_TP_SIZES = (1, 2, 4, 8)
SUPPORTED_CP_SIZES = (1, 2, 4)
HYBRID_FEATURE = "hybrid (Mamba) model"  # the ``feature`` of hybrid models: no expert or context parallelism
RANK_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}  # the torch.distributed backend of a job's ranks, by their device


def rank_backend(device: str) -> str:
    """The ``torch.distributed`` backend of ranks on ``device``: ``"gloo"`` on ``"cpu"``, ``"nccl"`` on ``"cuda"``."""
    if device not in RANK_BACKENDS:
        raise ValueError(f"rank device must be 'cpu' (gloo ranks) or 'cuda' (NCCL ranks, one CUDA device each), got {device!r}")
    return RANK_BACKENDS[device]


def global_layer_name(model, name: str) -> str:
    """``decoder.layers.<local>.`` -> ``decoder.layers.<global>.`` (pipeline stages number their layers from 0)."""
    parts = name.split(".")
    if len(parts) > 3 and parts[0] == "decoder" and parts[1] == "layers":
        parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
    return ".".join(parts)


def check_rank_devices(device: str, world: int, *, visible: int | None = None) -> None:
    """Refuse, before any process starts, ``world`` ranks on ``device`` that cannot each have their own device:
    on CUDA rank r runs on ``cuda:r``, so ``world`` CUDA devices must be visible (``visible``: default
    ``torch.cuda.device_count()``)."""
    rank_backend(device)
    if device != "cuda":
        return
    visible = torch.cuda.device_count() if visible is None else visible
    if visible < world:
        raise UnsupportedConfigError(f"{world} ranks on CUDA need {world} CUDA devices (one NCCL rank per device), "
                                     f"{visible} visible")


def check_parallel_sizes(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    sequence_parallel: bool = False,
    expert_model_parallel_size: int = 1,
    *,
    feature: str | None = None,
) -> None:
    """Refuse every parallelism the consistent layers do not implement, naming it.

    ``feature``: a part without expert and context parallelism (``"hybrid (Mamba) model"``): then EP and CP must be 1.
    """
    refused = []
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if tp not in SUPPORTED_TP_SIZES:
        refused.append(f"tensor parallelism of size {tp} (tensor_model_parallel_size must divide 8: 1, 2, 4 or 8)")
    if pp < 1:
        refused.append(f"pipeline_model_parallel_size={pp}")
    cp = context_parallel_size
    if cp not in SUPPORTED_CP_SIZES:
        refused.append(f"context parallelism of size {cp} (context_parallel_size must be 1, 2 or 4)")
    if sequence_parallel and tp == 1:
        refused.append("sequence parallelism without tensor parallelism (sequence_parallel=True needs TP > 1)")
    ep = expert_model_parallel_size
    if ep < 1:
        refused.append(f"expert_model_parallel_size={ep}")
    elif ep != 1 and cp != 1:
        refused.append(f"context parallelism with expert parallelism (context_parallel_size={cp}, "
                       f"expert_model_parallel_size={ep})")
    elif ep != 1 and tp != 1 and not sequence_parallel:
        refused.append(f"expert parallelism at TP > 1 without sequence parallelism (expert_model_parallel_size={ep}, "
                       f"tensor_model_parallel_size={tp}: the TP ranks would send the EP group the same tokens; "
                       "Megatron's MoE at TP > 1 asks for sequence parallelism too)")
    if refused:
        raise UnsupportedConfigError("the consistent Megatron layers do not support: " + "; ".join(refused))
    if feature is not None and ep != 1:
        raise UnsupportedConfigError(
            f"{feature} with expert parallelism (expert_model_parallel_size={ep}) is not supported by the consistent "
            "layers — tensor, pipeline and sequence parallelism are (MoE GPT layers support EP)")
    if feature is not None and cp != 1:
        raise UnsupportedConfigError(
            f"{feature} with context parallelism (context_parallel_size={cp}) is not supported by the consistent "
            "layers (the Mamba scan runs sequentially over the whole sequence) — tensor, pipeline and sequence "
            "parallelism are (GPT layers support CP)")


def row_parallel_segments(config) -> int:
    """S, the K segments of every row-parallel linear's tree, for the layers built with a Megatron config: its
    ``consistent_row_parallel_segments`` (set from the ArchConfig by ``make_transformer_config``; on a framework's
    own config, set by hand like ``consistent_rope``), else the ArchConfig default (8)."""
    return getattr(config, ROW_PARALLEL_SEGMENTS_KEY, ArchConfig.row_parallel_segments)


def check_parallel_config(config, *, feature: str | None = None) -> None:
    """:func:`check_parallel_sizes` on a Megatron ``TransformerConfig`` / ``ModelParallelConfig``, and its S
    (:func:`row_parallel_segments`: one of 1, 2, 4, 8 that the TP size divides)."""
    tp = getattr(config, "tensor_model_parallel_size", 1)
    check_parallel_sizes(
        tp,
        getattr(config, "pipeline_model_parallel_size", 1),
        getattr(config, "context_parallel_size", 1),
        bool(getattr(config, "sequence_parallel", False)),
        getattr(config, "expert_model_parallel_size", 1),
        feature=feature,
    )
    reason = row_parallel_refusal(row_parallel_segments(config), tp)
    if reason:
        raise UnsupportedConfigError(f"the consistent Megatron layers do not support: {reason}")


def init_cpu_process_group(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    sequence_parallel: bool = False,
) -> None:
    """Initialize ``torch.distributed`` (gloo; world size 1 unless the caller did) and Megatron model parallel, once.

    The data-parallel size is what the world leaves: ``world / (TP * CP * PP)``; EP must divide ``TP * DP`` (the
    expert groups at expert-tensor-parallel size 1, Megatron's layout for them)."""
    tp, pp, ep, cp = tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size, context_parallel_size
    check_parallel_sizes(tp, pp, cp, sequence_parallel, expert_model_parallel_size=ep)
    from megatron.core import parallel_state

    layout = f"TP={tp}" + (f" x CP={cp}" if cp != 1 else "") + f" x PP={pp}" + (f" x EP={ep}" if ep != 1 else "")
    if not dist.is_initialized():
        if tp * pp * ep * cp != 1:
            raise UnsupportedConfigError(
                f"{layout} needs torch.distributed initialized by the caller with a world size that TP x CP x PP "
                "divides (the quotient is the data-parallel size; see layers.distributed.recompute_logprobs_parallel)")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    if world % (tp * cp * pp):
        raise UnsupportedConfigError(f"torch.distributed is initialized with world size {world}; {layout} needs "
                                     "a world size that TP x CP x PP divides (the quotient is the data-parallel size)")
    if (world // pp) % ep:
        raise UnsupportedConfigError(
            f"torch.distributed is initialized with world size {world}; EP={ep} must divide the ranks of a pipeline "
            f"stage, TP x DP = {world // pp} (expert-parallel groups are carved from them)")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, pp, context_parallel_size=cp, expert_model_parallel_size=ep,
                                                 expert_tensor_parallel_size=1)
        if torch.cuda.is_available():  # Megatron's stock core attention forks the model-parallel CUDA RNG state on GPU
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(0)
    else:
        got = (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size(),
               parallel_state.get_context_parallel_world_size())
        got_ep = parallel_state.get_expert_model_parallel_world_size()
        check_parallel_sizes(*got, sequence_parallel, expert_model_parallel_size=got_ep)
        if (*got, got_ep) != (tp, pp, cp, ep):
            raise UnsupportedConfigError(f"Megatron parallel_state is initialized with TP={got[0]}, PP={got[1]}, CP={got[2]}, "
                                         f"EP={got_ep}; this model asks for TP={tp}, PP={pp}, CP={cp}, EP={ep}")

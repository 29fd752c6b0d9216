"""MoE block for Megatron's ``TransformerLayer.mlp`` slot, computed by :mod:`megatron_consistent.kernels.moe`.

:class:`ConsistentMoELayer` replaces Megatron-Core's ``MoELayer`` (router,
token dispatcher, experts) for the MoE layers of the consistent spec: the
router is ``kernels.moe.route`` (float32 logits through the batch-invariant
linear, deterministic scores, stable top-k: among exactly equal scores the
lowest expert index wins), the experts are ``kernels.moe.moe_experts`` (one
batch-invariant SwiGLU call per expert over the tokens routed to it, weighted
float32 combine in slot order, one rounding), plus the optional shared expert
with its sigmoid gate (Qwen2-MoE).

Tensor parallelism (TP = t > 1; docs/parallel.md): the experts are **sharded** over the TP ranks -- rank r holds
experts ``[r E/t, (r+1) E/t)`` (expert parallelism inside the TP group) -- while the router and the shared expert
are replicated.  Every rank routes all tokens (under sequence parallelism the chunks are all-gathered first:
concatenation, exact), forms the (token, slot) outputs of the pairs routed to its own experts through the same
row-invariant expert MLP, zeros for the others' pairs (:func:`kernels.moe.owned_expert_outputs`), and the ranks'
``[T, k, H]`` tensors are summed (:func:`.tensor_parallel.sum_owned_slots`: each element one value and t-1 zeros,
exact in any order); then every rank combines in slot order exactly as at TP = 1 (under sequence parallelism it keeps
its own chunk).  So the bits are the TP = 1 bits, whatever t.  Block-FP8 experts (``layers/fp8.py``
:class:`~.fp8.FP8MoEBinding`) take the same path: each rank quantizes its whole experts on their own grids (the TP = 1
values and scales), forms its pairs' outputs with the FP8 expert kernels, and the FP8 shared expert joins the
combine.  Megatron's token dispatchers (all-gather /
all-to-all) are not used; every token's expert result is independent of which other tokens share the expert
(row-invariant linear), which is what a dispatcher would have to preserve.

Expert parallelism (EP = e > 1; Megatron's EP groups at expert-tensor-parallel size 1, carved from the ranks of a
pipeline stage; at TP > 1 with sequence parallelism, each rank then holding its own chunk): rank r of the EP group
holds experts ``[r E/e, (r+1) E/e)`` (marked ``allreduce=False``, as Megatron marks its expert weights, so its DDP
reduces their gradients over the expert-data-parallel group). The ranks run different batches: each routes its own
tokens and sends every (token, slot) pair's row to the rank holding its expert (:func:`pairs_through_expert_ranks`:
:func:`.tensor_parallel.exchange_rows`, bytes only), which puts the rows it receives through the same row-invariant
expert MLP and sends each output back; each rank then combines its own tokens' outputs in slot order as at EP = 1
(under sequence parallelism the router and the shared expert see the rank's chunk only: their weights are marked
``sequence_parallel``, as at TP > 1 without EP). So a rank's logits are the bits of its batch alone on one rank,
whatever the other ranks' batches (their sizes may differ). What moves: a rank's ``T x k`` pair rows out and their
outputs back (model dtype, ``H`` each) -- a token dispatcher's all-to-all -- and a ``[e, e]`` table of pair counts.
Block-FP8 experts take the same path: each EP rank quantizes its whole experts on their own grids (the TP = 1 values
and scales) and runs the rows it receives through the FP8 expert kernels; the FP8 shared expert (whole on every rank)
joins the TP = 1 combine.

Parameters (the "Megatron layout" the converters use; stacked per expert)::

    router.weight                    [E, H]
    experts.linear_fc1.weight        [E, 2I, H]   (per expert: gate rows, then up rows)
    experts.linear_fc2.weight        [E, H, I]
    shared_experts.linear_fc1.weight [2Is, H]     (when shared_expert_intermediate_size > 0)
    shared_experts.linear_fc2.weight [H, Is]
    shared_experts.gate_weight       [1, H]       (Qwen2-MoE's shared_expert_gate)
    router.expert_bias               [E] float32  (Nemotron-H e_score_correction_bias; requires_grad=False)

Nemotron-H (``arch.hidden_act == "relu2"``): the experts and the shared expert are
non-gated (``linear_fc1`` holds the up rows only: ``[E, I, H]`` / ``[Is, H]``), the
shared expert has no gate, routing is sigmoid + selection bias + group limit +
``routed_scaling_factor`` (``kernels.moe.route_logits``).

The auxiliary load-balancing loss (``router_aux_loss_coef`` > 0, training
mode with autograd on) is kept on the side in :attr:`ConsistentMoELayer.last_aux_loss`;
:func:`moe_aux_loss` sums it over the model for the trainer to add to its
loss.  It never changes a forward value and is not added implicitly.
:attr:`ConsistentMoELayer.last_routes` holds the last forward's experts
``[s*b, k]`` (tokens in ``[s, b]`` order) for routing comparisons; :attr:`ConsistentMoELayer.capture`
(diagnostics, ``None`` = off) is called with each forward's router logits and experts.

Context parallelism (CP > 1, ``layers/context_parallel.py``): a rank routes and combines its share of the sequence
(every step is per token: the CP = 1 bits). :attr:`ConsistentMoELayer.last_routes` and the load-balancing loss are
the whole sequence's (the routes / router logits of the CP ranks all-gathered in position order): the loss is the
CP = 1 value on every CP rank, and its gradient reaches each rank's router logits for that rank's tokens.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from ..config import UnsupportedConfigError
from ..kernels import moe as kmoe
from . import tensor_parallel as tpar
from .context_parallel import cp_group, gather_cp_rows

__all__ = ["ConsistentMoELayer", "StockMoELayer", "collect_routes", "moe_aux_loss", "moe_layer_spec", "replay_routes"]


def _init(shape, init_method, dtype):
    master = torch.empty(*shape, dtype=torch.float32)
    if init_method is not None:
        if len(shape) == 3:
            for e in range(shape[0]):
                init_method(master[e])
        else:
            init_method(master)
    else:
        nn.init.normal_(master, std=0.02)
    return nn.Parameter(master.to(dtype))


def _mark(p: nn.Parameter, sequence_parallel: bool = False) -> nn.Parameter:
    """A parameter every TP rank holds whole; ``sequence_parallel``: its gradient on a rank covers that rank's
    sequence chunk only, so Megatron's ``finalize_model_grads`` sums it over the TP group (as for the norms)."""
    p.tensor_model_parallel = False
    p.allreduce = True
    p.sequence_parallel = sequence_parallel
    return p


def _expert_shard(full: nn.Parameter, rank: int, size: int, expert_parallel: bool = False) -> nn.Parameter:
    """This rank's experts ``[rank E/size, (rank+1) E/size)`` of a stack ``[E, ...]``, marked as Megatron marks a
    tensor-parallel weight split along dim 0 (a TP rank's) or an expert-parallel weight (``expert_parallel``:
    ``allreduce=False``); ``shard_like`` / ``unshard_like`` / ``sharded_state_dict`` read the marks."""
    n = full.shape[0] // size
    p = nn.Parameter(full.data[rank * n:(rank + 1) * n].clone())
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = not expert_parallel, 0, 1
    p.allreduce, p.sequence_parallel = not expert_parallel, False
    return p


class _Container(nn.Module):
    pass


class ConsistentMoELayer(nn.Module):
    """``forward(x [s, b, H]) -> (out [s, b, H], None)``: router + experts (+ shared expert) via the MoE kernels."""

    capture = None  # diagnostics: a callable(router_logits [s*b, E], experts [s*b, k]) set on an instance; None = off

    def __init__(self, config, *, arch, layer_number: int | None = None, **unused):
        super().__init__()
        a = arch
        dt = config.params_dtype
        init = getattr(config, "init_method", None)
        out_init = getattr(config, "output_layer_init_method", None)
        H, E, inter = a.hidden_size, a.num_experts, a.moe_intermediate_size
        self.arch, self.top_k = a, a.num_experts_per_tok
        # Nemotron-H (hybrid): non-gated relu2 experts (fc1 = up rows only), sigmoid router with a float32
        # selection bias (HF e_score_correction_bias; not trained), shared expert without a gate.
        self.activation, fc1_rows = ("swiglu", 2) if a.mlp_gated else ("relu2", 1)
        # TP > 1: the experts sharded over the TP ranks (module docstring), the rest replicated
        self.tp = getattr(config, "tensor_model_parallel_size", 1)
        self.sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        if E % self.tp:
            raise UnsupportedConfigError(f"num_experts={E} is not divisible by TP={self.tp} (the experts are sharded "
                                         "over the TP ranks)")
        sp = self.sequence_parallel
        self.router = _Container()
        self.router.weight = _mark(_init((E, H), init, dt), sp)
        if a.moe_score_bias:
            self.router.expert_bias = _mark(nn.Parameter(torch.zeros(E, dtype=torch.float32), requires_grad=False))
        self.experts = _Container()
        self.experts.linear_fc1 = _Container()
        self.experts.linear_fc2 = _Container()
        fc1, fc2 = _init((E, fc1_rows * inter, H), init, dt), _init((E, H, inter), out_init, dt)  # the TP = 1 draws
        ep_group = tpar.ep_group()
        self.ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        if E % self.ep:
            raise UnsupportedConfigError(f"num_experts={E} is not divisible by EP={self.ep} (the experts are sharded "
                                         "over the EP ranks)")
        if self.tp > 1 or self.ep > 1:  # over the EP group where there is one, else over the TP ranks
            size = self.ep if self.ep > 1 else self.tp
            rank = dist.get_rank(ep_group) if self.ep > 1 else tpar.tp_rank()
            self.expert_offset = rank * (E // size)
            fc1, fc2 = (_expert_shard(w, rank, size, expert_parallel=self.ep > 1) for w in (fc1, fc2))
        else:
            self.expert_offset = 0
            fc1, fc2 = _mark(fc1), _mark(fc2)
        self.experts.linear_fc1.weight, self.experts.linear_fc2.weight = fc1, fc2
        self.shared_experts = None
        if a.shared_expert_intermediate_size:
            s = a.shared_expert_intermediate_size
            self.shared_experts = _Container()
            self.shared_experts.linear_fc1 = _Container()
            self.shared_experts.linear_fc2 = _Container()
            self.shared_experts.linear_fc1.weight = _mark(_init((fc1_rows * s, H), init, dt), sp)
            self.shared_experts.linear_fc2.weight = _mark(_init((H, s), out_init, dt), sp)
            self.shared_experts.gate_weight = _mark(_init((1, H), init, dt), sp) if not a.is_hybrid else None
        self.aux_loss_coef = a.router_aux_loss_coef
        self.last_routes: torch.Tensor | None = None
        self.last_aux_loss: torch.Tensor | None = None
        self.layer_number = layer_number

    def set_layer_number(self, n: int) -> None:
        self.layer_number = n

    def forward(self, x: torch.Tensor, padding_mask=None, **unused):
        ep_group = tpar.ep_group() if self.ep > 1 else None
        group = tpar.tp_group() if self.tp > 1 and ep_group is None else None  # experts over the TP ranks
        if group is not None and self.sequence_parallel:  # every rank routes all tokens
            x = tpar.gather_sequence(x, group)
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        z = kmoe.router_logits(h, self.router.weight)
        a = self.arch
        w, experts = kmoe.route_logits(z, self.top_k, a.moe_scoring, getattr(self.router, "expert_bias", None), a.norm_topk_prob,
                                       a.moe_n_group, a.moe_topk_group, a.routed_scaling_factor)
        self.last_routes = experts.detach()
        if ep_group is not None and self.tp > 1:  # sequence parallelism: the whole sequence's routes, as at EP = 1
            self.last_routes = tpar.gather_sequence(self.last_routes, tpar.tp_group())
        if cp_group() is not None:  # context parallelism: the whole sequence's routes, as at CP = 1
            self.last_routes = gather_cp_rows(self.last_routes, shape[0])
        if self.capture is not None:
            self.capture(z, experts)
        shared = None
        if self.shared_experts is not None:
            se = self.shared_experts
            shared = (se.linear_fc1.weight, se.linear_fc2.weight, se.gate_weight)
        fp8 = getattr(self, "fp8", None)  # layers/fp8.py enable_fp8: block-FP8 experts on the bf16 masters, STE backward
        if group is not None or ep_group is not None:
            n_local, outputs = self.experts.linear_fc1.weight.shape[0], self._expert_outputs(fp8)
            if group is not None:  # experts over the TP ranks: the owned pairs' outputs, summed over the ranks
                h_experts = h if self.sequence_parallel else tpar.copy_to_tp(h, group)
                mine = kmoe.owned_pair_outputs(h_experts, experts, self.expert_offset, n_local, shape[-1], outputs)
                y = tpar.sum_owned_slots(mine, group, self.sequence_parallel)
            else:  # experts over the EP ranks: each pair's row to its expert's rank, its output back
                y = pairs_through_expert_ranks(h, experts, ep_group, n_local, outputs)
            out = fp8.combine(self, h, y, w) if fp8 is not None else kmoe.combine_experts(h, y, w, shared, self.activation)
        elif fp8 is not None:
            out = fp8(self, h, experts, w)
        else:
            out = kmoe.moe_experts(h, experts, w, self.experts.linear_fc1.weight, self.experts.linear_fc2.weight, shared,
                                   self.activation)
        self.last_aux_loss = None
        if self.training and self.aux_loss_coef > 0 and torch.is_grad_enabled():
            z_all, experts_all = z, experts
            if cp_group() is not None:  # the whole sequence's loss, as at CP = 1 (backward: this rank's tokens' part)
                z_all, experts_all = gather_cp_rows(z, shape[0]), self.last_routes
            self.last_aux_loss = self.aux_loss_coef * kmoe.load_balancing_loss(z_all, experts_all, self.arch.num_experts)
        out = out.reshape(shape)
        if group is not None and self.sequence_parallel:  # this rank's chunk (the gradient reaches it alone)
            out = out.chunk(self.tp, dim=0)[tpar.tp_rank(group)]
        return out, None

    def _expert_outputs(self, fp8):
        """``outputs(rows [n, H], local_experts [n, k]) -> [n, k, H]``: the rows through this rank's experts (local
        indices; ``kernels.moe.expert_outputs``' contract), model-dtype or block-FP8 (``fp8``: the layer's
        :class:`~.fp8.FP8MoEBinding`, which quantizes the rank's whole experts on their own grids)."""
        if fp8 is not None:
            return fp8.expert_outputs(self)
        w1, w2, act = self.experts.linear_fc1.weight, self.experts.linear_fc2.weight, self.activation
        return lambda rows, local: kmoe.expert_outputs(rows, local, w1, w2, act)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        from .linear import sharded_state_dict_tp1

        names = ("experts.linear_fc1.weight", "experts.linear_fc2.weight")
        by_tp = self.tp > 1 and self.ep == 1
        state = sharded_state_dict_tp1(self, prefix, sharded_offsets, metadata, dict.fromkeys(names, 0) if by_tp else {})
        if self.ep > 1:  # split over the EP ranks, replicated over the expert-data-parallel ranks (Megatron's experts)
            for n in names:
                state[prefix + n] = tpar.expert_sharded_tensor(self.get_parameter(n), prefix + n, sharded_offsets)
        return state


def pairs_through_expert_ranks(hidden: torch.Tensor, experts: torch.Tensor, group, n_local: int, outputs) -> torch.Tensor:
    """``[T, k, H]``: this rank's (token, slot) pairs (``experts [T, k]``, global expert indices) through their experts,
    held over the EP ``group`` in runs of ``n_local`` (rank r: experts ``[r E/e, (r+1) E/e)``).  Each pair's row goes
    to its expert's rank (pairs grouped by rank, pair order within: :func:`.tensor_parallel.exchange_rows`), which puts
    the rows it receives through ``outputs(rows [n, H], local_experts [n, 1]) -> [n, 1, H]`` (its experts by local
    index, :func:`kernels.moe.expert_outputs`' contract: model-dtype or block-FP8, as
    :func:`kernels.moe.owned_pair_outputs` takes it) -- row-invariant, so each output is the bits it has with every
    expert on one rank -- and sends each output back the way its row came.  Differentiable (the exchanges' adjoints
    carry the gradients back)."""
    t, k = experts.shape
    e, rank = dist.get_world_size(group), dist.get_rank(group)
    flat = experts.reshape(-1)
    dest = torch.div(flat, n_local, rounding_mode="floor")
    order = torch.sort(dest, stable=True).indices
    counts = torch.bincount(dest, minlength=e)
    send, recv = counts.tolist(), tpar.incoming_counts(counts, group)
    rows = tpar.exchange_rows(hidden[torch.div(order, k, rounding_mode="floor")], send, recv, group)
    local = tpar.exchange_rows(flat[order], send, recv, group) - rank * n_local
    y = outputs(rows, local[:, None])[:, 0]
    back = tpar.exchange_rows(y, recv, send, group)
    return back.new_zeros(t * k, back.shape[-1]).index_copy(0, order, back).view(t, k, -1)


def moe_layer_spec(dense_layer_spec, arch):
    """A copy of the consistent dense TransformerLayer spec with ``mlp`` = :class:`ConsistentMoELayer`."""
    import copy

    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = copy.deepcopy(dense_layer_spec)
    spec.submodules.mlp = ModuleSpec(module=ConsistentMoELayer, params={"arch": arch})
    return spec


def collect_routes(model) -> dict[int, torch.Tensor]:
    """Layer index (0-based) -> the last forward's experts ``[s*b, k]`` of every MoE layer of a GPTModel."""
    out = {}
    for i, layer in enumerate(model.decoder.layers):
        mlp = getattr(layer, "mlp", None)  # Megatron's MoELayer (layers/moe_megatron.py): its router keeps them
        routes = mlp.last_routes if isinstance(mlp, ConsistentMoELayer) else getattr(getattr(mlp, "router", None), "last_routes", None)
        if routes is not None:
            out[i] = routes
    return out


def moe_aux_loss(model) -> torch.Tensor | None:
    """Sum of the last forward's load-balancing losses over the MoE layers (None when there are none)."""
    losses = [layer.mlp.last_aux_loss for layer in model.decoder.layers
              if isinstance(layer.mlp, ConsistentMoELayer) and layer.mlp.last_aux_loss is not None]
    return sum(losses[1:], losses[0]) if losses else None


class StockMoELayer(ConsistentMoELayer):
    """BASELINE MoE block with ordinary torch ops (no consistency claimed); same parameters as :class:`ConsistentMoELayer`.

    Router ``F.linear`` in the model dtype, ``torch.softmax`` in float32,
    ``torch.topk``, per-expert ``F.linear`` SwiGLU in the model dtype, each
    expert's weighted output accumulated with ``index_add_`` in the model dtype
    (the pattern of Megatron's SequentialMLP / HF's loop).  Used only for the
    stock recompute of ``megatron-consistent check``; Megatron's own MoELayer
    is not built (its token dispatchers need a distributed setup beyond the
    CPU check).

    Routing replay (the routing-replay baseline of ``check``): while
    :attr:`forced_routes` = ``(experts [s*b, k] int64, mask [s*b] bool)`` is set
    (see :func:`replay_routes`), the rows with ``mask`` use the given experts
    instead of the block's own top-k; their weights are the block's own
    float32 softmax at those experts, slots re-ordered by descending weight
    (as ``torch.topk`` orders them), then renormalised when ``norm_topk_prob``.
    Rows without ``mask`` keep their own top-k.
    """

    forced_routes: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, padding_mask=None, **unused):
        import torch.nn.functional as F

        shape = x.shape
        h = x.reshape(-1, shape[-1])
        probs = torch.softmax(F.linear(h, self.router.weight).float(), dim=-1)
        w, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.forced_routes is not None:
            forced, mask = self.forced_routes
            if forced.shape != experts.shape or mask.shape != experts.shape[:1]:
                raise ValueError(f"forced routes {tuple(forced.shape)} / mask {tuple(mask.shape)} do not match the "
                                 f"layer's tokens x top-k {tuple(experts.shape)}")
            experts = torch.where(mask[:, None].to(experts.device), forced.to(experts.device, experts.dtype), experts)
            w, order = torch.sort(probs.gather(-1, experts), dim=-1, descending=True, stable=True)
            experts = experts.gather(-1, order)
        if self.arch.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        w = w.to(h.dtype)
        self.last_routes = experts.detach()
        out = torch.zeros_like(h)
        inter = self.arch.moe_intermediate_size
        for e in torch.unique(experts).tolist():
            rows, slot = (experts == e).nonzero(as_tuple=True)
            gu = F.linear(h[rows], self.experts.linear_fc1.weight[e])
            y = F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], self.experts.linear_fc2.weight[e])
            out = out.index_add(0, rows, y * w[rows, slot, None])
        if self.shared_experts is not None:
            se = self.shared_experts
            n = se.linear_fc1.weight.shape[0] // 2
            gu = F.linear(h, se.linear_fc1.weight)
            ys = F.linear(F.silu(gu[:, :n]) * gu[:, n:], se.linear_fc2.weight)
            out = out + torch.sigmoid(F.linear(h, se.gate_weight)) * ys
        return out.reshape(shape), None


@contextmanager
def replay_routes(model, routes: dict[int, tuple[torch.Tensor, torch.Tensor]]):
    """Force the routes of a stock GPTModel's :class:`StockMoELayer` blocks inside the ``with``.

    ``routes``: layer index (0-based) -> ``(experts [s*b, k], mask [s*b])`` in the
    model's ``[s, b]`` token order (the order :func:`collect_routes` returns).
    """
    blocks = {i: layer.mlp for i, layer in enumerate(model.decoder.layers) if isinstance(layer.mlp, StockMoELayer)}
    unknown = set(routes) - set(blocks)
    if unknown:
        raise ValueError(f"layers {sorted(unknown)} have no StockMoELayer (stock MoE layers: {sorted(blocks)})")
    try:
        for i, r in routes.items():
            blocks[i].forced_routes = r
        yield
    finally:
        for b in blocks.values():
            b.forced_routes = None


def stock_moe_block_spec(layer_spec, arch):
    """TransformerBlockSubmodules for the stock baseline: ``layer_spec`` per layer, :class:`StockMoELayer` in MoE layers."""
    import copy

    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

    specs = []
    for i in range(arch.num_layers):
        s = layer_spec
        if arch.layer_is_moe(i):
            s = copy.deepcopy(layer_spec)
            s.submodules.mlp = ModuleSpec(module=StockMoELayer, params={"arch": arch})
        specs.append(s)
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=LayerNormImpl)

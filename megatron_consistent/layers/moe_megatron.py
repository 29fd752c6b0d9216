"""Megatron-Core's own ``MoELayer`` (and its token dispatchers) with the consistent router, experts and combine.

The MoE layers of the consistent GPT model can be Megatron-Core's **unmodified
``MoELayer`` class** (``megatron/core/transformer/moe/moe_layer.py``), built
from ``MoESubmodules`` whose three builders are ours.  What runs where, per
forward of one MoE layer (``x [s, b, H]``, ``T = s*b`` tokens, top-k):

=====================================  =================================================================
Megatron code (used as is)             ours (this module, computing through :mod:`..kernels.moe`)
=====================================  =================================================================
``MoELayer.forward`` / ``route`` /     :class:`ConsistentTopKRouter` (a ``TopKRouter`` subclass):
``preprocess`` / ``dispatch`` /        float32 logits ``linear(x, W_router, out_dtype=float32)``,
``routed_experts_compute`` /           ``kmoe.route_logits`` (deterministic softmax/sigmoid, stable
``combine`` / ``postprocess``          top-k: exact ties -> lowest expert index, ``norm_topk_prob``);
                                       returns Megatron's ``(probs [T, E] float32, routing_map [T, E])``
token dispatcher chosen by             :class:`ConsistentExperts` (the experts slot; at EP = e its E/e
``moe_token_dispatcher_type``:         experts): each expert's rows through ``kmoe.expert_mlp``
``allgather`` (CPU and GPU) or         (batch-invariant linear -> silu_and_mul -> linear, one call per
``alltoall`` (GPU: Megatron creates    expert over its contiguous rows: row-invariant, so a token's result
a ``torch.cuda.Stream``) — their       does not depend on the tokens sharing its expert), then the
``permute`` / ``unpermute``            **combine of our contract**: per token ``acc = sum_j w_j *
(``scatter_add``), all-gather /        float32(y_j)`` in top-k SLOT order (float32, ``w_j`` = the
reduce-scatter or ``all_to_all`` /     dispatched ``permuted_probs``), formed on the rank holding the
``sort_chunks_by_idxs`` (identities    token's slot-0 expert and written to that row; the token's other
at EP=1)                               k-1 rows are exact zeros.  Output float32.
``TopKRouter`` aux-loss machinery      :class:`ConsistentSharedExperts`: ``g * float32(y_shared)``
(``apply_z_loss``, ``_apply_aux_loss``  float32 (``g`` = float32 sigmoid gate or 1)
/ seq / global, ``MoEAuxLossAuto-
Scaler``, the aux-loss tracker)
=====================================  =================================================================

Why the values are exactly those of :class:`.moe.ConsistentMoELayer` (and of
the vLLM plugin): Megatron's ``unpermute`` sums a token's k rows with
``scatter_add`` into zeros (order unspecified; atomics on GPU).  Here every
token has one row holding its float32 ``acc`` and k-1 rows of ``+0.0``; adding
``+0.0`` is exact and ``acc`` is never ``-0.0`` (a float32 sum started from
``+0.0`` cannot round to ``-0.0``), so the unpermute is a pure gather in any
order.  ``MoELayer.postprocess`` then adds the shared-expert output:
``acc + g * float32(y_shared)``, the same float32 op as the kernel combine.
The layer's output is float32; the MoE layers' ``mlp_bda``
(:func:`consistent_moe_bias_dropout_add`) rounds it **once** to the model
dtype and then does the usual residual add — bitwise the kernel path's
``round(acc)`` followed by ``add_residual``.

Row layout: the experts slot gets the dispatched rows in Megatron's permute order (expert-major, tokens ascending — the
order of ``permute`` in 0.16 and 0.19, both dispatchers at EP = 1).  The router hands the slot-ordered experts and its input to
the experts through a per-layer :class:`RoutingContext`; the experts derive each row's (token, slot) from them
(:func:`dispatched_pairs`) and **verify** it on every forward (row count, ``tokens_per_expert``, and ``dispatched rows
== input[token of row]`` exactly), raising if Megatron ever permutes differently.

Expert parallelism (EP = e > 1; Megatron's EP group at expert-tensor-parallel size 1, carved from the TP x DP ranks of
a pipeline stage; :func:`.tensor_parallel.ep_group`): EP rank r holds experts ``[r E/e, (r+1) E/e)`` (drawn as the
EP = 1 stack, then sliced; ``allreduce=False``, Megatron's expert mark, so its DDP reduces their gradients over the
expert-data-parallel group; ``sharded_state_dict`` split along the expert axis over the EP group,
:func:`.tensor_parallel.expert_sharded_tensor`, so an EP = e ``dist_checkpointing`` save loads at EP = 1 bit for bit).
Both dispatchers (megatron-core 0.16.1, read and tested; another version's order is checked by the per-forward
verification below) hand rank r its local experts' rows **local-expert-major, within an expert the tokens ascending in the
EP group's rank-major token order** (allgather: the ``[T_all, E]`` routing map all-gathered over the EP group, its local
columns permuted; alltoall: the all-to-all's ``[source rank][local expert]`` chunks sorted by ``sort_chunks_by_idxs`` to
``[local expert][source rank]``, each source rank's tokens ascending).  The experts all-gather the ranks' routes and
router inputs (:func:`.tensor_parallel.row_counts` / :func:`.tensor_parallel.gather_rows`: concatenation; the ranks'
token counts may differ under alltoall), derive every row's (group token, slot) from them and verify the rows as at
EP = 1.  Combine (:func:`slot_order_rows`): each rank forms the float32 products ``w_j * float32(y_j)`` of its own rows
(the op the EP = 1 combine forms); a token is *owned* by the rank holding its slot-0 expert; every rank sends each
product to its token's owner (:func:`.tensor_parallel.exchange_rows`: one all-to-all, bytes only, grouped by owner in
the rank's row order), and the owner, which derives from the EP group's routes which pairs each rank sends it and in
which order, places them at their (token, slot) -- each pair arrives once.  The owner sums a token's k products in
slot order from ``+0.0``, exactly the EP = 1 ``acc``, and writes it into the token's slot-0 row; every other row of the
token, on every rank, is ``+0.0``.
Megatron's combine then adds one value and zeros per element: the ``unpermute`` ``scatter_add`` and the allgather
dispatcher's reduce-scatter over the EP group, or the alltoall dispatcher's all-to-all back and ``unpermute`` on the
token's rank -- exact in any order.  So every rank's logits are the bits of its batch at EP = 1 on one rank.  Backward:
the exchange's adjoint sends each product's gradient back to the rank that formed it, so each expert's weights get
the gradients of every EP rank's tokens routed to it; inputs and router weights get theirs through Megatron's dispatch
adjoints.  What moves beyond Megatron's own dispatch: a rank's products, ``N x H`` float32 (its rows; at top-1 each
product is formed on its owner and stays), the routes and router inputs (gathered, for the layout check and the
exchange's plan).

Tensor parallelism (TP = t > 1, with sequence parallelism only: Megatron's MoELayer trains at TP > 1 only so; expert
TP 1): each rank routes its own sequence chunk; the dispatchers work over the EP group (at EP = 1, no collective: each
rank runs all experts on its chunk); the experts are marked ``allreduce=False`` (their gradients summed over the
expert-data-parallel group, which holds the TP ranks), the shared experts ``sequence_parallel`` (a rank's gradient
covers its chunk: Megatron's ``finalize_model_grads`` sums them over the TP group), the router's weight is marked by
Megatron's ``TopKRouter``.  The router's ``last_routes`` then hold the rank's chunk's routes.

Scope: expert TP 1, TP > 1 only with sequence parallelism; no token dropping (capacity factor), no permute/router
fusion (TE), no shared-expert overlap, no latent MoE, no expert bias / input jitter / sinkhorn; each refused by name
(:class:`UnsupportedConfigError`, :func:`check_megatron_moe_config`) before anything is built.
:func:`.model.build_consistent_model` builds this path at TP = PP = EP = 1 only (its ranks may be gloo CPU ranks, where
Megatron's dispatcher collectives allocate on CUDA); the framework entry points (:mod:`.entry_points`) build it at any
EP and at TP > 1 with sequence parallelism.

Aux loss: with ``moe_aux_loss_coeff`` > 0 (``build_consistent_model(...,
moe_aux_loss_coeff=...)``), training mode and autograd on, Megatron's own
machinery attaches the load-balancing loss to ``probs`` through
``MoEAuxLossAutoScaler`` (identity forward); its token counts use our routing
map.  Forward values never change; gradients then include the aux loss, as
in Megatron.  The default coefficient is 0 (the module path's convention:
nothing is added implicitly).

Parameters are named exactly as in :class:`.moe.ConsistentMoELayer`
(``router.weight [E, H]``, ``experts.linear_fc1.weight [E, 2I, H]``,
``experts.linear_fc2.weight [E, H, I]``, ``shared_experts.linear_fc1.weight``,
``shared_experts.linear_fc2.weight``, ``shared_experts.gate_weight [1, H]``),
so state dicts, converters and the HF export are shared, and the same seed
gives the same weights (same construction / RNG order).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from ..config import UnsupportedConfigError
from ..kernels import add_residual
from ..kernels import moe as kmoe
from . import tensor_parallel as tpar
from .moe import _Container, _expert_shard, _init, _mark

__all__ = [
    "ConsistentExperts", "ConsistentSharedExperts", "ConsistentTopKRouter", "DISPATCHERS", "RoutingContext",  # noqa: F822 (module __getattr__)
    "check_megatron_moe_arch", "check_megatron_moe_config", "consistent_moe_bias_dropout_add", "megatron_moe_config_kwargs",
    "megatron_moe_layer_spec",
]

DISPATCHERS = ("allgather", "alltoall")


class RoutingContext:
    """Per-layer hand-over from the router to the experts of one MoE layer (one forward at a time).

    ``routes``: slot-ordered experts ``[T, k]`` int64; ``hidden``: the router's input ``[T, H]``.
    """

    def __init__(self):
        self.routes: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None

    def __deepcopy__(self, memo):  # spec copies get their own (empty) context
        return RoutingContext()


# ---------------------------------------------------------------------------------------------- validation
def check_megatron_moe_arch(arch) -> None:
    """Refuse, by name, what the Megatron-MoELayer path does not implement for ``arch``."""
    if not arch.is_moe:
        raise UnsupportedConfigError("the Megatron MoELayer path needs an MoE architecture (num_experts > 0)")
    if arch.is_hybrid:
        raise UnsupportedConfigError("the Megatron MoELayer path covers GPT decoders only, not hybrid (Mamba) models")
    if not arch.mlp_gated:
        raise UnsupportedConfigError(f"the Megatron MoELayer path has SwiGLU experts only (hidden_act={arch.hidden_act!r})")
    if arch.moe_score_bias:
        raise UnsupportedConfigError("the Megatron MoELayer path has no router selection bias (e_score_correction_bias)")


def check_megatron_moe_config(config) -> None:
    """Every Megatron MoE option that would break the combine contract, named, before any work."""
    bad = []
    g = lambda name, default=None: getattr(config, name, default)  # noqa: E731
    ep = g("expert_model_parallel_size", 1) or 1
    if ep < 1 or g("num_moe_experts", 0) % ep:
        bad.append(f"expert_model_parallel_size={ep} with num_moe_experts={g('num_moe_experts')} (EP must divide the "
                   "number of experts)")
    if (g("expert_tensor_parallel_size", 1) or 1) != 1:
        bad.append(f"expert tensor parallelism (expert_tensor_parallel_size={g('expert_tensor_parallel_size')}; set it "
                   "to 1 -- Megatron's TransformerConfig defaults it to the TP size)")
    if g("tensor_model_parallel_size", 1) != 1 and not g("sequence_parallel", False):
        bad.append(f"tensor parallelism without sequence parallelism (tensor_model_parallel_size="
                   f"{g('tensor_model_parallel_size')}: Megatron's MoELayer trains at TP > 1 only with sequence_parallel=True)")
    if g("moe_token_dispatcher_type") not in DISPATCHERS:
        bad.append(f"moe_token_dispatcher_type={g('moe_token_dispatcher_type')!r} (supported: {', '.join(DISPATCHERS)})")
    elif g("moe_token_dispatcher_type") == "alltoall" and not torch.cuda.is_available():
        bad.append("moe_token_dispatcher_type='alltoall' without CUDA (Megatron's all-to-all dispatcher creates a "
                   "torch.cuda.Stream; use 'allgather' on the CPU)")
    for name in ("moe_expert_capacity_factor", "moe_latent_size", "moe_input_jitter_eps"):
        if g(name) is not None:
            bad.append(f"{name}={g(name)}")
    for name in ("moe_permute_fusion", "moe_router_fusion", "moe_shared_expert_overlap", "moe_router_enable_expert_bias",
                 "moe_pad_expert_input_to_capacity", "moe_router_padding_for_quantization", "moe_router_force_load_balancing",
                 "moe_enable_routing_replay", "moe_grouped_gemm", "add_bias_linear", "overlap_moe_expert_parallel_comm"):
        if g(name, False):
            bad.append(f"{name}=True")
    if g("moe_router_load_balancing_type", "aux_loss") not in ("aux_loss", "seq_aux_loss", "global_aux_loss", "none") and \
            not isinstance(g("moe_router_load_balancing_type"), list):
        bad.append(f"moe_router_load_balancing_type={g('moe_router_load_balancing_type')!r} (sinkhorn / quantile "
                   "balancing change the routing)")
    if g("moe_router_score_function", "softmax") not in kmoe.SCORINGS:
        bad.append(f"moe_router_score_function={g('moe_router_score_function')!r}")
    if g("cuda_graph_impl", "none") not in (None, "none"):
        bad.append(f"cuda_graph_impl={g('cuda_graph_impl')!r}")
    if g("moe_router_force_biased") is not None:
        bad.append(f"moe_router_force_biased={g('moe_router_force_biased')}")
    if bad:
        raise UnsupportedConfigError("the consistent Megatron MoELayer path does not support: " + "; ".join(bad))


# ---------------------------------------------------------------------------------------------- router
def _router_class():
    from megatron.core.transformer.moe.router import TopKRouter

    class ConsistentTopKRouter(TopKRouter):
        """``TopKRouter`` whose logits, scores, top-k and weights are :mod:`..kernels.moe`'s (contract there).

        ``forward(x [s, b, H]) -> (probs [T, E] float32, routing_map [T, E] bool)`` as Megatron's.
        ``probs`` holds the k weights at the chosen experts (0 elsewhere); ``last_routes`` keeps the
        slot-ordered experts ``[T, k]`` of the last forward.  Megatron's z-loss and aux losses are
        attached by its own methods (identity in the forward).
        """

        capture = None  # diagnostics: a callable(router_logits [T, E], experts [T, k]) set on an instance; None = off

        def __init__(self, config, pg_collection=None, *, context: RoutingContext | None = None,
                     norm_topk_prob: bool | None = None, **kwargs):
            check_megatron_moe_config(config)
            super().__init__(config=config, pg_collection=pg_collection, **kwargs)
            self.context = context
            self.norm_topk_prob = (not config.moe_router_pre_softmax) if norm_topk_prob is None else bool(norm_topk_prob)
            self.last_routes: torch.Tensor | None = None

        def gating(self, input: torch.Tensor) -> torch.Tensor:
            """float32 logits ``[..., E]`` by the batch-invariant linear (never moves the weight)."""
            z = kmoe.router_logits(input.reshape(-1, input.shape[-1]), self.weight)
            return z.view(*input.shape[:-1], z.shape[-1])

        def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
            from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss

            seq_length, bsz = (logits.shape[0], logits.shape[1]) if logits.dim() == 3 else (logits.shape[0], 1)
            z = logits.reshape(-1, self.config.num_moe_experts)
            if padding_mask is not None:
                padding_mask = padding_mask.reshape(-1)
            z = self.apply_z_loss(z, padding_mask=padding_mask)
            c = self.config
            w, experts = kmoe.route_logits(
                z, self.topk, self.score_function, norm_topk_prob=self.norm_topk_prob,
                n_group=c.moe_router_num_groups or 1, topk_group=c.moe_router_group_topk or 1,
                routed_scaling_factor=c.moe_router_topk_scaling_factor or 1.0)
            probs = torch.zeros_like(z).scatter(1, experts, w)
            routing_map = torch.zeros_like(z, dtype=torch.bool).scatter(1, experts, True)
            if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
                _, scores = compute_routing_scores_for_aux_loss(z, self.topk, self.score_function, fused=False,
                                                                padding_mask=padding_mask)
                counted = routing_map if padding_mask is None else routing_map & ~padding_mask[:, None]
                masked = padding_mask is not None
                probs = self._apply_aux_loss(probs, scores, counted, with_padding_mask=masked)
                probs = self._apply_seq_aux_loss(probs, scores, counted, seq_length, bsz, with_padding_mask=masked)
                probs = self._apply_global_aux_loss(probs, scores, counted, with_padding_mask=masked)
            self.last_routes = experts.detach()
            if self.capture is not None:
                self.capture(logits.reshape(-1, self.config.num_moe_experts), experts)
            return probs, routing_map

        def forward(self, input: torch.Tensor, padding_mask: torch.Tensor | None = None):
            if self.context is not None:
                self.context.hidden = input.reshape(-1, input.shape[-1])
            probs, routing_map = self.routing(self.gating(input), padding_mask=padding_mask)
            if self.context is not None:
                self.context.routes = self.last_routes
            return probs, routing_map

    return ConsistentTopKRouter


class _LazyRouter:
    """``ConsistentTopKRouter`` needs megatron-core at class creation; built on first use."""

    _cls = None

    def __call__(self, *args, **kwargs):
        return self.get()(*args, **kwargs)

    def get(self):
        if _LazyRouter._cls is None:
            _LazyRouter._cls = _router_class()
        return _LazyRouter._cls


def __getattr__(name):  # module attribute ConsistentTopKRouter, created lazily
    if name == "ConsistentTopKRouter":
        return _LazyRouter().get()
    raise AttributeError(name)


# ---------------------------------------------------------------------------------------------- experts
def _sharded(module, prefix, sharded_offsets, metadata):
    from .linear import sharded_state_dict_tp1

    return sharded_state_dict_tp1(module, prefix, sharded_offsets, metadata, {})


def dispatched_pairs(routes: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Pair index ``token * k + slot`` of every row the experts ``[first, first + count)`` receive ``[N]``, in
    Megatron's permute order: expert-major, within an expert the tokens ascending (``routes [T, k]``: the EP group's
    tokens in rank order, as both dispatchers gather them)."""
    flat = routes.reshape(-1)
    pairs = ((flat >= first) & (flat < first + count)).nonzero()[:, 0]
    return pairs[torch.sort(flat[pairs], stable=True).indices]


def slot_order_rows(products: torch.Tensor, pair_of_row: torch.Tensor, routes: torch.Tensor, n_local: int,
                    group=None) -> torch.Tensor:
    """float32 ``[N, H]``: the row of each owned token's slot 0 = ``((0 + p_0) + p_1) + ...`` (slot order), others +0.0.

    ``products [N, H]``: ``w * float32(y)`` of this rank's rows (``pair_of_row``: :func:`dispatched_pairs`);
    ``routes [T, k]``: the EP group's (``group``; ``None`` at EP = 1), ``n_local`` experts a rank.  A token is owned
    by the rank holding its slot-0 expert.  Every rank sends each product to its token's owner
    (:func:`.tensor_parallel.exchange_rows`, grouped by owner in this rank's row order: pure data movement); the
    owner knows, from the EP group's routes, which pairs each rank sends it and in which order, places them at their
    (token, slot) -- each of its tokens' k pairs arrives once -- and sums them in slot order."""
    t, k = routes.shape
    e, rank = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
    owner = torch.div(routes[:, 0], n_local, rounding_mode="floor")
    if e > 1:
        dest = owner[torch.div(pair_of_row, k, rounding_mode="floor")]
        arriving = []  # the pairs rank s sends this one: its rows' pairs whose token this rank owns, in its row order
        for s in range(e):
            pairs = dispatched_pairs(routes, s * n_local, n_local)
            arriving.append(pairs[owner[torch.div(pairs, k, rounding_mode="floor")] == rank])
        received = tpar.exchange_rows(products[torch.sort(dest, stable=True).indices],
                                      torch.bincount(dest, minlength=e).tolist(), [len(a) for a in arriving], group)
        received_pairs = torch.cat(arriving)
    else:
        received, received_pairs = products, pair_of_row
    owned = (owner == rank).nonzero()[:, 0]  # ascending
    place = torch.full((t,), -1, dtype=torch.int64, device=routes.device)
    place[owned] = torch.arange(owned.numel(), device=routes.device)
    slots = received.new_zeros(owned.numel() * k, products.shape[-1]).index_copy(
        0, place[torch.div(received_pairs, k, rounding_mode="floor")] * k + received_pairs % k, received)
    slots = slots.view(owned.numel(), k, -1)
    acc = products.new_zeros(owned.numel(), products.shape[-1])
    for j in range(k):
        acc = acc + slots[:, j]
    row_of_pair = torch.full((t * k,), -1, dtype=torch.int64, device=routes.device)
    row_of_pair[pair_of_row] = torch.arange(pair_of_row.numel(), device=routes.device)
    return products.new_zeros(products.shape).index_copy(0, row_of_pair[owned * k], acc)


class ConsistentExperts(nn.Module):
    """Megatron's experts slot: ``forward(rows [N, H], tokens_per_expert [E/e], permuted_probs [N]) -> (out [N, H] fp32, None)``.

    At EP = e (Megatron's expert-parallel group, ``tensor_parallel.ep_group()``) the module holds experts
    ``[r E/e, (r+1) E/e)`` of EP rank r (``allreduce=False``, as Megatron marks expert weights; drawn as the whole
    EP = 1 stack, then sliced).  Rows arrive grouped by local expert (``tokens_per_expert`` each, ascending expert),
    within an expert in the EP group's token order; every group runs ``kmoe.expert_mlp`` with its expert's
    weights; the products ``w * float32(y)`` are combined per token in slot order on the rank holding its slot 0
    (:func:`slot_order_rows`; see the module docstring) so that Megatron's unpermute and its reduce-scatter /
    all-to-all back add one value and zeros.
    """

    def __init__(self, num_local_experts: int, config, pg_collection=None, *, context: RoutingContext | None = None,
                 name: str | None = None, **unused):
        super().__init__()
        check_megatron_moe_config(config)
        if context is None:
            raise UnsupportedConfigError("ConsistentExperts needs the layer's RoutingContext (build it with "
                                         "megatron_moe_layer_spec)")
        group = tpar.ep_group()
        self.ep = 1 if group is None else dist.get_world_size(group)
        E = config.num_moe_experts
        if num_local_experts * self.ep != E:
            raise UnsupportedConfigError(f"ConsistentExperts: {num_local_experts} local experts x EP={self.ep} (Megatron's "
                                         f"expert-parallel group) != num_moe_experts={E}")
        self.config, self.context, self.num_local_experts = config, context, num_local_experts
        self.expert_offset = (0 if group is None else dist.get_rank(group)) * num_local_experts
        H, inter, dt = config.hidden_size, config.moe_ffn_hidden_size, config.params_dtype
        fc1 = _init((E, 2 * inter, H), getattr(config, "init_method", None), dt)  # the EP = 1 draws
        fc2 = _init((E, H, inter), getattr(config, "output_layer_init_method", None), dt)
        if self.ep > 1 or config.tensor_model_parallel_size > 1:  # gradients over the expert-data-parallel ranks
            rank = 0 if group is None else dist.get_rank(group)
            fc1, fc2 = (_expert_shard(w, rank, self.ep, expert_parallel=True) for w in (fc1, fc2))
        else:
            fc1, fc2 = _mark(fc1), _mark(fc2)
        self.linear_fc1 = _Container()
        self.linear_fc2 = _Container()
        self.linear_fc1.weight, self.linear_fc2.weight = fc1, fc2

    def forward(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor, **kwargs):
        if any(v is not None for v in kwargs.values()):
            raise UnsupportedConfigError(f"ConsistentExperts: unsupported expert arguments {sorted(kwargs)}")
        routes, hidden = self.context.routes, self.context.hidden
        self.context.hidden = None
        if routes is None or hidden is None:
            raise RuntimeError("ConsistentExperts: no routing from the layer's ConsistentTopKRouter for this forward")
        if permuted_probs.dtype != torch.float32:
            raise RuntimeError(f"ConsistentExperts: dispatched probs must be float32, got {permuted_probs.dtype}")
        group = tpar.ep_group() if self.ep > 1 else None
        with torch.no_grad():
            if group is not None:  # the EP group's tokens in rank order, as the dispatchers gather them
                sizes = tpar.row_counts(routes.shape[0], group, routes.device)
                routes, hidden = tpar.gather_rows(routes, sizes, group), tpar.gather_rows(hidden, sizes, group)
            n, first = self.num_local_experts, self.expert_offset
            pair_of_row = dispatched_pairs(routes, first, n)
            flat = routes.reshape(-1)
            expected = torch.bincount(flat[(flat >= first) & (flat < first + n)].cpu() - first, minlength=n)
            counts = torch.as_tensor(tokens_per_expert).to("cpu", torch.int64)
            token_of_row = torch.div(pair_of_row, routes.shape[1], rounding_mode="floor")
            layout_ok = (rows.shape[0] == pair_of_row.numel() and torch.equal(counts, expected)
                         and torch.equal(rows, hidden[token_of_row]))
        if not layout_ok:
            raise RuntimeError("ConsistentExperts: the dispatched rows are not in the expert-major, token-ascending "
                               "order of Megatron's permute (this megatron-core permutes differently)")
        pieces, start = [], 0
        mlp = self._expert_mlp()
        for e, m in enumerate(counts.tolist()):
            if m:
                pieces.append(mlp(rows[start : start + m], e))
                start += m
        w2 = self.linear_fc2.weight
        y = torch.cat(pieces) if pieces else rows.new_zeros(0, w2.shape[1])
        products = permuted_probs.unsqueeze(-1) * y.to(torch.float32)
        return slot_order_rows(products, pair_of_row, routes, n, group), None

    def _expert_mlp(self):
        """``f(rows, e)``: expert ``e``'s SwiGLU MLP; block-FP8 (``kernels.fp8.fp8_expert_mlp``, quantized per forward
        from the bf16 masters, STE backward) while ``layers.fp8.enable_fp8`` has set :attr:`fp8`."""
        w1, w2 = self.linear_fc1.weight, self.linear_fc2.weight
        fp8 = getattr(self, "fp8", None)
        if fp8 is None:
            return lambda x, e: kmoe.expert_mlp(x, w1[e], w2[e])
        from ..kernels.fp8 import fp8_expert_mlp

        fc1, fc2 = fp8.quantize_weight("experts_fc1", w1), fp8.quantize_weight("experts_fc2", w2)
        return lambda x, e: fp8_expert_mlp(x, fc1.expert(e), fc2.expert(e), fp8.w_fmt, fp8.a_fmt)

    def backward_dw(self):  # Megatron calls it only with delayed wgrad; gradients are already in .grad
        return None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        state = _sharded(self, prefix, sharded_offsets, metadata)
        if self.ep > 1:  # split over the EP ranks, replicated over the expert-data-parallel ranks (Megatron's experts)
            for n in ("linear_fc1.weight", "linear_fc2.weight"):
                state[prefix + n] = tpar.expert_sharded_tensor(self.get_parameter(n), prefix + n, sharded_offsets)
        return state


class ConsistentSharedExperts(nn.Module):
    """Megatron's shared-experts slot: ``forward(x [s, b, H]) -> g * float32(y_shared)`` float32 ``[s, b, H]``.

    ``y_shared = kmoe.expert_mlp(x, W_fc1, W_fc2)``; ``g = kmoe.shared_expert_gate(x, gate_weight)``
    (float32 sigmoid) when built with ``gate=True``, else 1.  ``MoELayer.postprocess`` adds it to the
    float32 routed sum before the single rounding.
    """

    def __init__(self, config, pg_collection=None, gate: bool = False, name: str | None = None, **unused):
        super().__init__()
        check_megatron_moe_config(config)
        s, H, dt = config.moe_shared_expert_intermediate_size, config.hidden_size, config.params_dtype
        init, out_init = getattr(config, "init_method", None), getattr(config, "output_layer_init_method", None)
        sp = bool(getattr(config, "sequence_parallel", False))  # a rank's gradient covers its sequence chunk
        self.linear_fc1 = _Container()
        self.linear_fc2 = _Container()
        self.linear_fc1.weight = _mark(_init((2 * s, H), init, dt), sp)
        self.linear_fc2.weight = _mark(_init((H, s), out_init, dt), sp)
        self.gate_weight = _mark(_init((1, H), init, dt), sp) if gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        fp8 = getattr(self, "fp8", None)  # layers.fp8.enable_fp8: block-FP8 linears (as kernels.fp8.fp8_moe_experts)
        if fp8 is None:
            ys = kmoe.expert_mlp(h, self.linear_fc1.weight, self.linear_fc2.weight)
        else:
            from ..kernels.fp8 import fp8_expert_mlp

            ys = fp8_expert_mlp(h, fp8.quantize_weight("fc1", self.linear_fc1.weight),
                                fp8.quantize_weight("copy", self.linear_fc2.weight), fp8.w_fmt, fp8.a_fmt)
        ys = ys.to(torch.float32)
        if self.gate_weight is not None:
            ys = kmoe.shared_expert_gate(h, self.gate_weight) * ys
        return ys.view(*x.shape[:-1], ys.shape[-1])

    def backward_dw(self):
        return None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return _sharded(self, prefix, sharded_offsets, metadata)


# ---------------------------------------------------------------------------------------------- residual / spec
def _moe_residual_add(x_with_bias, residual: torch.Tensor, prob: float) -> torch.Tensor:
    x, bias = x_with_bias
    if bias is not None:
        raise UnsupportedConfigError("unsupported feature: a bias in the MoE residual add (add_bias_linear)")
    if prob:
        raise UnsupportedConfigError(f"unsupported feature: hidden dropout p={prob} in the residual add (must be 0)")
    return add_residual(x.to(residual.dtype), residual)  # the MoE layer's float32 sum, rounded once


def consistent_moe_bias_dropout_add(training: bool, fused: bool):
    """``mlp_bda`` of the MoE layers: round the float32 MoE output once to the residual dtype, then ``add_residual``."""
    return _moe_residual_add


def megatron_moe_config_kwargs(arch, dispatcher: str = "allgather", aux_loss_coeff: float = 0.0) -> dict:
    """``TransformerConfig`` MoE fields for ``arch`` (EP=1 -- a framework sets its own --, expert TP 1, no fusions, our
    router's options)."""
    check_megatron_moe_arch(arch)
    if dispatcher not in DISPATCHERS:
        raise UnsupportedConfigError(f"unsupported moe_token_dispatcher_type {dispatcher!r}; supported: {', '.join(DISPATCHERS)}")
    k = arch.num_experts_per_tok
    shared = arch.shared_expert_intermediate_size or None
    return dict(
        num_moe_experts=arch.num_experts,
        moe_router_topk=k,
        moe_ffn_hidden_size=arch.moe_intermediate_size,
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=bool(shared),
        # Megatron: "pre-softmax" = softmax over all experts then top-k (no renormalisation); Megatron requires it
        # for top-1.  Our router takes norm_topk_prob explicitly (megatron_moe_layer_spec), this only documents it.
        moe_router_pre_softmax=(not arch.norm_topk_prob) or k == 1,
        moe_router_score_function=arch.moe_scoring,
        moe_router_dtype="fp32",
        moe_token_dispatcher_type=dispatcher,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(aux_loss_coeff),
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        expert_model_parallel_size=1,
        expert_tensor_parallel_size=1,
    )


def megatron_moe_layer_spec(dense_layer_spec, arch):
    """A copy of the consistent dense TransformerLayer spec whose ``mlp`` is Megatron's ``MoELayer`` with our submodules."""
    check_megatron_moe_arch(arch)
    return moe_layer_spec_from(dense_layer_spec, arch.norm_topk_prob)


def norm_topk_prob_of(config) -> bool:
    """Whether a Megatron ``TransformerConfig``'s router renormalises its top-k weights: top-k of the scores, then a
    softmax over them (``moe_router_pre_softmax=False``, k > 1) -- HF's ``norm_topk_prob`` (the inverse of
    :func:`megatron_moe_config_kwargs`)."""
    return int(config.moe_router_topk) > 1 and not getattr(config, "moe_router_pre_softmax", False)


def moe_layer_spec_from(dense_layer_spec, norm_topk_prob: bool):
    """:func:`megatron_moe_layer_spec` from the router's one option (a framework config without an ``arch``)."""
    import copy

    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    context = RoutingContext()
    spec = copy.deepcopy(dense_layer_spec)
    spec.submodules.mlp = ModuleSpec(
        module=MoELayer,
        submodules=MoESubmodules(
            experts=ModuleSpec(module=ConsistentExperts, params={"context": context}),
            shared_experts=ConsistentSharedExperts,
            router=functools.partial(_LazyRouter().get(), context=context, norm_topk_prob=norm_topk_prob),
        ),
    )
    spec.submodules.mlp_bda = consistent_moe_bias_dropout_add
    return spec


# ---------------------------------------------------------------------------------------------- model builder hook
MOE_IMPLS = ("megatron", "module")
DEFAULT_MOE_IMPL = "megatron"


def megatron_moe_setup(arch, moe_impl: str | None, dispatcher: str = "allgather", aux_loss_coeff: float = 0.0):
    """``(impl, TransformerConfig kwargs)`` for :func:`.model.build_consistent_model`.

    ``impl``: ``"megatron"`` (Megatron-Core's MoELayer + this module's submodules) or ``"module"``
    (:class:`.moe.ConsistentMoELayer`); ``None`` picks :data:`DEFAULT_MOE_IMPL` where the architecture is
    supported by the Megatron path, else ``"module"``.  Dense models: ``(None, {})``.
    """
    if not arch.is_moe:
        if moe_impl not in (None, *MOE_IMPLS):
            raise UnsupportedConfigError(f"unsupported moe_impl {moe_impl!r}; supported: {', '.join(MOE_IMPLS)}")
        return None, {}
    if moe_impl is None:
        moe_impl = DEFAULT_MOE_IMPL
        if moe_impl == "megatron":
            try:
                check_megatron_moe_arch(arch)
            except UnsupportedConfigError:
                moe_impl = "module"
    if moe_impl not in MOE_IMPLS:
        raise UnsupportedConfigError(f"unsupported moe_impl {moe_impl!r}; supported: {', '.join(MOE_IMPLS)}")
    if moe_impl == "module":
        if dispatcher != "allgather" or aux_loss_coeff:
            raise UnsupportedConfigError("moe_token_dispatcher / moe_aux_loss_coeff apply to moe_impl='megatron' only")
        return moe_impl, {}
    return moe_impl, megatron_moe_config_kwargs(arch, dispatcher, aux_loss_coeff)

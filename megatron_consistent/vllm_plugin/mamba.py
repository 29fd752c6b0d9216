"""Consistent Mamba-2 mixer for vLLM: a ``MambaBase`` whose cached state replays the partial chunk.

The op sequence is the one of ``docs/hybrid.md`` / the Megatron hybrid layer, op for op::

    zxbcdt = linear(x, W_in)                                   z | xBC | dt
    dt = mamba_dt(dt, dt_bias, *time_step_limit)               float32
    y = mamba_mixer(xBC, dt)         the mixer core, per request, reading and writing vLLM's state cache:
        xBC, conv_state = causal_conv1d(xBC, W_conv, b_conv, conv_state, "silu")
        y, boundary, pending = ssd_continue(boundary, pending, x, dt, B, C, A=-exp(A_log), D, chunk_size)
    out = row_parallel_linear(gated_rms_norm(y, z, W_norm, d_inner // n_groups, eps), W_out)

vLLM allocates and tracks this state per request (one slot per request: prefix
caching is refused for hybrid models).  A slot holds, in this order:

* ``ssm``   ``[H, P, N]`` float32 — the SSD state at the last chunk boundary
  (absolute positions ``0, L, 2L, ...``, ``L = chunk_size``), NOT after the last token;
* ``dt``    ``[L, H]`` float32 — ``dt`` of the pending tokens (rows ``0..p-1``);
* ``conv``  ``[K-1, conv_dim]`` model dtype — the last ``K-1`` conv inputs;
* ``xbc``   ``[L, conv_dim]`` model dtype — post-conv ``x | B | C`` of the pending tokens,

with ``p = num_computed_tokens % L`` pending tokens.  Every prefill piece and every
decode step calls :func:`kernels.ssd_continue` from the boundary state with the pending
tokens, so each output has the bits of the whole-sequence :func:`kernels.ssd_scan`
whatever the chunked-prefill cut, the decode step or the batch (one-token steps of the
batch are replayed together, zero-padded, each asking its own row only, the replay read in place from the cache by
:func:`kernels.ssd_step_outputs`: :meth:`ConsistentMambaMixer._step`).  A request's
``num_computed_tokens`` comes from vLLM's metadata (``seq_lens - query_len``); a request
with none computed starts from zeros.  Requests with the same (new tokens, pending) sizes
are run as one batched call (the kernels are batch-invariant).

torch.compile and CUDA graphs (vLLM 0.26 on CUDA).  The mixer core reads vLLM's metadata on the host (request
sizes, state slots, pending counts; once a step, :class:`StepPlan`) and groups requests by them: data-dependent
Python that no CUDA graph can replay.  So by default it is fenced off the way vLLM fences its own
``mamba_mixer2``:

* it is one opaque custom op, ``megatron_consistent::mamba_mixer`` (:data:`MIXER_OP`), writing ``y`` into a buffer
  the compiled graph allocates (a piecewise graph reads it at its captured address), and
  :func:`run_mixer_between_graphs` adds it to the compilation config's ``splitting_ops``: vLLM cuts the compiled
  graph at it, captures the pieces between mixers as piecewise CUDA graphs and runs the op eagerly between them;
* its attention backend (:class:`ConsistentMamba2Backend`, vLLM's Mamba-2 metadata unchanged) declares no
  full-CUDA-graph support (``AttentionCGSupport.NEVER``), so vLLM resolves the default ``FULL_AND_PIECEWISE`` to
  ``PIECEWISE`` for these models and never captures a mixer inside a full decode graph (a ``FULL`` mode asked
  for explicitly is refused by vLLM itself).

Everything else of the layer (in/out projections, ``mamba_dt``, the gated norm) is compiled and captured, each
an opaque op of :mod:`..kernels.inference_ops`.  Rows the mixer does not compute (the padding of a piecewise
graph's batch) are zeros.

``MC_HYBRID_DECODE_GRAPHS=1`` (opt-in, not yet measured on a GPU): a decode-only step runs on the device alone
(:meth:`ConsistentMambaMixer._step_graphed`: every request's pending count from ``seq_lens`` on the device, the
outputs read in place from the cache as in the host-planned step, the new boundary states of the closing requests
formed in place in the state cache, masked on the device: :func:`kernels.ssd_step_end_states`), and the backend
declares vLLM's own Mamba-2 support
(``UNIFORM_BATCH``): vLLM then captures decode-only steps in full CUDA graphs, mixer included, and keeps the
piecewise graphs with the host-planned mixer for steps with prefills.  Same bits either way.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
from torch import nn
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionBackend, Mamba2AttentionMetadataBuilder
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from ..config import ArchConfig, SSMConfig
from ..kernels import (causal_conv1d, inference_ops, ssd_chunk_end_state, ssd_continue, ssd_step_end_states,
                       ssd_step_outputs, ssm_decay_rate)
from ..kernels.dispatch import env_switch

MIXER_OP = "megatron_consistent::mamba_mixer"


# MC_HYBRID_DECODE_GRAPHS=1: a decode-only step's mixer on the device alone (ConsistentMambaMixer._step_graphed), and
# vLLM may capture such steps in full CUDA graphs; off: the host-planned step between piecewise graphs (the default
# until it is measured on a GPU)
DECODE_GRAPHS = env_switch("MC_HYBRID_DECODE_GRAPHS")


class ConsistentMamba2MetadataBuilder(Mamba2AttentionMetadataBuilder):
    """vLLM's Mamba-2 metadata, declaring no full-CUDA-graph support (the mixer core reads it on the host), or with
    ``MC_HYBRID_DECODE_GRAPHS=1`` vLLM's own (uniform decode batches: the device-only step)."""

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        return AttentionCGSupport.UNIFORM_BATCH if DECODE_GRAPHS else AttentionCGSupport.NEVER


class ConsistentMamba2Backend(Mamba2AttentionBackend):
    """vLLM's Mamba-2 backend with :class:`ConsistentMamba2MetadataBuilder`."""

    @staticmethod
    def get_builder_cls() -> type[Mamba2AttentionMetadataBuilder]:
        return ConsistentMamba2MetadataBuilder


def run_mixer_between_graphs(compilation_config) -> None:
    """Add :data:`MIXER_OP` to vLLM's ``splitting_ops`` (idempotent): the compiled graph is cut at every mixer, which
    runs eagerly between piecewise CUDA graphs.  An empty list (the user asked for one unsplit graph) or ``None``
    (no vLLM compilation) is left as it is: nothing is captured piecewise there, and vLLM refuses full graphs
    for :class:`ConsistentMamba2Backend`."""
    ops = compilation_config.splitting_ops
    if ops and MIXER_OP not in ops:
        ops.append(MIXER_OP)


@torch.library.custom_op(MIXER_OP, mutates_args=("y",))
def mamba_mixer(xbc: torch.Tensor, dt: torch.Tensor, y: torch.Tensor, layer_name: str) -> None:
    """The mixer core of layer ``layer_name`` (:meth:`ConsistentMambaMixer.mix`) on this step's metadata."""
    from vllm.forward_context import get_forward_context

    ctx = get_forward_context()
    meta = ctx.attn_metadata
    ctx.no_compile_layers[layer_name].mix(xbc, dt, y, meta.get(layer_name) if isinstance(meta, dict) else None)


@mamba_mixer.register_fake
def _mamba_mixer_fake(xbc, dt, y, layer_name):
    return None


def state_shapes(ssm: SSMConfig) -> tuple[tuple[int, ...], ...]:
    """Shapes of one request's slot: (ssm boundary state, pending dt, conv state, pending xBC)."""
    L = ssm.chunk_size
    return ((ssm.num_heads, ssm.head_dim, ssm.state_size), (L, ssm.num_heads), (ssm.conv_kernel - 1, ssm.conv_dim), (L, ssm.conv_dim))


def state_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    return (torch.float32, torch.float32, dtype, dtype)


def _f32(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=torch.float32), requires_grad=False)


class DecodePlan(NamedTuple):
    """A step's one-token requests as :meth:`ConsistentMambaMixer._step` takes them (device index tensors)."""

    rows: torch.Tensor  # their tokens' rows of the step
    slots: torch.Tensor  # their state slots
    pending: torch.Tensor  # their pending counts p = computed % L (the new token's row of the replay)
    fresh_slots: torch.Tensor | None  # slots of first tokens (computed == 0), None: none
    closing_rows: torch.Tensor | None  # those whose token completes the chunk (p == L - 1), None: none


class StepPlan(NamedTuple):
    """The host's reading of one step's metadata, shared by every mixer of the step."""

    decode: DecodePlan | None
    prefills: list[tuple[torch.Tensor, list[int], list[int]]]  # pieces of equal (new, pending): rows [k, n], slots, computed


def step_plan(requests: list[tuple[int, int, int, int]], chunk_size: int, device) -> StepPlan:
    """:class:`StepPlan` of ``requests`` ((first row, new tokens, state slot, computed tokens) each): the one-token
    requests in one :class:`DecodePlan`, the others grouped by (new tokens, pending count)."""

    def tensor(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    steps = [(first, slot, c) for first, n, slot, c in requests if n == 1]
    groups: dict[tuple[int, int], list] = {}
    for first, n, slot, c in requests:
        if n > 1:
            groups.setdefault((n, c % chunk_size), []).append((first, slot, c))
    prefills = [(tensor([r[0] for r in reqs])[:, None] + torch.arange(n, device=device)[None, :], [r[1] for r in reqs],
                 [r[2] for r in reqs]) for (n, _), reqs in groups.items()]
    if not steps:
        return StepPlan(None, prefills)
    pending = [c % chunk_size for _, _, c in steps]
    fresh = [slot for _, slot, c in steps if c == 0]
    closing = [i for i, q in enumerate(pending) if q == chunk_size - 1]
    decode = DecodePlan(
        rows=tensor([r[0] for r in steps]), slots=tensor([r[1] for r in steps]), pending=tensor(pending),
        fresh_slots=tensor(fresh) if fresh else None,
        closing_rows=tensor(closing) if closing else None)
    return StepPlan(decode, prefills)


class ConsistentMambaMixer(MambaBase, nn.Module):
    """The Mamba-2 mixer of one layer (input: the layer's normed hidden states ``[T, hidden]``).

    Small parameters (``A_log``, ``D``, ``dt_bias``, conv weight/bias, gated-norm weight)
    are held in float32 — every kernel reads them as float32, so this is bit-neutral and
    loads a float32 or a bf16 checkpoint exactly.
    """

    _last_plan: ClassVar[tuple] = (None, None)  # (metadata, its StepPlan): the step's plan, for the step's other mixers

    def __init__(self, arch: ArchConfig, vllm_config, prefix: str):
        nn.Module.__init__(self)
        s = arch.ssm
        self.arch, self.ssm, self.prefix = arch, s, prefix
        self.dtype = arch.torch_dtype
        self.in_proj = nn.Parameter(torch.zeros(s.in_proj_size, arch.hidden_size, dtype=self.dtype), requires_grad=False)
        self.conv_weight = _f32(s.conv_dim, 1, s.conv_kernel)  # HF conv1d.weight layout [C, 1, K]
        self.conv_bias = _f32(s.conv_dim) if s.use_conv_bias else None
        self.A_log, self.D, self.dt_bias = _f32(s.num_heads), _f32(s.num_heads), _f32(s.num_heads)
        self.norm_weight = _f32(s.d_inner)
        self.out_proj = nn.Parameter(torch.zeros(arch.hidden_size, s.d_inner, dtype=self.dtype), requires_grad=False)
        self.kv_cache = tuple(torch.tensor([]) for _ in range(4))
        ctx = vllm_config.compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"duplicate layer name {prefix}")
        ctx[prefix] = self  # vLLM binds the state cache and builds the metadata of every layer found here

    # --- MambaBase --------------------------------------------------------------------------
    def get_state_shape(self):
        return state_shapes(self.ssm)

    def get_state_dtype(self):
        return state_dtypes(self.dtype)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.MAMBA2  # reuse vLLM's Mamba-2 metadata (state slots, query locations, seq lens)

    def get_attn_backend(self):
        return ConsistentMamba2Backend

    # --- forward ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.ssm
        zxbcdt = inference_ops.linear(x, self.in_proj)
        z, xbc, dt_raw = zxbcdt.split([s.d_inner, s.conv_dim, s.num_heads], dim=-1)
        dt = inference_ops.mamba_dt(dt_raw, self.dt_bias, *s.time_step_limit)
        y = torch.empty(x.shape[0], s.d_inner, dtype=x.dtype, device=x.device)
        mamba_mixer(xbc, dt, y, self.prefix)
        return inference_ops.row_parallel_linear(inference_ops.gated_rms_norm(y, z, self.norm_weight, s.group_size, s.norm_eps),
                                                 self.out_proj)

    def mix(self, xbc: torch.Tensor, dt: torch.Tensor, y: torch.Tensor, meta) -> None:
        """Conv + SSD of every request of the step into ``y [T, d_inner]`` (rows of no request: zeros), reading and
        writing the state cache; ``meta``: this layer's vLLM metadata, None in a profile / warm-up run (one fresh
        sequence, no cache)."""
        s = self.ssm
        t = xbc.shape[0]
        if meta is None:
            y.copy_(self._run(xbc[None], dt[None], None).reshape(t, s.d_inner))
            return
        y.zero_()
        if DECODE_GRAPHS and meta.num_prefills == 0:  # decode only: on the device alone (a full graph may hold it)
            slots = meta.state_indices_tensor_d[:, 0]
            b = slots.shape[0]  # a captured batch's padded rows included
            if b:
                y[:b] = self._step_graphed(xbc[:b], dt[:b], slots, meta.seq_lens[:b]).reshape(b, s.d_inner)
            return
        plan = self._plan(meta, xbc.device)
        if plan.decode is not None:
            out = self._step(xbc[plan.decode.rows], dt[plan.decode.rows], plan.decode)
            y[plan.decode.rows] = out.reshape(-1, s.d_inner)
        for rows, slots, computed in plan.prefills:
            out = self._run(xbc[rows], dt[rows], (slots, computed))
            y[rows.reshape(-1)] = out.reshape(-1, s.d_inner)

    def _plan(self, meta, device: torch.device) -> StepPlan:
        """The step's :class:`StepPlan`, built by the first mixer that reads this metadata and reused by the others
        (every mixer of a step reads the same metadata: its host reads and index copies happen once a step)."""
        last_meta, plan = ConsistentMambaMixer._last_plan
        if last_meta is not meta:
            plan = step_plan(self._requests(meta), self.ssm.chunk_size, device)
            ConsistentMambaMixer._last_plan = (meta, plan)
        return plan

    @staticmethod
    def _requests(meta) -> list[tuple[int, int, int, int]]:
        """(first row, new tokens, state slot, computed tokens) of every request; vLLM puts decodes first."""
        nd, npf = meta.num_decodes, meta.num_prefills
        seq_lens = meta.seq_lens.to(torch.int64).tolist()
        reqs = []
        if nd:
            slots_d = meta.state_indices_tensor_d[:, 0].tolist()
            reqs += [(i, 1, slots_d[i], seq_lens[i] - 1) for i in range(nd)]
        if npf:
            qsl = (meta.query_start_loc_p.to(torch.int64) + meta.num_decode_tokens).tolist()
            slots_p = meta.state_indices_tensor_p.tolist()
            for j in range(npf):
                n = qsl[j + 1] - qsl[j]
                reqs.append((qsl[j], n, slots_p[j], seq_lens[nd + j] - n))
        return reqs

    def _step(self, xbc: torch.Tensor, dt: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
        """One new token for each of ``b`` requests (any pending counts ``p``): ``xbc [b, conv_dim]``, ``dt [b, H]``.

        Request ``i``'s replay is its pending tokens ``r < p_i`` (the cache's rows), its new token (``r == p_i``) and
        zeros after -- exactly the zero padding the scan gives a partial chunk, so its output at row ``p_i`` has the
        bits of :func:`kernels.ssd_continue`: :func:`kernels.ssd_step_outputs` reads that replay in place from the
        cache (:meth:`_step_outputs`).  The new token is then written to the cache; the requests whose token
        completes the chunk form their new boundary state from their whole chunk, now the cache's rows
        (:func:`kernels.ssd_chunk_end_state`, for them alone), and only their slots' states are written (and a first
        token's slot zeroed first).  Returns ``y [b, H, P]``.
        """
        ssm_c, _, conv_c, _ = self.kv_cache
        if plan.fresh_slots is not None:  # a first token: its slot starts from zeros, its boundary state stays there
            ssm_c[plan.fresh_slots], conv_c[plan.fresh_slots] = 0.0, 0
        new_xbc = self._conv(xbc, plan.slots)
        A, L = ssm_decay_rate(self.A_log), self.ssm.chunk_size
        y = self._step_outputs(new_xbc, dt, plan.slots, plan.pending, A)
        self._write_token(new_xbc, dt, plan.slots, plan.pending)
        if plan.closing_rows is not None:  # their chunk is whole in the cache now (p == L - 1)
            slots = plan.slots[plan.closing_rows]
            x, dt_seg, B, C = self._cached_chunk(slots)
            ssm_c[slots] = ssd_chunk_end_state(x, dt_seg, A, B, C, L, ssm_c[slots])
        return y

    def _step_graphed(self, xbc: torch.Tensor, dt: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor):
        """:meth:`_step` with every request's state slot and length on the device and fixed shapes (the new boundary
        states formed in place in the state cache after the new token's write, by :func:`kernels.ssd_step_end_states`,
        for the device's closing rows ``p == L - 1`` alone, a first token's slot zeroed, every other slot's state
        untouched): no host reads, so vLLM can capture a decode step in a full CUDA graph
        (``MC_HYBRID_DECODE_GRAPHS=1``).  Rows vLLM pads a captured batch with read and write its null block (slot 0,
        never a request's).  Same bits as :meth:`_step` for every real request (tests/test_vllm_hybrid.py)."""
        s = self.ssm
        ssm_c, dt_c, _, xbc_c = self.kv_cache
        L = s.chunk_size
        computed = seq_lens.to(torch.int64) - 1
        p = torch.remainder(computed, L)
        fresh = computed == 0
        new_xbc = self._conv(xbc, slots, fresh)
        A = ssm_decay_rate(self.A_log)
        y = self._step_outputs(new_xbc, dt, slots, p, A, fresh)
        self._write_token(new_xbc, dt, slots, p)
        ssd_step_end_states(xbc_c, dt_c, ssm_c, slots, p == L - 1, fresh, A, L, s.n_groups, s.state_size)
        return y

    def _conv(self, xbc, slots, fresh=None) -> torch.Tensor:
        """The conv of the new tokens ``xbc [b, conv_dim]`` from their slots' conv states (``fresh`` rows: zeros), the
        new conv states written; returns the post-conv tokens ``[b, conv_dim]``."""
        conv_c = self.kv_cache[2]
        conv_state = conv_c[slots]
        if fresh is not None:
            conv_state = torch.where(fresh[:, None, None], 0, conv_state)
        new_xbc, new_conv = causal_conv1d(xbc[:, None], self.conv_weight[:, 0, :], self.conv_bias, conv_state, "silu")
        conv_c[slots] = new_conv
        return new_xbc[:, 0]

    def _step_outputs(self, new_xbc, dt, slots, p, A, fresh=None) -> torch.Tensor:
        """:func:`kernels.ssd_step_outputs` of the new tokens (``y [b, H, P]``; the cache not yet holding them)."""
        s = self.ssm
        ssm_c, dt_c, _, xbc_c = self.kv_cache
        return ssd_step_outputs(xbc_c, dt_c, ssm_c, slots, p, new_xbc, dt, A, self.D, s.chunk_size, s.n_groups,
                                s.state_size, fresh)

    def _write_token(self, new_xbc, dt, slots, p) -> None:
        """The new tokens' rows ``p`` of their slots' xbc and dt caches."""
        _, dt_c, _, xbc_c = self.kv_cache
        xbc_c[slots, p] = new_xbc
        dt_c[slots, p] = dt.to(torch.float32)

    def _cached_chunk(self, slots):
        """``(x, dt, B, C)`` of the whole chunk held by ``slots``' caches (rows ``0..L-1``), shaped for the scan."""
        s = self.ssm
        _, dt_c, _, xbc_c = self.kv_cache
        gn = s.n_groups * s.state_size
        x, B, C = xbc_c[slots].split([s.d_inner, gn, gn], dim=-1)
        b, L = x.shape[:2]
        return (x.reshape(b, L, s.num_heads, s.head_dim), dt_c[slots], B.reshape(b, L, s.n_groups, s.state_size),
                C.reshape(b, L, s.n_groups, s.state_size))

    def _run(self, xbc: torch.Tensor, dt: torch.Tensor, cache) -> torch.Tensor:
        """Conv + SSD of ``b`` requests of equal (new, pending) sizes; ``xbc [b, n, conv_dim]``, ``dt [b, n, H]``.

        ``cache``: (state slots, computed tokens) — read the slots, write them back; None: fresh, no cache.
        Returns ``y [b, n, H, P]``.
        """
        s = self.ssm
        b, n = xbc.shape[:2]
        L, d, gn = s.chunk_size, s.d_inner, s.n_groups * s.state_size
        conv_state = boundary = pending = None
        if cache is not None:
            ssm_c, dt_c, conv_c, xbc_c = self.kv_cache
            slots, computed = torch.tensor(cache[0], dtype=torch.int64, device=xbc.device), cache[1]
            p = computed[0] % L
            fresh = torch.tensor([c == 0 for c in computed], device=xbc.device)
            conv_state = torch.where(fresh[:, None, None], 0, conv_c[slots])
            boundary = torch.where(fresh[:, None, None, None], 0.0, ssm_c[slots])
            px, pb, pc = xbc_c[slots, :p].split([d, gn, gn], dim=-1)
            pending = (px.reshape(b, p, s.num_heads, s.head_dim), dt_c[slots, :p],
                       pb.reshape(b, p, s.n_groups, s.state_size), pc.reshape(b, p, s.n_groups, s.state_size))
        xbc, new_conv = causal_conv1d(xbc, self.conv_weight[:, 0, :], self.conv_bias, conv_state, "silu")
        x, B, C = xbc.split([d, gn, gn], dim=-1)
        A = ssm_decay_rate(self.A_log)
        y, new_boundary, (nx, ndt, nb, nc) = ssd_continue(
            boundary, pending, x.reshape(b, n, s.num_heads, s.head_dim), dt, B.reshape(b, n, s.n_groups, s.state_size),
            C.reshape(b, n, s.n_groups, s.state_size), A, self.D, L)
        if cache is not None:
            q = nx.shape[1]
            ssm_c[slots] = new_boundary
            conv_c[slots] = new_conv
            dt_c[slots, :q] = ndt
            xbc_c[slots, :q] = torch.cat([nx.reshape(b, q, d), nb.reshape(b, q, gn), nc.reshape(b, q, gn)], dim=-1)
        return y

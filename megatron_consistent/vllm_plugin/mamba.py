"""Consistent Mamba-2 mixer for vLLM: a ``MambaBase`` whose cached state replays the partial chunk.

The op sequence is the one of ``docs/hybrid.md`` / the Megatron hybrid layer, op for op::

    zxbcdt = linear(x, W_in)                                   z | xBC | dt
    dt = mamba_dt(dt, dt_bias, *time_step_limit)               float32
    y = mamba_mixer(xBC, dt)         the mixer core, per request, reading and writing vLLM's state cache:
        xBC, conv_state = causal_conv1d(xBC, W_conv, b_conv, conv_state, "silu")
        y, boundary, pending = ssd_continue(boundary, pending, x, dt, B, C, A=-exp(A_log), D, chunk_size)
    out = row_parallel_linear(gated_rms_norm(y, z, W_norm, d_inner // n_groups, eps), W_out)

vLLM allocates and tracks this state per request (one slot per request: prefix
caching is refused for hybrid models).  A slot holds, in this order (``H``, ``conv_dim``: this tensor-parallel
rank's heads and x | B | C channels, see below):

* ``ssm``   ``[H, P, N]`` float32 — the SSD state at the last chunk boundary
  (absolute positions ``0, L, 2L, ...``, ``L = chunk_size``), NOT after the last token;
* ``dt``    ``[L, H]`` float32 — ``dt`` of the pending tokens (rows ``0..p-1``);
* ``conv``  ``[K-1, conv_dim]`` model dtype — the last ``K-1`` conv inputs;
* ``xbc``   ``[L, conv_dim]`` model dtype — post-conv ``x | B | C`` of the pending tokens,

with ``p = num_computed_tokens % L`` pending tokens.  Every prefill piece and every
decode step calls :func:`kernels.ssd_continue` from the boundary state with the pending
tokens, so each output has the bits of the whole-sequence :func:`kernels.ssd_scan`
whatever the chunked-prefill cut, the decode step or the batch.  A request's
``num_computed_tokens`` comes from vLLM's metadata (``seq_lens - query_len``); a request
with none computed starts from zeros.

The step's one-token requests (vLLM puts them first) run together on the device alone (:meth:`ConsistentMambaMixer._step`:
each replays its pending tokens, its new token and zeros after, asking its own row only, read in place from the cache
by :func:`kernels.ssd_step_outputs`; the closing requests' new boundary states formed in place by
:func:`kernels.ssd_step_end_states`): no host reads.  Prefill pieces are read on the host (request sizes, state
slots, computed counts; once a step, :func:`prefill_pieces`) and those with the same (new tokens, pending) sizes
run as one batched call (the kernels are batch-invariant).

torch.compile and CUDA graphs (vLLM 0.26 on CUDA).  Grouping prefill pieces is data-dependent Python that no CUDA
graph can replay, so the mixer core is fenced off the way vLLM fences its own ``mamba_mixer2``: it is one opaque
custom op, ``megatron_consistent::mamba_mixer`` (:data:`MIXER_OP`), writing ``y`` into a buffer the compiled graph
allocates (a piecewise graph reads it at its captured address), and :func:`run_mixer_between_graphs` adds it to the
compilation config's ``splitting_ops``: vLLM cuts the compiled graph at it, captures the pieces between mixers as
piecewise CUDA graphs and runs the op eagerly between them in steps with prefills.  Its attention backend
(:class:`ConsistentMamba2Backend`, vLLM's Mamba-2 metadata unchanged) declares vLLM's own Mamba-2 support
(``UNIFORM_BATCH``): vLLM keeps its default ``FULL_AND_PIECEWISE`` and captures decode-only steps whole in full CUDA
graphs, mixer included (:meth:`ConsistentMambaMixer._step` has no host reads; the rows vLLM pads a captured batch
with run too, on its null block).  ``MC_HYBRID_DECODE_GRAPHS=0`` declares no full-graph support
(``AttentionCGSupport.NEVER``): vLLM resolves the default to ``PIECEWISE`` and the mixer runs between piecewise
graphs in every step (same bits; session 26 on the H200: 0.48x the rollout speed).

Everything else of the layer (in/out projections, ``mamba_dt``, the gated norm) is compiled and captured, each
an opaque op of :mod:`..kernels.inference_ops`.  Rows the mixer does not compute (the padding of a piecewise
graph's batch) are zeros.

Tensor parallelism (TP = t dividing ``n_groups``, hence the heads): rank r holds heads ``[r H/t, (r+1) H/t)`` and
the groups they read, ``[r G/t, (r+1) G/t)`` (:meth:`..config.SSMConfig.per_rank`; a group's heads are
consecutive) -- its rows of every ``in_proj`` block z | x | B | C | dt and its ``conv1d`` channels of x | B | C (the
weight table's ``blocks`` rule), its ``dt_bias`` / ``A_log`` / ``D`` and gated-norm weight -- so its ``in_proj``
output is z | xBC | dt of its own heads and groups, in the layout of a one-rank mixer with ``H/t`` heads and ``G/t``
groups, and its state slot (sized by that mixer, as vLLM sizes its own Mamba-2 state per rank) holds only their
states.  Every op between ``in_proj`` and ``out_proj`` reduces within one channel (conv), one head (``dt``, the
scan) or one group (the gated norm's sum of squares over ``d_inner / G`` channels), so the rank computes whole the
values it owns; ``out_proj`` is the row-parallel tree (:func:`.parallel.row_parallel_for`): the bits of TP = 1.
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
from ..kernels import (causal_conv1d, inference_ops, ssd_continue, ssd_step_end_states, ssd_step_outputs,
                       ssm_decay_rate)
from ..kernels.ssd import torch_ssd_evaluation
from ..kernels.dispatch import env_switch
from . import probe
from .parallel import row_parallel_for, tp_rank_size

MIXER_OP = "megatron_consistent::mamba_mixer"


def decode_graphs() -> bool:
    """``MC_HYBRID_DECODE_GRAPHS``: on (the default since session 26: `check` zero on the H200, 2.1x the piecewise
    rollout) vLLM may capture decode-only steps, the mixer included, in full CUDA graphs; ``0``: the mixer between
    piecewise graphs in every step.  With ``MC_SSD_SCAN=torch`` (the torch reference, whose decode step reads the
    host) off by default, and asking for it then is refused by name."""
    torch_ssd = torch_ssd_evaluation()
    on = env_switch("MC_HYBRID_DECODE_GRAPHS", default=not torch_ssd)
    if on and torch_ssd:
        raise ValueError("MC_HYBRID_DECODE_GRAPHS=1 with MC_SSD_SCAN=torch: the torch reference's decode step reads the "
                         "host and cannot run in a CUDA graph; set MC_HYBRID_DECODE_GRAPHS=0")
    return on


DECODE_GRAPHS = decode_graphs()


class ConsistentMamba2MetadataBuilder(Mamba2AttentionMetadataBuilder):
    """vLLM's Mamba-2 metadata, declaring vLLM's own full-CUDA-graph support (uniform decode batches: the mixer's
    decode step has no host reads), or with ``MC_HYBRID_DECODE_GRAPHS=0`` none (the mixer between piecewise graphs)."""

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


class PrefillPiece(NamedTuple):
    """Prefill requests of a step with equal (new tokens, pending count), run as one batched call."""

    rows: torch.Tensor  # [k, n] their tokens' rows of the step
    slots: list[int]  # their state slots
    computed: list[int]  # their computed tokens


def prefill_pieces(requests: list[tuple[int, int, int, int]], chunk_size: int, device) -> list[PrefillPiece]:
    """``requests`` ((first row, new tokens, state slot, computed tokens) each) grouped by (new tokens, pending
    count)."""
    groups: dict[tuple[int, int], list] = {}
    for first, n, slot, c in requests:
        groups.setdefault((n, c % chunk_size), []).append((first, slot, c))
    return [PrefillPiece(torch.tensor([r[0] for r in reqs], dtype=torch.int64, device=device)[:, None]
                         + torch.arange(n, device=device)[None, :], [r[1] for r in reqs], [r[2] for r in reqs])
            for (n, _), reqs in groups.items()]


class ConsistentMambaMixer(MambaBase, nn.Module):
    """The Mamba-2 mixer of one layer (input: the layer's normed hidden states ``[T, hidden]``).

    Small parameters (``A_log``, ``D``, ``dt_bias``, conv weight/bias, gated-norm weight)
    are held in float32 — every kernel reads them as float32, so this is bit-neutral and
    loads a float32 or a bf16 checkpoint exactly.  ``ssm``: the mixer this tensor-parallel rank holds (its heads and
    groups; the whole mixer at TP = 1).
    """

    _last_pieces: ClassVar[tuple] = (None, None)  # (metadata, its prefill pieces), for the step's other mixers

    def __init__(self, arch: ArchConfig, vllm_config, prefix: str):
        nn.Module.__init__(self)
        _, tp = tp_rank_size()
        s = arch.ssm.per_rank(tp)
        self.arch, self.ssm, self.prefix = arch, s, prefix
        # the row-parallel tree over the model's S segments (TP > 1: this rank's K shard, subtrees all-gathered)
        self.out = row_parallel_for(arch.row_parallel_segments, tp)
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
        g = inference_ops.gated_rms_norm(y, z, self.norm_weight, s.group_size, s.norm_eps)
        cap = probe.PROBE
        if cap is not None:  # names: layer<i>.in_proj / .dt / .ssd (conv + scan + D) / .gated_norm
            layer = "layer" + self.prefix.split(".")[-2]
            for name, val in (("in_proj", zxbcdt), ("dt", dt), ("ssd", y), ("gated_norm", g)):
                cap(f"{layer}.{name}", val)
        return self.out(g, self.out_proj)

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
        b = meta.num_decodes  # vLLM puts the one-token requests first
        if DECODE_GRAPHS and meta.num_prefills == 0:
            b = meta.state_indices_tensor_d.shape[0]  # a captured batch's padded rows included
        if b:
            out = self._step(xbc[:b], dt[:b], meta.state_indices_tensor_d[:b, 0], meta.seq_lens[:b])
            y[:b] = out.reshape(b, s.d_inner)
        if meta.num_prefills:
            for rows, slots, computed in self._prefill_pieces(meta, xbc.device):
                out = self._run(xbc[rows], dt[rows], (slots, computed))
                y[rows.reshape(-1)] = out.reshape(-1, s.d_inner)

    def _prefill_pieces(self, meta, device: torch.device) -> list[PrefillPiece]:
        """The step's :class:`PrefillPiece` list, built by the first mixer that reads this metadata and reused by
        the others (every mixer of a step reads the same metadata: its host reads and index copies happen once a
        step)."""
        last_meta, pieces = ConsistentMambaMixer._last_pieces
        if last_meta is not meta:
            pieces = prefill_pieces(self._prefills(meta), self.ssm.chunk_size, device)
            ConsistentMambaMixer._last_pieces = (meta, pieces)
        return pieces

    @staticmethod
    def _prefills(meta) -> list[tuple[int, int, int, int]]:
        """(first row, new tokens, state slot, computed tokens) of every prefill request (after the decodes)."""
        nd, npf = meta.num_decodes, meta.num_prefills
        seq_lens = meta.seq_lens[nd:nd + npf].to(torch.int64).tolist()
        qsl = (meta.query_start_loc_p.to(torch.int64) + meta.num_decode_tokens).tolist()
        slots = meta.state_indices_tensor_p.tolist()
        return [(qsl[j], qsl[j + 1] - qsl[j], slots[j], seq_lens[j] - (qsl[j + 1] - qsl[j])) for j in range(npf)]

    def _step(self, xbc: torch.Tensor, dt: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """One new token for each of ``b`` requests: ``xbc [b, conv_dim]``, ``dt [b, H]``, their state ``slots [b]``
        and lengths ``seq_lens [b]`` (the new token included), on the device.  Returns ``y [b, H, P]``.

        Request ``i``'s pending count ``p_i = (seq_lens_i - 1) % L`` and whether it is a first token come from
        ``seq_lens`` on the device.  Its replay is its pending tokens ``r < p_i`` (the cache's rows), its new token
        (``r == p_i``) and zeros after -- exactly the zero padding the scan gives a partial chunk, so its output at row
        ``p_i`` has the bits of :func:`kernels.ssd_continue`: :func:`kernels.ssd_step_outputs` reads that replay in
        place from the cache.  The new token is then written to the cache, and :func:`kernels.ssd_step_end_states`
        forms the new boundary states of the requests whose token completes the chunk (``p == L - 1``) in place in
        the state cache, a first token's slot zeroed, every other slot's state untouched.  No host reads and fixed
        shapes: vLLM can capture a decode step in a full CUDA graph (``MC_HYBRID_DECODE_GRAPHS=1``); rows vLLM pads a
        captured batch with read and write its null block (slot 0, never a request's)."""
        s = self.ssm
        ssm_c, dt_c, _, xbc_c = self.kv_cache
        L = s.chunk_size
        computed = seq_lens.to(torch.int64) - 1
        p = torch.remainder(computed, L)
        fresh = computed == 0
        new_xbc = self._conv(xbc, slots, fresh)
        A = ssm_decay_rate(self.A_log)
        y = ssd_step_outputs(xbc_c, dt_c, ssm_c, slots, p, new_xbc, dt, A, self.D, L, s.n_groups, s.state_size, fresh)
        xbc_c[slots, p] = new_xbc
        dt_c[slots, p] = dt.to(torch.float32)
        ssd_step_end_states(xbc_c, dt_c, ssm_c, slots, p == L - 1, fresh, A, L, s.n_groups, s.state_size)
        return y

    def _conv(self, xbc, slots, fresh) -> torch.Tensor:
        """The conv of the new tokens ``xbc [b, conv_dim]`` from their slots' conv states (``fresh`` rows: zeros), the
        new conv states written; returns the post-conv tokens ``[b, conv_dim]``."""
        conv_c = self.kv_cache[2]
        conv_state = torch.where(fresh[:, None, None], 0, conv_c[slots])
        new_xbc, new_conv = causal_conv1d(xbc[:, None], self.conv_weight[:, 0, :], self.conv_bias, conv_state, "silu")
        conv_c[slots] = new_conv
        return new_xbc[:, 0]

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

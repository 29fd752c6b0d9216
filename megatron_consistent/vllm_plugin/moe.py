"""MoE decoder layer of the vLLM plugin (Qwen3-MoE, Qwen2-MoE with shared expert, Mixtral) on the MoE kernels.

The MLP of an MoE layer is, op for op, the Megatron-side
:class:`megatron_consistent.layers.moe.ConsistentMoELayer`::

    z = router_logits(x, W_router)            (float32, batch-invariant linear)
    w, experts = route_logits(z, k, softmax, norm_topk_prob)   (stable top-k: lowest index wins ties)
    out = moe_experts(x, experts, w, W_fc1[E,2I,H], W_fc2[E,H,I], shared)   (slot-order float32 combine, one rounding)

each an opaque custom op of :mod:`..kernels.inference_ops` with no host read and no data-dependent shape, so vLLM
compiles the MoE model and replays it as CUDA graphs like the dense one.

Tensor parallelism (t > 1; :mod:`.parallel`): the experts are sharded like the trainer's -- rank r holds experts
``[r E/t, (r+1) E/t)`` (the weight table's ``experts`` rule), router and shared expert replicated::

    y_r = moe_owned_expert_outputs(x, experts, r E/t, W_fc1[run], W_fc2[run])   ([T, k, H]; +0.0 for others' pairs)
    y = sum_owned_slots(y_r)                  (all-gather in rank order, sum: one value + zeros per element, exact)
    out = moe_combine(x, y, w, shared)        (the slot-order combine and shared expert of moe_experts)

Parameters are held in the Megatron stacked layout; the MoE family's weight table
(:mod:`megatron_consistent.architectures.moe`) maps the HF per-expert tensor names to views of
them for ``load_weights``.

Route recording (off by default): with ``MEGATRON_CONSISTENT_ROUTES=<folder>``
in the engine's environment every model forward that vLLM scheduled writes
``routes<NNNNNN>.safetensors`` with ``positions [T]``, ``request [T]`` (the
``LLM.generate`` prompt index: vLLM's request id ``"<index>-<suffix>"``) and
``experts [num_moe_layers, T, k]``.  The forward copies its positions and each MoE layer's experts into fixed
device buffers (the ``record_rows`` custom op: no host read, no data-dependent shape), so a recording engine
compiles and replays CUDA graphs like any other; after each runner step the rows that step scheduled are written,
their requests from the runner's batch order (:func:`.compat.install_step_hooks`, for both of vLLM's runners).
Forwards not prepared by the runner (profile / warm-up / capture runs) are not recorded.  vLLM's compile cache is
keyed by config and source files, not by this environment variable, so a compiled recording engine must run with
``VLLM_DISABLE_COMPILE_CACHE=1`` (refused by name otherwise: ``model.check_engine_config``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..kernels import inference_ops
from .compat import install_step_hooks
from .decoder_layer import ConsistentDecoderLayer, _param
from .parallel import sum_owned_slots, tp_rank_size

ROUTES_ENV = "MEGATRON_CONSISTENT_ROUTES"
_BATCH: dict = {"rows": None}  # set after the runner prepared a step: [(request index, num tokens)]


def _note_batch(rows: list[tuple[str, int]]) -> None:
    """Requests ``"<index>-..."`` of a generate call; a step with any other request (vLLM's ``_warmup_*`` kernel
    warm-up batch) is not recorded."""
    heads = [str(r).split("-")[0] for r, _ in rows]
    recordable = all(h.isdigit() for h in heads)
    _BATCH["rows"] = [(int(h), int(c)) for h, (_, c) in zip(heads, rows)] if recordable else None


def _flush_recorder() -> None:
    if RECORDER is not None:
        RECORDER.flush()


@torch.library.custom_op("megatron_consistent::record_rows", mutates_args=("dst",))
def record_rows(dst: torch.Tensor, src: torch.Tensor, index: int) -> None:
    """``dst[index, :n] = src[:n]`` with ``n = min(len(src), dst.shape[1])``: a forward's rows into a fixed buffer."""
    n = min(src.shape[0], dst.shape[1])
    dst[index, :n].copy_(src[:n].reshape(dst[index, :n].shape))


@record_rows.register_fake
def _record_rows_fake(dst, src, index):
    return None


class RouteRecorder:
    """One runner step's routes in fixed device buffers (graph-safe); a file per step, written after the step.

    ``record(layer, positions, experts)`` is called by every MoE layer of a forward (the first one also records the
    positions); :meth:`flush` runs after the runner's ``execute_model`` for the process's :data:`RECORDER`.  The
    buffers are refilled with -1 after each flush, so a step whose forward did not write them (a graph compiled without
    the recorder) fails loudly."""

    def __init__(self, folder: str, moe_layers: tuple[int, ...], top_k: int, max_tokens: int, device):
        self.dir = Path(folder)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.slot = {layer: i for i, layer in enumerate(moe_layers)}
        self.first = moe_layers[0]
        self.positions = torch.full((1, max_tokens), -1, dtype=torch.int64, device=device)
        self.experts = torch.full((len(moe_layers), max_tokens, top_k), -1, dtype=torch.int64, device=device)
        self.step = 0
        install_step_hooks(_note_batch, _flush_recorder)

    def record(self, layer_idx: int, positions: torch.Tensor, experts: torch.Tensor) -> None:
        if layer_idx == self.first:
            record_rows(self.positions, positions, 0)
        record_rows(self.experts, experts, self.slot[layer_idx])

    def flush(self) -> None:
        from safetensors.torch import save_file

        rows, _BATCH["rows"] = _BATCH["rows"], None
        n = sum(c for _, c in rows) if rows else 0
        if n == 0:
            return
        if n > self.positions.shape[1]:
            raise RuntimeError(f"{ROUTES_ENV}: a step of {n} tokens exceeds the buffers' {self.positions.shape[1]} rows")
        # host copies (the read waits for the step's forward); the buffers are reset below
        positions = self.positions[0, :n].contiguous().to("cpu", copy=True)
        experts = self.experts[:, :n].contiguous().to("cpu", copy=True)
        if (positions < 0).any() or (experts < 0).any():
            raise RuntimeError(f"{ROUTES_ENV}: step {self.step}'s forward did not record its routes (a compiled graph "
                               "without the recorder, e.g. from vLLM's compile cache: set VLLM_DISABLE_COMPILE_CACHE=1)")
        self.positions.fill_(-1)
        self.experts.fill_(-1)
        req = torch.cat([torch.full((c,), r, dtype=torch.int64) for r, c in rows])
        save_file({"positions": positions, "request": req, "experts": experts},
                  str(self.dir / f"routes{self.step:06d}.safetensors"))
        self.step += 1


RECORDER: RouteRecorder | None = None


def start_recorder(arch, vllm_config) -> None:
    """Start the process's :data:`RECORDER` (once) when :data:`ROUTES_ENV` names an output folder; buffers for the
    engine's largest step (``max_num_batched_tokens``) on its device."""
    if os.environ.get(ROUTES_ENV) and RECORDER is None:
        set_recorder(RouteRecorder(os.environ[ROUTES_ENV], arch.moe_layers, arch.num_experts_per_tok,
                                   vllm_config.scheduler_config.max_num_batched_tokens,
                                   torch.device(vllm_config.device_config.device)))


def set_recorder(recorder: RouteRecorder | None) -> None:
    """Make ``recorder`` the process's :data:`RECORDER` (flushed after every runner step)."""
    global RECORDER
    RECORDER = recorder


class ConsistentMoEDecoderLayer(ConsistentDecoderLayer):
    """The plugin's decoder layer with the MLP replaced by the MoE block (attention part inherited).

    At TP = t > 1 the attention is sharded as in the dense layer; the layer holds the experts ``[r E/t, (r+1) E/t)``
    of its rank r (``experts_fc1`` / ``experts_fc2``), the router and the shared expert whole (every rank routes every
    token; the model starts the route recorder on rank 0 only)."""

    MLP_OPS = ("router_logits", "routes", "moe_out")

    def __init__(self, arch, cache_config, prefix: str):
        super().__init__(arch, cache_config, prefix)
        a, dt = arch, arch.torch_dtype
        del self.gate_up_proj, self.down_proj
        rank, self.tp_size = tp_rank_size()
        run, inter = a.num_experts // self.tp_size, a.moe_intermediate_size  # the model refused E not divisible by t
        self.expert_first = rank * run
        self.router = _param(a.num_experts, a.hidden_size, dtype=dt)
        self.experts_fc1 = _param(run, 2 * inter, a.hidden_size, dtype=dt)
        self.experts_fc2 = _param(run, a.hidden_size, inter, dtype=dt)
        self.shared = None
        if a.shared_expert_intermediate_size:
            s = a.shared_expert_intermediate_size
            self.shared_fc1 = _param(2 * s, a.hidden_size, dtype=dt)
            self.shared_fc2 = _param(a.hidden_size, s, dtype=dt)
            self.shared_gate = _param(1, a.hidden_size, dtype=dt)
            self.shared = (self.shared_fc1, self.shared_fc2, self.shared_gate)

    def mlp_forward(self, x: torch.Tensor, positions: torch.Tensor):
        """(router logits, routed experts, MLP output) of ``x [T, H]``: opaque custom ops with no host read."""
        z = self.lin["router_logits"](x, self.router)
        w, experts = inference_ops.moe_route(z, self.arch.num_experts_per_tok, "softmax", None, self.arch.norm_topk_prob, 1, 1, 1.0)
        if RECORDER is not None:
            RECORDER.record(self.idx, positions, experts)
        return z, experts, routed_experts(x, experts, w, self.experts_fc1, self.experts_fc2, self.shared or (None, None, None),
                                          "swiglu", self.expert_first, self.tp_size)


def routed_experts(x: torch.Tensor, experts: torch.Tensor, w: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor,
                   shared: tuple, activation: str, first: int, tp_size: int) -> torch.Tensor:
    """The MoE block's output for routes ``(w, experts)``, the layer holding experts ``[first, first + len(fc1))`` and
    the shared expert ``shared`` (its three tensors or ``None``s): at TP = 1 ``moe_experts``; at TP > 1 this rank's
    experts' (token, slot) outputs, summed over the ranks (:func:`.parallel.sum_owned_slots`) and combined in slot
    order with the shared expert -- the bits of TP = 1."""
    if tp_size == 1:
        return inference_ops.moe_experts(x, experts, w, fc1, fc2, *shared, activation)
    mine = inference_ops.moe_owned_expert_outputs(x, experts, first, fc1, fc2, activation)
    return inference_ops.moe_combine(x, sum_owned_slots(mine), w, *shared, activation)


def decoder_layer_class(arch, idx: int):
    """The plugin's layer class for layer ``idx``: MoE where the config says so, dense otherwise."""
    return ConsistentMoEDecoderLayer if arch.layer_is_moe(idx) else ConsistentDecoderLayer

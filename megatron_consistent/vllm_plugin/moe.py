"""MoE decoder layer of the vLLM plugin (Qwen3-MoE, Qwen2-MoE with shared expert, Mixtral) on the MoE kernels.

The MLP of an MoE layer is, op for op, the Megatron-side
:class:`megatron_consistent.layers.moe.ConsistentMoELayer`::

    z = router_logits(x, W_router)            (float32, batch-invariant linear)
    w, experts = route_logits(z, k, softmax, norm_topk_prob)   (stable top-k: lowest index wins ties)
    out = moe_experts(x, experts, w, W_fc1[E,2I,H], W_fc2[E,H,I], shared)   (slot-order float32 combine, one rounding)

each an opaque custom op of :mod:`..kernels.inference_ops` with no host read and no data-dependent shape, so vLLM
compiles the MoE model and replays it as CUDA graphs like the dense one.

Parameters are held in the Megatron stacked layout; the MoE family's weight table
(:mod:`megatron_consistent.architectures.moe`) maps the HF per-expert tensor names to views of
them for ``load_weights``.

Route recording (off by default): with ``MEGATRON_CONSISTENT_ROUTES=<folder>``
in the engine's environment every model forward that vLLM scheduled writes
``routes<NNNNNN>.safetensors`` with ``positions [T]``, ``request [T]`` (the
``LLM.generate`` prompt index: vLLM's request id ``"<index>-<suffix>"``) and
``experts [num_moe_layers, T, k]``.  The request of each row comes from the
model runner's batch order (``GPUModelRunner._prepare_inputs`` is wrapped to
note ``input_batch.req_ids`` and the scheduled token counts; rows are laid out
in that order; :func:`.compat.install_batch_hook` for both of vLLM's runners).  Forwards not prepared by the runner (profile / warm-up runs)
are not recorded.  Recording is Python per forward: an engine that records runs eager (``model.eager_only_reason``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..kernels import inference_ops
from .compat import install_batch_hook
from .decoder_layer import ConsistentDecoderLayer, _param
from .parallel import tp_rank_size

ROUTES_ENV = "MEGATRON_CONSISTENT_ROUTES"
_BATCH: dict = {"rows": None}  # set by the wrapped _prepare_inputs: [(request index, num tokens)]


def _note_batch(rows: list[tuple[str, int]]) -> None:
    _BATCH["rows"] = [(int(str(r).split("-")[0]), int(c)) for r, c in rows]


class RouteRecorder:
    """Collects one forward's experts per MoE layer; writes a file when the last MoE layer has run."""

    def __init__(self, folder: str, moe_layers: tuple[int, ...]):
        self.dir = Path(folder)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.layers = moe_layers
        self.step = 0
        self.cur: dict | None = None
        install_batch_hook(_note_batch)

    def __call__(self, layer_idx: int, positions: torch.Tensor, experts: torch.Tensor) -> None:
        from safetensors.torch import save_file

        if layer_idx == self.layers[0]:
            rows, _BATCH["rows"] = _BATCH["rows"], None
            n = sum(c for _, c in rows) if rows else 0
            self.cur = None
            if rows and n <= positions.shape[0]:
                req = torch.cat([torch.full((c,), r, dtype=torch.int64) for r, c in rows])
                self.cur = {"positions": positions[:n].to(torch.int64).clone(), "request": req, "experts": [], "n": n}
        if self.cur is None:
            return
        self.cur["experts"].append(experts[: self.cur["n"]].clone())
        if layer_idx == self.layers[-1]:
            c = self.cur
            save_file({"positions": c["positions"], "request": c["request"], "experts": torch.stack(c["experts"])},
                      str(self.dir / f"routes{self.step:06d}.safetensors"))
            self.step += 1
            self.cur = None


RECORDER: RouteRecorder | None = None


def start_recorder(arch) -> None:
    """Start the process's :data:`RECORDER` (once) when :data:`ROUTES_ENV` names an output folder."""
    global RECORDER
    if os.environ.get(ROUTES_ENV) and RECORDER is None:
        RECORDER = RouteRecorder(os.environ[ROUTES_ENV], arch.moe_layers)


class ConsistentMoEDecoderLayer(ConsistentDecoderLayer):
    """The plugin's decoder layer with the MLP replaced by the MoE block (attention part inherited).

    At TP > 1 the attention is sharded as in the dense layer; the MoE block's parameters (``tp_replicated``) are kept
    whole on every rank and computed from the replicated input, as at TP = 1 (only rank 0 records routes)."""

    tp_replicated = ("router", "experts_fc1", "experts_fc2", "shared_fc1", "shared_fc2", "shared_gate")

    def __init__(self, arch, cache_config, prefix: str):
        super().__init__(arch, cache_config, prefix)
        a, dt = arch, arch.torch_dtype
        del self.gate_up_proj, self.down_proj
        E, inter = a.num_experts, a.moe_intermediate_size
        self.router = _param(E, a.hidden_size, dtype=dt)
        self.experts_fc1 = _param(E, 2 * inter, a.hidden_size, dtype=dt)
        self.experts_fc2 = _param(E, a.hidden_size, inter, dtype=dt)
        self.shared = None
        if a.shared_expert_intermediate_size:
            s = a.shared_expert_intermediate_size
            self.shared_fc1 = _param(2 * s, a.hidden_size, dtype=dt)
            self.shared_fc2 = _param(a.hidden_size, s, dtype=dt)
            self.shared_gate = _param(1, a.hidden_size, dtype=dt)
            self.shared = (self.shared_fc1, self.shared_fc2, self.shared_gate)
        if tp_rank_size()[0] == 0:  # one rank's routes (every rank computes the same ones)
            start_recorder(a)
        self._positions = None

    def forward(self, positions: torch.Tensor, h: torch.Tensor, rope) -> torch.Tensor:
        if RECORDER is not None:  # recording runs eager (model.eager_only_reason)
            self._positions = positions
        return super().forward(positions, h, rope)

    def mlp_forward(self, x: torch.Tensor):
        """(router logits, routed experts, MLP output) of ``x [T, H]``: opaque custom ops with no host read."""
        z = inference_ops.router_logits(x, self.router)
        w, experts = inference_ops.moe_route(z, self.arch.num_experts_per_tok, "softmax", None, self.arch.norm_topk_prob, 1, 1, 1.0)
        if RECORDER is not None:
            RECORDER(self.idx, self._positions, experts)
        shared = self.shared or (None, None, None)
        return z, experts, inference_ops.moe_experts(x, experts, w, self.experts_fc1, self.experts_fc2, *shared, "swiglu")


def decoder_layer_class(arch, idx: int):
    """The plugin's layer class for layer ``idx``: MoE where the config says so, dense otherwise."""
    return ConsistentMoEDecoderLayer if arch.layer_is_moe(idx) else ConsistentDecoderLayer

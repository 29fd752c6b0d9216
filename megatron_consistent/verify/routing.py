"""Routing agreement between the rollout engine and the trainer recompute (MoE models).

* engine side: the routes files the plugin writes under ``MEGATRON_CONSISTENT_ROUTES``
  (:mod:`megatron_consistent.vllm_plugin.moe`): per model forward, each row's
  request index, absolute position and experts ``[num_moe_layers, k]``;
* trainer side: :class:`TrainerRoutes` collects the Megatron model's routes
  (:func:`megatron_consistent.layers.moe.collect_routes`) during the recompute.

``routing_agreement`` = the fraction of (token, MoE layer, top-k slot) triples,
over every token the engine computed (prefill chunks and decode steps; tokens
served from the prefix cache were not computed and are not counted), whose
expert is the same in both.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file


def load_engine_routes(folder: str | Path) -> dict[tuple[int, int], torch.Tensor]:
    """(request index, position) -> experts ``[num_moe_layers, k]`` from the engine's routes files (later steps win)."""
    out: dict[tuple[int, int], torch.Tensor] = {}
    for f in sorted(Path(folder).glob("routes*.safetensors")):
        t = load_file(str(f))
        ex = t["experts"].transpose(0, 1)  # [T, L, k]
        for r, p, e in zip(t["request"].tolist(), t["positions"].tolist(), ex):
            out[(r, p)] = e
    return out


class TrainerRoutes:
    """Sink for the recompute: ``sink(first_request, lengths, routes)`` with routes ``{layer: [S*B, k]}`` in [s, b] order."""

    def __init__(self):
        self.by_request: dict[int, torch.Tensor] = {}  # request -> [S, L, k]

    def __call__(self, first: int, lengths: list[int], routes: dict[int, torch.Tensor]) -> None:
        if not routes:
            return
        b = len(lengths)
        stacked = torch.stack([routes[i] for i in sorted(routes)])  # [L, S*B, k]
        stacked = stacked.reshape(stacked.shape[0], -1, b, stacked.shape[-1])  # [L, S, B, k]
        for j, n in enumerate(lengths):
            self.by_request[first + j] = stacked[:, :n, j].transpose(0, 1).clone()  # [n, L, k]


def routing_agreement(engine: dict[tuple[int, int], torch.Tensor], trainer: TrainerRoutes) -> dict:
    """``{"routing_agreement", "routed_tokens", "routed_pairs"}``; a token the trainer did not see counts as disagreeing."""
    same = total = 0
    for (r, p), e in engine.items():
        t = trainer.by_request.get(r)
        total += e.numel()
        if t is not None and p < t.shape[0]:
            same += int((t[p] == e).sum())
    return {"routing_agreement": same / total if total else float("nan"), "routed_tokens": len(engine), "routed_pairs": total}

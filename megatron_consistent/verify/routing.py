"""Routing agreement between the rollout engine and the trainer recompute (MoE models).

* engine side: the routes files the plugin writes under ``MEGATRON_CONSISTENT_ROUTES``
  (:mod:`megatron_consistent.vllm_plugin.moe`): per model forward, each row's
  request index, absolute position and experts ``[num_moe_layers, k]``;
* for the routing-replay baseline, the stock engine's routes (captured without the plugin,
  :mod:`megatron_consistent.verify.stock_routes`, same file format) are turned into the
  forced routes of each recompute batch by :class:`ReplayRoutes`;
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
            self.by_request[first + j] = stacked[:, :n, j].transpose(0, 1).cpu().clone()  # [n, L, k], on the CPU as the engine's


def routing_agreement(engine: dict[tuple[int, int], torch.Tensor], trainer: TrainerRoutes, as_sets: bool = False,
                      moe_layers: tuple[int, ...] | None = None) -> dict:
    """``{"routing_agreement", "routed_tokens", "routed_pairs", "routing_agreement_by_layer"}`` and, where a route
    differs, ``first_route_divergence``; a token the trainer did not see counts as disagreeing.

    ``as_sets``: compare each token's k experts per layer after sorting them (for the stock
    engine, whose CPU router's ``torch.topk(sorted=False)`` leaves the slot order unspecified).
    ``first_route_divergence`` localises the divergence: the lowest MoE layer where any token's experts differ (below
    it no route differs anywhere, so what differs there is the layer's own input, not an earlier route), and in it the
    earliest position (then the lowest request): ``{"layer", "request", "position", "engine", "trainer"}``, ``layer``
    the model's layer index (``moe_layers``; the MoE-layer slot when not given)."""
    same = total = 0
    layer_same: torch.Tensor | None = None
    layer_total = 0
    first: tuple | None = None
    for (r, p), e in engine.items():
        t = trainer.by_request.get(r)
        total += e.numel()
        layer_total += e.shape[-1]
        if layer_same is None:
            layer_same = torch.zeros(e.shape[0], dtype=torch.int64)
        if t is None or p >= t.shape[0]:
            continue
        a, b = (t[p].sort(-1).values, e.sort(-1).values) if as_sets else (t[p], e)
        eq = a == b
        same += int(eq.sum())
        layer_same += eq.sum(-1)
        bad = (~eq.all(-1)).nonzero()
        if bad.numel() and (first is None or (int(bad[0, 0]), p, r) < first[:3]):
            first = (int(bad[0, 0]), p, r, e[bad[0, 0]].tolist(), t[p][bad[0, 0]].tolist())
    out = {"routing_agreement": same / total if total else float("nan"), "routed_tokens": len(engine), "routed_pairs": total,
           "routing_agreement_by_layer": [] if layer_same is None else [int(x) / layer_total for x in layer_same]}
    if first is not None:
        slot, p, r, e, t = first
        out["first_route_divergence"] = {"layer": moe_layers[slot] if moe_layers else slot, "request": r, "position": p,
                                         "engine": e, "trainer": t}
    return out


class ReplayRoutes:
    """Engine routes -> the forced routes of each recompute batch (``replay(first, lengths, width)``).

    Returns ``{layer: (experts [width*B, k], mask [width*B])}`` in the model's ``[s, b]`` order
    for :func:`megatron_consistent.layers.moe.replay_routes`.  A position the engine did not
    compute for this request (a prefix-cache hit) takes the route recorded for the same token
    prefix (causal attention: the route of position p depends only on tokens[:p+1]) by another
    request, the earliest recorded; a position with no route at all (the last response token, never fed back
    to the engine, and padding) keeps the trainer's own top-k.  :attr:`missing` counts positions
    before the last token of a sequence that had no route (0 expected).
    """

    def __init__(self, engine: dict[tuple[int, int], torch.Tensor], sequences: list[list[int]], moe_layers: tuple[int, ...]):
        self.engine, self.seqs, self.layers = engine, sequences, tuple(moe_layers)
        self.by_prefix: dict[tuple[int, ...], torch.Tensor] = {}
        for (r, p) in sorted(engine):
            self.by_prefix.setdefault(tuple(sequences[r][: p + 1]), engine[(r, p)])
        first = next(iter(engine.values()))
        self.num_layers, self.k = first.shape
        if self.num_layers != len(self.layers):
            raise ValueError(f"engine routes cover {self.num_layers} MoE layers, the model has {len(self.layers)}")
        self.missing = 0
        self.from_prefix = 0

    def __call__(self, first: int, lengths: list[int], width: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        b = len(lengths)
        ex = torch.zeros(self.num_layers, width, b, self.k, dtype=torch.int64)
        mask = torch.zeros(width, b, dtype=torch.bool)
        for j, n in enumerate(lengths):
            r = first + j
            for p in range(n):
                e = self.engine.get((r, p))
                if e is None:
                    e = self.by_prefix.get(tuple(self.seqs[r][: p + 1]))
                    self.from_prefix += e is not None
                if e is None:
                    self.missing += p < n - 1
                    continue
                ex[:, p, j] = e
                mask[p, j] = True
        return {layer: (ex[i].reshape(width * b, self.k), mask.reshape(width * b)) for i, layer in enumerate(self.layers)}

"""``verify.routing.routing_agreement``: the agreement over (token, MoE layer, slot) triples, per layer, and where the
routes first differ (the lowest MoE layer with any differing token, then its earliest position, then request)."""

from __future__ import annotations

import torch

from megatron_consistent.verify.routing import TrainerRoutes, routing_agreement

MOE_LAYERS, K = (1, 3, 5), 2


def _routes(requests: int = 3, length: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    trainer = TrainerRoutes()
    trainer.by_request = {r: torch.randint(0, 64, (length, len(MOE_LAYERS), K), generator=g) for r in range(requests)}
    engine = {(r, p): t[p].clone() for r, t in trainer.by_request.items() for p in range(length)}
    return engine, trainer


def test_identical_routes_agree_everywhere_and_name_no_divergence():
    engine, trainer = _routes()
    out = routing_agreement(engine, trainer, moe_layers=MOE_LAYERS)
    assert out["routing_agreement"] == 1.0 and out["routing_agreement_by_layer"] == [1.0, 1.0, 1.0]
    assert out["routed_tokens"] == 36 and out["routed_pairs"] == 36 * 3 * K
    assert "first_route_divergence" not in out


def test_the_lowest_layer_then_the_earliest_position_is_named():
    engine, trainer = _routes()
    engine[(0, 2)][2, 0] += 1  # layer 5, early position
    engine[(2, 9)][1, 1] += 1  # layer 3, later position: the lowest differing layer
    engine[(1, 7)][1, 0] += 1  # layer 3, earlier position: the first one in that layer
    out = routing_agreement(engine, trainer, moe_layers=MOE_LAYERS)
    d = out["first_route_divergence"]
    assert (d["layer"], d["request"], d["position"]) == (3, 1, 7)
    assert d["engine"] == engine[(1, 7)][1].tolist() and d["trainer"] == trainer.by_request[1][7, 1].tolist()
    assert out["routing_agreement"] == 1 - 3 / (36 * 3 * K)
    assert out["routing_agreement_by_layer"] == [1.0, 1 - 2 / (36 * K), 1 - 1 / (36 * K)]
    assert routing_agreement(engine, trainer)["first_route_divergence"]["layer"] == 1  # the MoE-layer slot without names


def test_as_sets_ignores_slot_order_and_unseen_tokens_disagree():
    engine, trainer = _routes()
    engine[(0, 4)] = engine[(0, 4)].flip(-1)  # same experts, other slot order
    out = routing_agreement(engine, trainer, as_sets=True, moe_layers=MOE_LAYERS)
    assert out["routing_agreement"] == 1.0 and "first_route_divergence" not in out
    assert routing_agreement(engine, trainer, moe_layers=MOE_LAYERS)["first_route_divergence"]["position"] == 4
    engine[(3, 0)] = engine[(0, 0)].clone()  # a request the trainer never saw
    assert routing_agreement(engine, trainer, as_sets=True)["routing_agreement"] == 36 / 37

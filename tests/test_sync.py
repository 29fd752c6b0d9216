"""In-place weight sync: wire-format validation (unit) and a live multiprocess vLLM engine (C7 scenario)."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_consistent.config import ArchConfig
from megatron_consistent.sync.protocol import WeightSyncError, hf_tensor_specs, pack_update, tensor_views, validate_update
from megatron_consistent.rl import TINY_RL_HF_CONFIG

ARCH = ArchConfig.from_hf(TINY_RL_HF_CONFIG)


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(*shape, generator=g).to(getattr(torch, dt)) for n, (shape, dt) in hf_tensor_specs(ARCH).items()}


@pytest.fixture
def packed():
    made = []

    def _pack(tensors, version):
        u = pack_update(tensors, version)
        made.append(u["path"])
        return u

    yield _pack
    for p in made:
        if os.path.exists(p):
            os.unlink(p)


def test_specs_match_megatron_export():
    from megatron_consistent.conversion import hf_state_dict
    from megatron_consistent.layers import build_consistent_gpt_model

    sd = hf_state_dict(build_consistent_gpt_model(ARCH, seed=0), ARCH)
    specs = hf_tensor_specs(ARCH)
    assert sd.keys() == specs.keys()
    for n, t in sd.items():
        assert (tuple(t.shape), str(t.dtype).replace("torch.", "")) == specs[n], n


def test_pack_roundtrip_bitwise(packed):
    tensors = _tensors()
    u = packed(tensors, 1)
    assert validate_update(u, hf_tensor_specs(ARCH), 0) == []
    views = tensor_views(u)
    assert views.keys() == tensors.keys()
    for n, t in tensors.items():
        assert torch.equal(views[n], t), n
        assert views[n].dtype == t.dtype


@pytest.mark.parametrize("case", ["missing", "extra", "shape", "dtype", "stale", "no_file", "overlap"])
def test_validation_refuses(case, packed):
    tensors, specs, version = _tensors(), hf_tensor_specs(ARCH), 1
    names = list(tensors)
    if case == "missing":
        tensors.pop(names[-1])
    elif case == "extra":
        tensors["model.layers.7.bogus.weight"] = torch.zeros(3, dtype=torch.bfloat16)
    elif case == "shape":
        tensors[names[-1]] = tensors[names[-1]][:-1]
    elif case == "dtype":
        tensors[names[0]] = tensors[names[0]].float()
    elif case == "stale":
        version = 0
    u = packed(tensors, version)
    if case == "no_file":
        os.unlink(u["path"])
    if case == "overlap":
        u["tensors"][1]["offset"] = u["tensors"][0]["offset"]
    problems = validate_update(u, specs, current_version=0)
    assert problems, case
    key = {"missing": "missing tensors", "extra": "unexpected tensors", "shape": "wrong shape", "dtype": "wrong dtype",
           "stale": "stale version", "no_file": "does not exist", "overlap": "overlap"}[case]
    assert any(key in p for p in problems), problems


def test_validation_refuses_another_architecture(packed):
    """Every tensor fits, but the sender's model differs in a field no shape shows: refused, naming each field; the
    engine's own architecture (after a JSON round trip, as it crosses the RPC) and the fields that change no value pass."""
    import dataclasses
    import json

    u = packed(_tensors(), 1)
    engine = ARCH.as_dict()
    u["arch"] = json.loads(json.dumps(ARCH.as_dict()))
    assert validate_update(u, hf_tensor_specs(ARCH), 0, expected_arch=engine) == []
    u["arch"] = json.loads(json.dumps(dataclasses.replace(ARCH, dtype="float32", max_position_embeddings=512).as_dict()))
    assert validate_update(u, hf_tensor_specs(ARCH), 0, expected_arch=engine) == []
    other = dataclasses.replace(ARCH, row_parallel_segments=2, rms_norm_eps=1e-5)
    u["arch"] = json.loads(json.dumps(other.as_dict()))
    problems = validate_update(u, hf_tensor_specs(ARCH), 0, expected_arch=engine)
    assert len(problems) == 1 and "another architecture" in problems[0], problems
    assert "row_parallel_segments 2 (update) vs 8 (engine)" in problems[0] and "rms_norm_eps" in problems[0], problems
    u["arch"] = "LlamaForCausalLM"
    assert any("arch must be a dict" in p for p in validate_update(u, hf_tensor_specs(ARCH), 0, expected_arch=engine))
    del u["arch"]  # a push without it (a framework's refit of bare tensors): the tensors alone are checked
    assert validate_update(u, hf_tensor_specs(ARCH), 0, expected_arch=engine) == []


def test_pack_refuses_unsupported_dtype():
    with pytest.raises(WeightSyncError, match="dtype"):
        pack_update({"x": torch.zeros(2, dtype=torch.int64)}, 1)


def test_update_is_plain_json():
    import json

    u = pack_update(_tensors(), 3)
    try:
        assert json.loads(json.dumps(u)) == u  # crosses collective_rpc without pickle
    finally:
        os.unlink(u["path"])


@pytest.mark.engine
def test_live_engine_inplace_updates_and_rejections(tmp_path):
    """>= 3 GRPO steps through a multiprocess vLLM engine: bitwise rollouts, fixed storage, refused bad pushes."""
    from megatron_consistent.verify.lifecycle import check_weight_update

    r = check_weight_update({"out_dir": str(tmp_path), "steps": 3, "prompts": 4, "group": 4, "max_tokens": 2})
    assert r["status"] == "pass", r["detail"] + "\n" + r.get("traceback", "")
    recs = r["records"]
    assert len(recs) >= 3
    for i, rec in enumerate(recs):
        assert rec["bitwise_equal"] and rec["exact_fraction"] == 1.0 and rec["max_abs"] == 0.0, (i, rec)
        assert rec["pointers_unchanged"] and rec["trainer_pointers_unchanged"], (i, rec)
        assert rec["engine_version"] == i + 1 and rec["sync_bytes"] > 0
    assert r["after_last_push"]["bitwise_equal"]
    cases = {e["case"]: e for e in r["rejections"]}
    assert set(cases) == {"missing tensor", "extra tensor", "mis-shaped tensor", "wrong dtype", "stale version",
                          "another architecture"}
    for e in cases.values():
        assert e["refused"] and e["version_unchanged"] and e["pointers_unchanged"], e
        assert e["old_weights_served"] and e["engine_weights_equal_trainer"], e
    assert "stale version" in cases["stale version"]["error"]
    assert "missing tensors" in cases["missing tensor"]["error"]
    assert "row_parallel_segments 4 (update) vs 8 (engine)" in cases["another architecture"]["error"]

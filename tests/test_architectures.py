"""The architecture families' weight tables: one source for the conversion plan, the sync specs and the plugin targets."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_consistent.architectures import engine_views, family, hf_tensor_specs, weight_entries
from megatron_consistent.config import ArchConfig, load_hf_config
from megatron_consistent.conversion import hf_state_dict, megatron_to_hf_names
from megatron_consistent.layers import build_consistent_model
from megatron_consistent.sync.protocol import pack_update, validate_update

MODELS_DIR = Path(__file__).resolve().parents[1] / "megatron_consistent" / "configs" / "models"
MODEL_NAMES = sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").is_file())
PACKAGE = Path(__file__).resolve().parents[1] / "megatron_consistent"


def _arch(name: str) -> ArchConfig:
    return ArchConfig.from_hf(load_hf_config(MODELS_DIR / name))


def test_every_family_has_a_tiny_config():
    assert {family(_arch(n)) for n in MODEL_NAMES} == {"dense", "moe", "hybrid"}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_table_matches_the_megatron_model_and_its_export(name):
    """Megatron names and shapes = the model's parameters; HF names, shapes and dtypes = what the export writes
    (= what a full weight update must carry: sync's specs, for MoE too)."""
    arch = _arch(name)
    model = build_consistent_model(arch, seed=0)
    params = dict(model.named_parameters())
    entries = weight_entries(arch)
    assert [e.megatron for e in entries] == list(megatron_to_hf_names(arch)) and set(params) == {e.megatron for e in entries}
    for e in entries:
        assert tuple(params[e.megatron].shape) == e.shape, e.megatron
    exported = {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in hf_state_dict(model, arch).items()}
    assert exported == hf_tensor_specs(arch)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_engine_views_partition_the_plugin_storage(name):
    """Every entry's engine parameter (held with the Megatron shape) splits into views of the HF shapes, in place,
    covering the storage exactly once; no two entries share an engine parameter."""
    entries = weight_entries(_arch(name))
    assert len({e.engine for e in entries}) == len(entries)
    for e in entries:
        held = torch.arange(torch.Size(e.shape).numel(), dtype=torch.float32).reshape(e.shape)
        views = engine_views(e, held)
        assert [tuple(v.shape) for v in views] == list(e.hf_shapes), e.megatron
        assert all(v.untyped_storage().data_ptr() == held.untyped_storage().data_ptr() for v in views)
        assert torch.equal(torch.sort(torch.cat([v.reshape(-1) for v in views])).values, held.reshape(-1)), e.megatron


@pytest.mark.parametrize("name", ["tiny-qwen3moe-top1", "tiny-qwen2moe-top8-shared", "tiny-mixtral-top2"])
def test_moe_push_into_a_stock_engine_is_accepted(name, monkeypatch):
    """A stock engine (no ``hf_targets``) validates a push against ``hf_tensor_specs``: a full MoE update is accepted
    and handed to vLLM's ``reload_weights`` (stubbed here; the engine round trip is tests/test_sync.py's)."""
    import vllm.config

    from megatron_consistent.sync.worker import WeightSyncExtension

    arch = _arch(name)
    tensors = hf_state_dict(build_consistent_model(arch, seed=0), arch)
    reloaded = []
    runner = SimpleNamespace(model=torch.nn.Linear(2, 2), reload_weights=lambda weights_iterator, **kw: reloaded.extend(weights_iterator))
    worker = WeightSyncExtension()
    worker.model_runner = runner
    worker.vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(to_dict=lambda: load_hf_config(MODELS_DIR / name))))
    monkeypatch.setattr(vllm.config, "set_current_vllm_config", lambda cfg: contextlib.nullcontext())
    update = pack_update(tensors, 1)
    try:
        assert validate_update(update, hf_tensor_specs(arch), 0) == []
        report = worker.mc_sync_apply(update)
    finally:
        os.unlink(update["path"])
    assert report["ok"] and report["model_kind"] == "stock", report
    assert [n for n, _ in reloaded] == list(tensors)


def test_hf_names_live_in_the_family_tables_only():
    """Each family's HF tensor names are spelled in its table module and nowhere else in the package."""
    spelled = {"dense": ['"mlp.gate_proj.weight"', "self_attn.{p}_proj", "post_attention_layernorm.weight", '"model.norm.weight"'],
               "moe": ["shared_expert_gate.weight", '"block_sparse_moe"', "experts.{x}.{n}.weight"],
               "hybrid": ["backbone.norm_f.weight", "gate.e_score_correction_bias", "mixer.shared_experts.up_proj.weight"]}
    sources = {p: p.read_text() for p in PACKAGE.rglob("*.py")}
    for fam, needles in spelled.items():
        for needle in needles:
            where = sorted(str(p.relative_to(PACKAGE)) for p, text in sources.items() if needle in text)
            assert where == [f"architectures/{fam}.py"], (needle, where)

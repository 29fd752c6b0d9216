"""HF safetensors export/import of the Megatron models: bitwise round trip, all-or-nothing validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_consistent.config import ArchConfig, UnsupportedConfigError, load_hf_config
from megatron_consistent.conversion import CheckpointMismatchError, export_hf, import_hf, megatron_to_hf_names
from megatron_consistent.layers import build_consistent_gpt_model, build_stock_gpt_model

MODELS_DIR = Path(__file__).resolve().parents[1] / "megatron_consistent" / "configs" / "models"
# dense / MoE decoders (model.* layout); the hybrid Mamba-2 configs (backbone.* layout) are tested in tests/test_hybrid_megatron.py
MODEL_NAMES = sorted(p.name for p in MODELS_DIR.iterdir()
                     if (p / "config.json").is_file() and not ArchConfig.from_hf(load_hf_config(p)).is_hybrid)


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_params_bitwise(model, expected: dict[str, torch.Tensor]):
    params = dict(model.named_parameters())
    assert params.keys() == expected.keys()
    for n, p in params.items():
        assert p.dtype == expected[n].dtype and torch.equal(p, expected[n]), n


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (source model, exported dir), bf16, seed 0."""
    out = {}
    for name in MODEL_NAMES:
        model = build_consistent_gpt_model(MODELS_DIR / name, seed=0)
        d = tmp_path_factory.mktemp(name)
        export_hf(model, model.arch_config, d)
        out[name] = (model, d)
    return out


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_round_trip_bitwise(name, exported):
    src, d = exported[name]
    arch = src.arch_config
    dst = build_consistent_gpt_model(MODELS_DIR / name, seed=123)
    ptrs = {n: p.data_ptr() for n, p in dst.named_parameters()}
    import_hf(dst, arch, d)
    assert_params_bitwise(dst, snapshot(src))
    assert {n: p.data_ptr() for n, p in dst.named_parameters()} == ptrs  # copied in place
    # file layout
    tensors = load_file(str(d / "model.safetensors"))
    assert ("lm_head.weight" in tensors) == (not arch.tie_word_embeddings)
    assert ("model.layers.0.self_attn.q_proj.bias" in tensors) == arch.qkv_bias
    assert ("model.layers.0.self_attn.q_norm.weight" in tensors) == arch.qk_norm
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (arch.num_heads * arch.head_dim, arch.hidden_size)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (arch.num_kv_heads * arch.head_dim, arch.hidden_size)
    assert tensors["model.embed_tokens.weight"].shape == (arch.vocab_size, arch.hidden_size)
    cfg = json.loads((d / "config.json").read_text())
    assert ArchConfig.from_hf(cfg) == arch
    assert not list(d.glob("*.bin")) and not list(d.glob("*.pt"))


def test_qkv_and_gate_up_layout(exported):
    """linear_qkv rows are [q heads of group g, k_g, v_g] per group; linear_fc1 is [gate; up]."""
    src, d = exported["tiny-mistral-gqa"]
    arch = src.arch_config
    t = load_file(str(d / "model.safetensors"))
    qkv = dict(src.named_parameters())["decoder.layers.1.self_attention.linear_qkv.weight"]
    hd, g = arch.head_dim, arch.num_heads // arch.num_kv_heads
    rows = qkv.reshape(arch.num_kv_heads, g + 2, hd, -1)
    q = t["model.layers.1.self_attn.q_proj.weight"].reshape(arch.num_heads, hd, -1)
    k = t["model.layers.1.self_attn.k_proj.weight"].reshape(arch.num_kv_heads, hd, -1)
    v = t["model.layers.1.self_attn.v_proj.weight"].reshape(arch.num_kv_heads, hd, -1)
    for grp in range(arch.num_kv_heads):
        for j in range(g):
            assert torch.equal(rows[grp, j], q[grp * g + j])
        assert torch.equal(rows[grp, g], k[grp]) and torch.equal(rows[grp, g + 1], v[grp])
    fc1 = dict(src.named_parameters())["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[: arch.intermediate_size], t["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(fc1[arch.intermediate_size :], t["model.layers.0.mlp.up_proj.weight"])


def test_import_into_stock_model(exported):
    src, d = exported["tiny-qwen2-mqa"]
    stock = build_stock_gpt_model(MODELS_DIR / "tiny-qwen2-mqa", seed=9)
    import_hf(stock, src.arch_config, d)
    assert_params_bitwise(stock, snapshot(src))


def _corrupt(src_dir: Path, dst_dir: Path, edit) -> Path:
    dst_dir.mkdir()
    tensors = load_file(str(src_dir / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst_dir / "model.safetensors"))
    (dst_dir / "config.json").write_text((src_dir / "config.json").read_text())
    return dst_dir


@pytest.mark.parametrize(
    "case, edit, message",
    [
        ("missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "missing tensors.*up_proj"),
        ("extra", lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(16)), "unexpected tensors.*inv_freq"),
        ("shape", lambda t: t.__setitem__("model.norm.weight", torch.ones(7, dtype=torch.bfloat16)), r"wrong shape for model.norm.weight"),
        ("dtype", lambda t: t.__setitem__("lm_head.weight", t["lm_head.weight"].float()), r"wrong dtype for lm_head.weight"),
    ],
)
def test_bad_checkpoint_loads_nothing(case, edit, message, exported, tmp_path):
    src, d = exported["tiny-llama"]
    bad = _corrupt(d, tmp_path / case, edit)
    dst = build_consistent_gpt_model(MODELS_DIR / "tiny-llama", seed=5)
    before = snapshot(dst)
    with pytest.raises(CheckpointMismatchError, match=message):
        import_hf(dst, src.arch_config, bad)
    assert_params_bitwise(dst, before)


def test_all_problems_reported_together(exported, tmp_path):
    src, d = exported["tiny-llama"]

    def edit(t):
        t.pop("model.embed_tokens.weight")
        t["bogus"] = torch.zeros(1)
        t["model.norm.weight"] = torch.ones(3, dtype=torch.bfloat16)

    bad = _corrupt(d, tmp_path / "many", edit)
    dst = build_consistent_gpt_model(MODELS_DIR / "tiny-llama", seed=5)
    before = snapshot(dst)
    with pytest.raises(CheckpointMismatchError) as e:
        import_hf(dst, src.arch_config, bad)
    msg = str(e.value)
    assert "missing tensors" in msg and "unexpected tensors" in msg and "wrong shape" in msg and "nothing was loaded" in msg
    assert_params_bitwise(dst, before)


def test_config_and_architecture_problems(exported, tmp_path):
    src, d = exported["tiny-llama"]
    arch = src.arch_config
    # a checkpoint of another architecture (config.json) is refused, nothing loaded
    other = _corrupt(d, tmp_path / "arch", lambda t: None)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 4}))
    dst = build_consistent_gpt_model(MODELS_DIR / "tiny-llama", seed=5)
    before = snapshot(dst)
    with pytest.raises(CheckpointMismatchError, match="num_kv_heads"):
        import_hf(dst, arch, other)
    assert_params_bitwise(dst, before)
    # model/arch disagreement is found before reading any file
    qwen3 = ArchConfig.from_hf(load_hf_config(MODELS_DIR / "tiny-qwen3-qknorm-tied"))
    with pytest.raises(CheckpointMismatchError, match="model lacks parameters"):
        import_hf(dst, qwen3, d)
    assert_params_bitwise(dst, before)
    # unsupported architectures never get a model
    hf = load_hf_config(MODELS_DIR / "tiny-llama")
    with pytest.raises(UnsupportedConfigError, match="unsupported architecture"):
        build_consistent_gpt_model({**hf, "architectures": ["FalconForCausalLM"]})
    with pytest.raises(UnsupportedConfigError, match="tensor parallelism of size 3"):
        build_consistent_gpt_model(hf, tensor_model_parallel_size=3)
    # no pickle checkpoints
    pkl = tmp_path / "pickle"
    pkl.mkdir()
    (pkl / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointMismatchError, match="only safetensors"):
        import_hf(dst, arch, pkl)


def test_name_map_covers_every_parameter(exported):
    for name, (model, _) in exported.items():
        assert set(megatron_to_hf_names(model.arch_config)) == {n for n, _ in model.named_parameters()}, name

"""Issue #10 (integration): spec entry points through each consumer's own code path, vLLM opt-in, refit.

* Every spec entry point is resolved the way its consumer resolves it
  (Megatron's ``import_module`` for ``--spec``; Bridge's ``provide()`` contract;
  slime's ``fn(args, config, vp_stage)``), a ``GPTModel`` is built from it, and
  its float32 logits are compared with ``torch.equal`` to the model of
  ``build_consistent_gpt_model`` holding the same weights.
* vLLM opt-in: without ``MEGATRON_CONSISTENT_VLLM`` the registry is stock; with
  it the original architecture name resolves to our class.
* Refit: one real multiprocess engine started with the environment variable only
  (original architecture name) samples, takes a NeMo-RL-shaped (bucketed) and a
  verl-shaped (per tensor) HF-named stream of new weights through
  ``collective_rpc`` + shared memory, and samples again; the trainer's
  recompute matches both rollouts bit for bit.  Sampled with a generator per request
  (``RolloutRequest.request_seeds``), a prompt alone draws the tokens it drew in the batch.

Zero means zero: ``torch.equal`` only.  This file also runs as a script: the
engine side of the refit test (``python tests/test_integration.py engine REQ RES``).
"""

from __future__ import annotations

import argparse
import re
import dataclasses
import inspect
import json
import os
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ENGINE_MODEL = "tiny-llama"


# --------------------------------------------------------------------------------------------- trainer-side helpers
def _arch(name):
    from megatron_consistent.layers import as_arch_config
    from megatron_consistent.config import builtin_model_dir

    return as_arch_config(builtin_model_dir(name))


def _megatron_lm_args(arch, position_embedding_type="rope"):
    """The Megatron-LM arguments a user of these configs would pass (names as in megatron/training/arguments.py)."""
    return argparse.Namespace(
        rotary_base=arch.rope_theta, rotary_percent=1.0, use_rope_scaling=False, rope_scaling_factor=8.0,
        max_position_embeddings=arch.max_position_embeddings, position_embedding_type=position_embedding_type,
        untie_embeddings_and_output_weights=not arch.tie_word_embeddings, padded_vocab_size=arch.vocab_size)


@pytest.fixture
def megatron_lm_args(monkeypatch):
    """Stand in for Megatron-LM's ``megatron.training.global_vars`` (not shipped with megatron-core): sets its args."""
    holder = {}
    gv = types.ModuleType("megatron.training.global_vars")
    gv.get_args = lambda: holder["args"]
    training = types.ModuleType("megatron.training")
    training.__path__ = []
    training.global_vars = gv
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", gv)

    def set_args(args):
        holder["args"] = args
        return args

    return set_args


def _gpt_model_like_megatron_lm(args, config, spec, vp_stage=None):
    """The GPTModel call of Megatron-LM's gpt_builder / slime's model_provider (same keyword values)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=True, post_process=True, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling, vp_stage=vp_stage)


def _assert_same_logits_as_reference(model, arch):
    """Load the reference model's weights (strict: same state-dict keys) and compare float32 logits bit for bit."""
    from megatron_consistent import kernels
    from megatron_consistent.layers import ConsistentOutputLayer, ConsistentRMSNorm, build_consistent_gpt_model

    ref = build_consistent_gpt_model(arch, seed=0)
    assert isinstance(model.output_layer, ConsistentOutputLayer)
    assert isinstance(model.decoder.final_layernorm, ConsistentRMSNorm)
    model.load_state_dict(ref.state_dict(), strict=True)
    ids = torch.randint(3, arch.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    pos = kernels.causal_positions(*ids.shape)
    with torch.no_grad():
        a, b = ref(ids, pos, None), model(ids, pos, None)
    assert a.dtype == b.dtype == torch.float32
    assert torch.equal(a, b)


@pytest.fixture(scope="module")
def cpu_megatron():
    from megatron_consistent.layers import apply_cpu_shims, init_cpu_process_group

    init_cpu_process_group()
    apply_cpu_shims()  # Megatron's own RotaryEmbedding (computed, then ignored, under 'rope') asks for CUDA otherwise


# ----------------------------------------------------------------------------------------------- 1. spec entry points
@pytest.mark.parametrize("model_name", ["tiny-qwen3-qknorm-tied", "tiny-qwen2-mqa"])
def test_megatron_lm_spec_constant_adapts_to_config(cpu_megatron, megatron_lm_args, model_name):
    """--spec megatron_consistent.layers.entry_points consistent_layer_spec, resolved by Megatron's import_module."""
    from megatron.core.transformer.spec_utils import ModuleSpec, import_module

    from megatron_consistent.layers import make_transformer_config

    arch = _arch(model_name)
    args = megatron_lm_args(_megatron_lm_args(arch))
    spec = import_module(("megatron_consistent.layers.entry_points", "consistent_layer_spec"))  # args.spec, split
    assert isinstance(spec, ModuleSpec)
    # the framework's own config: no use_te_activation_func, no RoPE fields (Megatron-LM passes those to GPTModel)
    config = make_transformer_config(arch, arch.torch_dtype, consistent=False)
    assert not config.use_te_activation_func and config.qk_layernorm == arch.qk_norm and config.add_qkv_bias == arch.qkv_bias
    model = _gpt_model_like_megatron_lm(args, config, spec)
    attn = model.decoder.layers[0].self_attention
    assert (attn.q_layernorm is not None) == arch.qk_norm
    assert (attn.linear_qkv.bias is not None) == arch.qkv_bias
    _assert_same_logits_as_reference(model, arch)


def test_spec_refuses_learned_absolute_positions(cpu_megatron, megatron_lm_args):
    from megatron.core.transformer.spec_utils import import_module

    from megatron_consistent.config import UnsupportedConfigError
    from megatron_consistent.layers import make_transformer_config

    arch = _arch(ENGINE_MODEL)
    args = megatron_lm_args(_megatron_lm_args(arch, position_embedding_type="learned_absolute"))
    spec = import_module(("megatron_consistent.layers.entry_points", "consistent_layer_spec"))
    with pytest.raises(UnsupportedConfigError, match="position_embedding_type='learned_absolute'"):
        _gpt_model_like_megatron_lm(args, make_transformer_config(arch, arch.torch_dtype, consistent=False), spec)


@pytest.mark.parametrize("field, value, words", [
    ("multi_latent_attention", True, "multi-latent attention"),
    ("sequence_parallel", True, "sequence parallelism without tensor parallelism"),
    ("context_parallel_size", 2, "context parallelism (context_parallel_size=2)"),
    ("virtual_pipeline_model_parallel_size", 2, "virtual pipeline stages"),
    ("tensor_model_parallel_size", 3, "tensor parallelism of size 3"),
    ("normalization", "LayerNorm", "unsupported normalization 'LayerNorm'"),
])
def test_entry_point_refuses_by_name_before_building(field, value, words):
    """What the entry-point specs do not implement is refused in one line by the spec call, before any module exists
    (TP 2 / PP 2 / TP 2 + SP are accepted: tests/test_parallel_trainer.py builds them)."""
    from megatron_consistent.config import UnsupportedConfigError
    from megatron_consistent.layers import make_transformer_config
    from megatron_consistent.layers.entry_points import consistent_layer_spec_provider

    arch = _arch(ENGINE_MODEL)
    config = make_transformer_config(arch, arch.torch_dtype, consistent=False)
    setattr(config, field, value)
    with pytest.raises(UnsupportedConfigError, match=re.escape(words)):
        consistent_layer_spec_provider(config)


@pytest.mark.parametrize("model_name, moe_layer_freq", [("tiny-qwen3moe-top1", [0, 1]), ("tiny-qwen2moe-top8-shared", 1)])
def test_function_form_builds_moe_layers_by_moe_layer_freq(cpu_megatron, megatron_lm_args, model_name, moe_layer_freq):
    """A MoE model through ``consistent_layer_spec_provider``: the framework's own TransformerConfig with Megatron's MoE
    fields (``moe_layer_freq`` picking the MoE layers: tiny-qwen3moe-top1's dense layer 0; top-8 with a gated shared
    expert), Megatron's MoELayer with the consistent router and experts -- the logits of ``build_consistent_model`` bit
    for bit.  The ModuleSpec constant (every layer dense) refuses a MoE config by name."""
    from megatron.core.transformer.spec_utils import import_module

    from megatron_consistent.config import UnsupportedConfigError
    from megatron_consistent.layers import make_transformer_config
    from megatron_consistent.layers.entry_points import consistent_layer_spec_provider
    from megatron_consistent.layers.moe_megatron import megatron_moe_config_kwargs

    arch = _arch(model_name)
    args = megatron_lm_args(_megatron_lm_args(arch))
    config = make_transformer_config(arch, arch.torch_dtype, consistent=False, **megatron_moe_config_kwargs(arch),
                                     moe_layer_freq=moe_layer_freq)
    model = _gpt_model_like_megatron_lm(args, config, consistent_layer_spec_provider(config))
    assert [type(layer.mlp).__name__ for layer in model.decoder.layers] == [
        "MoELayer" if arch.layer_is_moe(i) else "MLP" for i in range(arch.num_layers)]
    contexts = [layer.mlp.experts.context for layer in model.decoder.layers if arch.layer_is_moe(layer.layer_number - 1)]
    assert len({id(c) for c in contexts}) == len(contexts)  # each MoE layer its own router-to-experts hand-over
    _assert_same_logits_as_reference(model, arch)
    constant = import_module(("megatron_consistent.layers.entry_points", "consistent_layer_spec"))
    with pytest.raises(UnsupportedConfigError, match="MoE .num_moe_experts. through the ModuleSpec constant"):
        _gpt_model_like_megatron_lm(args, config, constant)


def test_function_forms_megatron_019_builder_and_slime(cpu_megatron, megatron_lm_args):
    """fn(config[, vp_stage]) as the 0.19 builder calls a non-ModuleSpec spec; fn(args, config, vp_stage) as slime does."""
    from megatron.core.transformer.spec_utils import ModuleSpec, import_module

    from megatron_consistent.layers import make_transformer_config

    arch = _arch(ENGINE_MODEL)
    args = megatron_lm_args(_megatron_lm_args(arch))
    # Megatron-LM 0.19 gpt_builder: a spec that is not a ModuleSpec is called with the config (and vp_stage if it takes one)
    fn = import_module(("megatron_consistent.layers.entry_points", "consistent_layer_spec_provider"))
    assert not isinstance(fn, ModuleSpec)
    config = make_transformer_config(arch, arch.torch_dtype, consistent=False)
    spec = fn(config, vp_stage=None) if "vp_stage" in inspect.signature(fn).parameters else fn(config)
    _assert_same_logits_as_reference(_gpt_model_like_megatron_lm(args, config, spec), arch)
    # slime model_provider: `if callable(spec): spec = spec(args, config, vp_stage)` (a ModuleSpec would be called too!)
    slime_spec = import_module(("megatron_consistent.layers.entry_points", "consistent_slime_spec"))
    assert callable(slime_spec) and not isinstance(slime_spec, ModuleSpec)
    megatron_lm_args(None)  # slime's spec reads RoPE from the args it is given, not from globals
    config = make_transformer_config(arch, arch.torch_dtype, consistent=False)
    _assert_same_logits_as_reference(_gpt_model_like_megatron_lm(args, config, slime_spec(args, config, None)), arch)


def _bridge_fields(arch):
    from megatron_consistent.layers import make_transformer_config

    base = make_transformer_config(arch, arch.torch_dtype, consistent=False)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    fields.update(position_embedding_type="rope", rotary_base=arch.rope_theta, rotary_percent=1.0, seq_length=64,
                  vocab_size=arch.vocab_size, share_embeddings_and_output_weights=arch.tie_word_embeddings,
                  should_pad_vocab=False, normalization="RMSNorm", masked_softmax_fusion=False,
                  gradient_accumulation_fusion=False, cross_entropy_loss_fusion=False)
    return fields


def _standin_provider_class():
    """Minimal Megatron-Bridge GPTModelProvider stand-in following its documented contract (gpt_provider.py)."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    @dataclasses.dataclass
    class StandInGPTModelProvider(TransformerConfig):
        position_embedding_type: str = "learned_absolute"
        rotary_base: int = 10000
        rotary_percent: float = 1.0
        seq_len_interpolation_factor: float | None = None
        seq_length: int = 1024
        vocab_size: int | None = None
        should_pad_vocab: bool = False
        share_embeddings_and_output_weights: bool = True
        parallel_output: bool = True
        transformer_layer_spec: object = None
        cross_entropy_loss_fusion: bool = True

        def provide(self, pre_process=None, post_process=None, vp_stage=None):
            spec = self.transformer_layer_spec
            if not isinstance(spec, ModuleSpec):  # Bridge: fn(provider[, vp_stage=...])
                spec = spec(self, vp_stage=vp_stage) if "vp_stage" in inspect.signature(spec).parameters else spec(self)
            return GPTModel(self, transformer_layer_spec=spec, vocab_size=self.vocab_size, max_sequence_length=self.seq_length,
                            parallel_output=self.parallel_output,
                            share_embeddings_and_output_weights=self.share_embeddings_and_output_weights,
                            position_embedding_type=self.position_embedding_type, rotary_percent=self.rotary_percent,
                            rotary_base=self.rotary_base, seq_len_interpolation_factor=self.seq_len_interpolation_factor,
                            pre_process=True, post_process=True, vp_stage=vp_stage)

    return StandInGPTModelProvider


def _real_bridge_provider_class():
    """megatron-bridge's real GPTModelProvider, from an unpacked wheel named by MEGATRON_BRIDGE_SRC (see docs)."""
    src = os.environ.get("MEGATRON_BRIDGE_SRC")
    if not src:
        return None
    root = Path(src) / "megatron" / "bridge"
    for name, path in (("megatron.bridge", root), ("megatron.bridge.models", root / "models"), ("megatron.bridge.utils", root / "utils")):
        if name not in sys.modules:  # skip the package __init__s, which import transformer_engine (CUDA only)
            mod = types.ModuleType(name)
            mod.__path__ = [str(path)]
            sys.modules[name] = mod
    from megatron.bridge.models.gpt_provider import GPTModelProvider

    return GPTModelProvider


@pytest.mark.parametrize("which", ["standin", "real"])
def test_megatron_bridge_provider_function(cpu_megatron, which):
    """GPTModelProvider.transformer_layer_spec = consistent_layer_spec_provider, built by provider.provide()."""
    from megatron_consistent.layers.entry_points import consistent_layer_spec_provider

    cls = _standin_provider_class() if which == "standin" else _real_bridge_provider_class()
    if cls is None:
        pytest.skip("set MEGATRON_BRIDGE_SRC to an unpacked megatron-bridge wheel to run against the real provider")
    arch = _arch(ENGINE_MODEL)
    names = {f.name for f in dataclasses.fields(cls)}
    fields = {k: v for k, v in _bridge_fields(arch).items() if k in names}
    provider = cls(**fields, transformer_layer_spec=consistent_layer_spec_provider)
    if hasattr(provider, "finalize"):
        provider.finalize()
    if "_pg_collection" in names:  # what provide_distributed_model sets before it calls provide()
        from megatron.core.process_groups_config import ProcessGroupCollection

        provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    _assert_same_logits_as_reference(provider.provide(vp_stage=None), arch)


# ------------------------------------------------------------------------------------------------- 2. vLLM opt-in
_REGISTRY_PROBE = r"""
import json, os
from vllm.plugins import load_general_plugins
from vllm import ModelRegistry
from megatron_consistent.config import SUPPORTED_ARCHITECTURES
import megatron_consistent.vllm_plugin as plugin
def where():
    return {a: getattr(ModelRegistry.models[a], "module_name", None) for a in SUPPORTED_ARCHITECTURES}
os.environ[plugin.ENV_VAR] = "0"
load_general_plugins()
off = where()
os.environ[plugin.ENV_VAR] = "1"
plugin.register()
# load_weights bookkeeping on a stand-in holding two parameters (no engine needed)
import torch
from torch import nn
from megatron_consistent.vllm_plugin.model import ConsistentForCausalLM
class Fake(nn.Module):
    load_weights = ConsistentForCausalLM.load_weights
    tp_size = 1  # one rank: whole tensors
    def __init__(self, dummy):
        super().__init__()
        self.arch = type("A", (), {"tie_word_embeddings": False, "architecture": "LlamaForCausalLM"})()
        self.a, self.b = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(2, 3))
        self._loaded_targets, self._dummy_start = set(), dummy
    def hf_targets(self):
        return {"x.weight": self.a[:2], "y.weight": self.a[2:], "z.weight": self.b}
def attempt(model, stream):
    try:
        return sorted(model.load_weights(stream))
    except ValueError as e:
        return "refused: " + str(e)
one = [("z.weight", torch.ones(2, 3))]
rest = [("y.weight", torch.full((2,), 2.0)), ("x.weight", torch.full((2,), 3.0))]
m, d = Fake(False), Fake(True)
ptrs = [m.a.data_ptr(), m.b.data_ptr()]
lw = {"first_partial": attempt(m, one), "first_full": attempt(m, one + rest), "refit_subset": attempt(m, [rest[0]]),
      "values": m.a.tolist(), "same_storage": ptrs == [m.a.data_ptr(), m.b.data_ptr()],
      "unknown": attempt(m, [("w.weight", torch.ones(1))]), "shape": attempt(m, [("z.weight", torch.ones(3, 2))]),
      "dummy_partial": attempt(d, one), "dummy_rest": attempt(d, rest)}
print("PROBE" + json.dumps({"off": off, "on": where(), "load_weights": lw}))
"""


@pytest.mark.slow
def test_vllm_untouched_without_env_var_and_mapped_with_it(tmp_path):
    env = dict(os.environ)
    env.pop("MEGATRON_CONSISTENT_VLLM", None)
    out = subprocess.run([sys.executable, "-c", _REGISTRY_PROBE], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("PROBE")]
    assert line, out.stderr[-2000:]
    probe = json.loads(line[-1][5:])
    assert all(m.startswith("vllm.model_executor.models.") for m in probe["off"].values()), probe["off"]
    from megatron_consistent.config import HYBRID_ARCHITECTURES, SUPPORTED_ARCHITECTURES

    expected = {a: "megatron_consistent.vllm_plugin." + ("hybrid_model" if a in HYBRID_ARCHITECTURES else "model")
                for a in SUPPORTED_ARCHITECTURES}
    assert {a: probe["on"].get(a) for a in SUPPORTED_ARCHITECTURES} == expected, probe["on"]
    # plugin load_weights: the initial load must be complete; refits take any subset, in place; bad names/shapes refused
    lw = probe["load_weights"]
    assert lw["first_partial"].startswith("refused: initial load leaves 2 tensors unset: ['x.weight', 'y.weight']")
    assert lw["first_full"] == ["a", "b"] and lw["refit_subset"] == ["a", "b"]
    assert lw["values"] == [3.0, 3.0, 2.0, 2.0] and lw["same_storage"]
    assert lw["unknown"].startswith("refused: unexpected checkpoint tensor 'w.weight'")
    assert lw["shape"] == "refused: z.weight: checkpoint shape (3, 2) != model (2, 3)"
    assert lw["dummy_partial"] == ["b"] and lw["dummy_rest"] == ["a", "b"]  # load_format="dummy": weights come from refits


# ------------------------------------------------------------------------------------------ 3. refit into a live engine
def _engine_main(req_path: str, res_path: str) -> int:
    """Engine side (its own process): sample, refit through collective_rpc (twice), sample again; JSON out."""
    from megatron_consistent.verify.rollout import RolloutRequest, engine, generate

    req = json.loads(Path(req_path).read_text())
    rreq = RolloutRequest(**req["rollout"])
    llm = engine(rreq)
    res = {"pointers_before": llm.collective_rpc("mc_weight_pointers")[0], "before": generate(llm, rreq)}
    seeded = dataclasses.replace(rreq, request_seeds=True)  # a generator per request: the batch, then prompt 3 alone
    res["seeded"] = [generate(llm, seeded), generate(llm, dataclasses.replace(seeded, prompts=rreq.prompts[3:4], seed=rreq.seed + 3))]
    res["updates"] = [llm.collective_rpc("mc_update_weights_from_shm", args=(m,))[0] for m in req["manifests"]]
    llm.reset_prefix_cache()
    res["after"] = generate(llm, rreq)
    res["bad"] = [llm.collective_rpc("mc_update_weights_from_shm", args=(m,))[0] for m in req["bad_manifests"]]
    res["pointers_after"] = llm.collective_rpc("mc_weight_pointers")[0]
    Path(res_path).write_text(json.dumps(res))
    return 0


@pytest.mark.engine
def test_refit_stream_updates_live_engine_in_place(tmp_path):
    from safetensors.torch import load_file

    from megatron_consistent.conversion import export_hf
    from megatron_consistent.integration import nemo_rl_metrics
    from megatron_consistent.layers import build_consistent_gpt_model
    from megatron_consistent.sync.protocol import pack_update
    from megatron_consistent.verify.check import recompute
    from megatron_consistent.verify.metrics import mismatch_metrics

    arch = _arch(ENGINE_MODEL)
    old, new = build_consistent_gpt_model(arch, seed=0), build_consistent_gpt_model(arch, seed=1)
    export_hf(old, arch, tmp_path / "old")
    export_hf(new, arch, tmp_path / "new")
    stream = list(load_file(str(tmp_path / "new" / "model.safetensors")).items())  # HF names, as export_hf_weights yields
    random.Random(0).shuffle(stream)  # any order
    half = len(stream) // 2
    # NeMo-RL: buckets of ~refit_buffer_size bytes, each into model.load_weights; verl: one tensor at a time
    nemo_rl_like = pack_update(stream[:half], bucket_bytes=8192, arch=arch)  # with the sender's architecture: checked, accepted
    verl_like = pack_update(stream[half:], bucket_bytes=0)
    name0, t0 = stream[0]
    unknown = pack_update([("model.layers.99.mlp.up_proj.weight", t0)])
    wrong_shape = pack_update([(name0, t0.reshape(-1)[: t0.numel() // 2])])
    # the same tensors from a trainer whose model has another row-parallel tree width: refused whole, nothing loaded
    other_arch = pack_update(stream[:2], arch=dataclasses.replace(arch, row_parallel_segments=arch.row_parallel_segments // 2))
    shm_files = [u["path"] for u in (nemo_rl_like, verl_like, unknown, wrong_shape, other_arch)]
    assert len(nemo_rl_like["buckets"]) > 1 and len(verl_like["buckets"]) == len(stream) - half
    prompts = [[5 + i, 17, 9 + 3 * i, 40, 22 + i, 7, 11][: 3 + i] for i in range(5)]
    rollout = dict(model_dir=str(tmp_path / "old"), prompts=prompts, consistent=True, dtype=arch.dtype, temperature=1.0,
                   max_tokens=8, max_num_batched_tokens=32, max_model_len=128,
                   engine_kwargs={"worker_extension_cls": "megatron_consistent.integration.RefitWorkerExtension"})
    req = tmp_path / "req.json"
    req.write_text(json.dumps({"rollout": rollout, "manifests": [nemo_rl_like, verl_like], "bad_manifests": [unknown, wrong_shape, other_arch]}))
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_CONSISTENT_VLLM"}
    env.update(MEGATRON_CONSISTENT_VLLM="1", HF_HUB_OFFLINE="1")  # the variable alone: config.json keeps LlamaForCausalLM
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "engine", str(req), str(tmp_path / "res.json")],
                              env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    finally:
        for f in shm_files:
            os.unlink(f)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert json.loads((tmp_path / "old" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert "megatron-consistent plugin active" in log and "LlamaForCausalLM runs on the consistent kernels" in log
    res = json.loads((tmp_path / "res.json").read_text())

    for upd in res["updates"]:
        assert "error" not in upd and upd["storage_unchanged"], upd
    assert [u["loaded"] for u in res["updates"]] == [half, len(stream) - half]
    assert res["pointers_after"] == res["pointers_before"]
    batch, alone = res["seeded"]  # request_seeds: a request's tokens depend on its own logits and seed, not on its batch
    assert (alone["tokens"][0], alone["logprobs"][0]) == (batch["tokens"][3], batch["logprobs"][3])
    assert "unexpected checkpoint tensor 'model.layers.99.mlp.up_proj.weight'" in res["bad"][0]["error"]
    assert f"{name0}: checkpoint shape" in res["bad"][1]["error"]
    assert "another architecture" in res["bad"][2]["error"] and res["bad"][2]["loaded"] == 0, res["bad"][2]
    assert "row_parallel_segments" in res["bad"][2]["error"]

    def lps(r):
        return torch.tensor([x for row in r["logprobs"] for x in row], dtype=torch.float32)

    before, after = res["before"], res["after"]
    train_before = recompute(old, prompts, before["tokens"], 1.0, 8, stock=False)
    train_after = recompute(new, prompts, after["tokens"], 1.0, 8, stock=False)
    assert torch.equal(train_before, lps(before))
    assert torch.equal(train_after, lps(after))  # zero mismatch after the in-place update
    m, n = mismatch_metrics(train_after, lps(after)), nemo_rl_metrics(train_after, lps(after))
    assert m["max_abs"] == 0.0 and m["exact_fraction"] == 1.0
    assert n["token_mult_prob_error"] == 1.0 and n["gen_kl_error"] == 0.0 and n["policy_kl_error"] == 0.0
    # and the engine really serves the new weights: the old model does not reproduce the new rollout
    assert not torch.equal(recompute(old, prompts, after["tokens"], 1.0, 8, stock=False), lps(after))


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "engine":
    sys.exit(_engine_main(sys.argv[2], sys.argv[3]))


def test_first_divergence_finds_each_requests_first_differing_token():
    """One flipped low bit per chosen token: the first index per request is reported, equal bits report nothing."""
    from megatron_consistent.verify.metrics import first_divergence

    lengths, prompts = [4, 6, 3, 5], [7, 2, 9, 4]
    train = torch.randn(sum(lengths))
    roll = train.clone()
    flips = {1: 3, 3: 0}  # request -> response index
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    for req, idx in flips.items():
        roll[starts[req] + idx] = torch.nextafter(roll[starts[req] + idx], torch.tensor(float("inf")))
        roll[starts[req] + lengths[req] - 1] += 1.0  # a later difference does not move the first one
    fd = first_divergence(train, roll, lengths, prompts)
    assert fd["requests_differing"] == 2 and fd["first_index_min"] == 0 and fd["first_at_prefill_token"] == 1
    assert [(e["request"], e["first_index"], e["prompt_len"]) for e in fd["examples"]] == [(3, 0, 4), (1, 3, 2)]
    assert first_divergence(train, train.clone(), lengths, prompts) == {"requests_differing": 0}

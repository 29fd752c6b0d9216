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


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_quantized_tensors_cross_the_wire_and_a_mixed_push_is_refused_in_one_line(fmt, packed):
    """Block-FP8 (E4M3 values, float32 ``weight_scale_inv``) and NVFP4 (packed uint8 codes, E4M3 ``weight_scale``, 0-dim
    float32 ``weight_scale_2``) round-trip bitwise; against an engine of the other quantization an update is refused
    with one line naming both (not a wrong dtype / missing scale per tensor)."""
    from megatron_consistent.conversion.fp8 import fp8_hf_state_dict
    from megatron_consistent.kernels.fp8 import E4M3_WEIGHT_128, NVFP4_WEIGHT
    from megatron_consistent.layers import build_consistent_gpt_model
    from megatron_consistent.sync.protocol import raw_digest

    model = build_consistent_gpt_model(ARCH, seed=0)
    quantized = fp8_hf_state_dict(model, ARCH, {"fp8": E4M3_WEIGHT_128, "nvfp4": NVFP4_WEIGHT}[fmt])
    specs = {n: (tuple(t.shape), str(t.dtype).replace("torch.", "")) for n, t in quantized.items()}
    u = packed(quantized, 1)
    assert validate_update(u, specs, 0) == []
    views = tensor_views(u)
    for n, t in quantized.items():
        assert views[n].dtype == t.dtype and raw_digest(views[n]) == raw_digest(t), n  # float8 has no CPU torch.equal
    assert {"float8_e4m3fn", "uint8" if fmt == "nvfp4" else "float32"} <= {e["dtype"] for e in u["tensors"]}
    name = {"fp8": "block-FP8", "nvfp4": "NVFP4"}[fmt]
    for update, engine, sent, held in ((u, hf_tensor_specs(ARCH), name, "unquantized"),
                                       (packed(_tensors(), 1), specs, "unquantized", name)):
        problems = validate_update(update, engine, 0)
        assert problems == [f"quantization mismatch: the update carries {sent} weights, the engine serves {held} weights "
                            "(refused whole; send " + held + " tensors, e.g. push_model of a model with that forward on, "
                            "or quantization=)"], problems


class _StandInEngine:
    """An ``LLM`` stand-in for :class:`WeightSyncChannel`: ``collective_rpc`` calls the real
    :class:`~megatron_consistent.sync.worker.WeightSyncExtension` on one worker whose consistent model holds ``tensors``
    (HF-named, e.g. a block-FP8 engine's) and whose ``config.json`` is ``arch``'s -- the channel and the worker's checks
    and copies without vLLM."""

    def __init__(self, arch, tensors: dict[str, torch.Tensor]):
        from types import SimpleNamespace

        from megatron_consistent.sync.worker import WeightSyncExtension

        self.tensors = tensors
        self.worker = WeightSyncExtension()
        self.worker.model_runner = SimpleNamespace(model=SimpleNamespace(hf_targets=lambda: tensors,
                                                                         named_parameters=lambda: tensors.items()))
        self.worker.vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(to_dict=arch.to_hf)))

    def collective_rpc(self, method, args=()):
        return [getattr(self.worker, method)(*args)]

    def reset_prefix_cache(self):
        return True


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_push_model_quantized_from_a_model_without_the_fp8_forward(fmt):
    """A trainer whose FP8 forward is off (no ``model.fp8_formats``) pushing into a block-FP8 / NVFP4 engine:
    ``push_model(quantization=fmt)`` sends ``fp8_hf_state_dict``'s quantized tensors (not the bf16 masters) and the
    engine takes them, in place, bit for bit; the default (``quantization=None``: the model's forward, bf16) is refused
    whole in one line, the engine's version and weights unchanged."""
    from megatron_consistent.conversion.fp8 import fp8_hf_state_dict
    from megatron_consistent.kernels.fp8 import E4M3_WEIGHT_128, NVFP4_WEIGHT
    from megatron_consistent.layers import build_consistent_gpt_model
    from megatron_consistent.sync import WeightSyncChannel
    from megatron_consistent.sync.protocol import raw_digest

    w_fmt = {"fp8": E4M3_WEIGHT_128, "nvfp4": NVFP4_WEIGHT}[fmt]
    model = build_consistent_gpt_model(ARCH, seed=0)
    assert getattr(model, "fp8_formats", None) is None  # the FP8 forward is off
    engine = _StandInEngine(ARCH, fp8_hf_state_dict(build_consistent_gpt_model(ARCH, seed=1), ARCH, w_fmt))
    channel = WeightSyncChannel(engine, watch_parent=False)
    want = fp8_hf_state_dict(model, ARCH, w_fmt)
    assert not channel.engine_matches(want)["equal"]
    pointers = channel.engine_pointers()

    report = channel.push_model(model, quantization=w_fmt)
    assert report.version == channel.engine_version() == 1 and report.tensors == len(want) and report.pointers_unchanged
    assert channel.engine_pointers() == pointers
    assert {n: raw_digest(t) for n, t in engine.tensors.items()} == {n: raw_digest(t) for n, t in want.items()}
    assert "float8_e4m3fn" in {str(t.dtype).replace("torch.", "") for t in engine.tensors.values()}

    held = {n: raw_digest(t) for n, t in engine.tensors.items()}
    name = {"fp8": "block-FP8", "nvfp4": "NVFP4"}[fmt]
    with pytest.raises(WeightSyncError) as refused:
        channel.push_model(model)  # quantization=None: what the model's forward runs -- bf16
    assert str(refused.value).splitlines() == [
        "engine refused weight update v2 (nothing applied; engine stays at v1):",
        f"  quantization mismatch: the update carries unquantized weights, the engine serves {name} weights (refused "
        f"whole; send {name} tensors, e.g. push_model of a model with that forward on, or quantization=)"]
    assert channel.engine_version() == 1 and {n: raw_digest(t) for n, t in engine.tensors.items()} == held


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


@pytest.mark.engine
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_live_quantized_engine_inplace_push(fmt, tmp_path):
    """A live block-FP8 / NVFP4 tiny-llama engine (tests/_fp8_sync_trainer.py): after an in-place perturbation of the
    trainer's weights, ``push_model`` sends the quantized tensors its forward runs and the engine's log-probs are
    ``torch.equal`` to the trainer's on the new weights, storage unchanged; a bf16 push is refused whole in one line
    (old weights still served); new values with the old scales are served but differ from the trainer."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = str(Path(__file__).parent / "_fp8_sync_trainer.py")
    run = subprocess.run([sys.executable, script, str(tmp_path), fmt, "tiny-llama"], env=dict(os.environ, HF_HUB_OFFLINE="1"),
                         capture_output=True, text=True, timeout=600)
    line = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, run.stdout[-2000:] + run.stderr[-4000:]
    r = json.loads(line[0][7:])
    name = {"fp8": "block-FP8", "nvfp4": "NVFP4"}[fmt]
    assert "float8_e4m3fn" in r["dtypes"] and ("uint8" in r["dtypes"]) == (fmt == "nvfp4"), r["dtypes"]
    assert r["start_equal_new"] and r["start_equal_old"] and r["start_engine_holds"] and r["start_version"] == 0, r
    assert not r["stale_equal_new"] and r["stale_equal_old"], r  # the perturbation changes the trainer's log-probs
    assert r["push_bf16"].splitlines()[1:] == [f"  quantization mismatch: the update carries unquantized weights, the engine "
                                               f"serves {name} weights (refused whole; send {name} tensors, e.g. push_model "
                                               "of a model with that forward on, or quantization=)"], r["push_bf16"]
    assert r["after_bf16_version"] == 0 and r["after_bf16_engine_holds"] and r["after_bf16_equal_old"], r  # nothing applied
    assert r["push_old_scales"] == "ok" and r["old_scales_version"] == 1, r  # a well-formed but wrong push ...
    assert not r["old_scales_equal_new"] and not r["old_scales_engine_holds"], r  # ... is caught by the comparison
    rep = r["report"]
    assert rep["version"] == rep["engine_version"] == 2 == r["pushed_version"], rep
    assert rep["pointers_unchanged"] and rep["engine_pointers_unchanged"] and rep["trainer_pointers_unchanged"], rep
    assert r["pushed_equal_new"] and not r["pushed_equal_old"] and r["pushed_engine_holds"], r

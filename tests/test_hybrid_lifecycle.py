"""RL lifecycle on a HYBRID engine (issue #8): in-place weight refit into a live Nemotron-H-MoE vLLM engine.

Two engine launches, one at a time: ``tiny-nemotronh-moe`` (layers ``M E * M - E``:
all four hybrid layer kinds — Mamba-2 mixer, routed+shared MoE, attention,
relu^2 MLP — so the push covers every hybrid tensor family: ``in_proj``,
``conv1d``, ``dt_bias``, ``A_log``, ``D``, the gated norm, q/k/v, experts, the
float32 ``e_score_correction_bias``) and ``tiny-mamba2`` (attention-free,
``IsAttentionFree`` engine path, tied embeddings).  Each engine runs in a child process
(:class:`megatron_consistent.rl.session.RLSession`, multiprocess engine core,
chunked prefill forced with ``max_num_batched_tokens=16``):

1. rollout == Megatron recompute (``torch.equal``), engine weights hash equal;
2. one GRPO step (optimizer step on the Megatron model) + push in place:
   every parameter keeps its ``data_ptr`` on both sides, versions agree, the
   Mamba / MoE / attention tensors really changed in the engine;
3. the next rollout == the UPDATED trainer bitwise, and the trainer's new
   log-probs of the first rollout differ from the engine's old ones (the
   comparison can fail: a skipped push would be caught);
4. bad pushes carrying perturbed weights (``A_log`` one head short,
   ``conv1d.weight`` squeezed to ``[C, K]``) are refused whole: error names the
   tensor, version and pointers unchanged, engine weights still hash equal to
   the trainer, the next rollout still bitwise equal.

Unit level (no engine): :func:`hf_tensor_specs` of the hybrid configs equals
the Megatron export's names/shapes/dtypes, and a wrong-shape Mamba tensor is
refused by :func:`validate_update` before anything is read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_consistent.config import ArchConfig, builtin_model_dir, load_hf_config
from megatron_consistent.sync.protocol import hf_tensor_specs, pack_update, validate_update

REPO = Path(__file__).resolve().parents[1]


def _arch(name: str) -> ArchConfig:
    return ArchConfig.from_hf(load_hf_config(builtin_model_dir(name)))


@pytest.mark.parametrize("name", ["tiny-nemotronh-moe", "tiny-mamba2"])
def test_hybrid_specs_match_megatron_export(name):
    from megatron_consistent.conversion import hf_state_dict
    from megatron_consistent.layers import build_consistent_gpt_model

    arch = _arch(name)
    sd, specs = hf_state_dict(build_consistent_gpt_model(arch, seed=0), arch), hf_tensor_specs(arch)
    assert sd.keys() == specs.keys()
    for n, t in sd.items():
        assert (tuple(t.shape), str(t.dtype).replace("torch.", "")) == specs[n], n
    assert any(n.endswith("mixer.A_log") for n in specs) and any(n.endswith("mixer.conv1d.weight") for n in specs)


@pytest.mark.parametrize("bad", ["A_log", "conv1d.weight"])
def test_wrong_shape_mamba_tensor_refused(bad):
    arch = _arch("tiny-mamba2")
    specs = hf_tensor_specs(arch)
    tensors = {n: torch.zeros(s, dtype=getattr(torch, dt)) for n, (s, dt) in specs.items()}
    name = f"backbone.layers.1.mixer.{bad}"
    tensors[name] = tensors[name][:-1] if bad == "A_log" else tensors[name][:, 0]
    u = pack_update(tensors, 1)
    try:
        problems = validate_update(u, specs, current_version=0)
    finally:
        os.unlink(u["path"])
    assert len(problems) == 1 and f"wrong shape for {name}" in problems[0], problems


# ---------------------------------------------------------------------------------------------- live engine (child)
CHILD = r'''
import json, sys
import torch

def main(req_path, res_path):
    from megatron_consistent.config import ArchConfig, builtin_model_dir, load_hf_config
    from megatron_consistent.conversion import hf_state_dict
    from megatron_consistent.sync.protocol import WeightSyncError, hf_tensor_specs
    from megatron_consistent.rl.session import RLSession

    req = json.loads(open(req_path).read())
    arch = ArchConfig.from_hf(load_hf_config(builtin_model_dir(req["model"])))
    s = RLSession(arch, "consistent", req["work"], seed=0, lr=1e-2,
                  engine_kwargs={"enable_prefix_caching": False, "max_num_batched_tokens": 16, "max_num_seqs": 8})
    out = {"engine_start_seconds": s.engine_start_seconds}
    try:
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(3, arch.vocab_size, (n,), generator=g).tolist() for n in req["lengths"]]
        strip = lambda r: {k: v for k, v in r.items() if k not in ("tokens_sampled", "rollout_logprobs")}
        digests0 = s.llm.collective_rpc("mc_sync_digests")[0]
        out["engine_names_equal_specs"] = sorted(digests0) == sorted(hf_tensor_specs(arch))
        r0 = s.check_rollout(prompts, req["max_tokens"])
        out["before"] = strip(r0)
        out["weights_before"] = s.weights_match_engine()
        step = s.grpo_step(prompts[:2], 2, req["max_tokens"], lambda p, r: float(sum(r) % 7))
        out["step"] = step
        digests1 = s.llm.collective_rpc("mc_sync_digests")[0]
        out["changed"] = sorted(n for n in digests0 if digests0[n] != digests1[n])
        old = torch.tensor([x for lp in r0["rollout_logprobs"] for x in lp], dtype=torch.float32)
        new = s.trainer_logprobs(prompts, r0["tokens_sampled"]).reshape(-1)
        out["trainer_moved_on_old_tokens"] = not torch.equal(old, new)
        out["after"] = strip(s.check_rollout(prompts, req["max_tokens"]))
        out["weights_after"] = s.weights_match_engine()
        tensors = hf_state_dict(s.model, arch)
        out["rejections"] = []
        for bad in req["bad"]:
            t = {n: (v.float() + 0.25).to(v.dtype) for n, v in tensors.items()}  # every weight differs from the engine's
            t[bad] = t[bad][:-1] if bad.endswith("A_log") else t[bad][:, 0]
            ptrs, version = s.channel.engine_pointers(), s.channel.engine_version()
            try:
                s.channel.push_tensors(t)
                err = None
            except WeightSyncError as e:
                err = str(e)
            out["rejections"].append({"tensor": bad, "error": err, "version_unchanged": s.channel.engine_version() == version,
                                      "pointers_unchanged": s.channel.engine_pointers() == ptrs,
                                      "weights": s.weights_match_engine()})
        out["after_rejections"] = strip(s.check_rollout(prompts, req["max_tokens"]))
        out["engine_version"] = s.channel.engine_version()
    finally:
        s.close()
    open(res_path, "w").write(json.dumps(out))

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
'''


def _live(tmp_path, model: str, bad: list[str], lengths=(37, 5, 20, 1), max_tokens: int = 4) -> dict:
    script, req, res, log = (tmp_path / n for n in ("child.py", "request.json", "result.json", "log.txt"))
    script.write_text(CHILD)
    req.write_text(json.dumps({"model": model, "work": str(tmp_path / "work"), "lengths": list(lengths),
                               "max_tokens": max_tokens, "bad": bad}))
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, str(script), str(req), str(res)], env=env, cwd=REPO, stdout=f,
                            stderr=subprocess.STDOUT, timeout=600).returncode
    text = log.read_text(errors="replace")
    assert rc == 0 and res.is_file(), text[-4000:]
    assert "Mamba state replayed from chunk boundaries" in text  # the plugin's hybrid class served
    return json.loads(res.read_text())


def _bitwise(r: dict, what: str) -> None:
    assert r["bitwise_equal"] and r["exact_fraction"] == 1.0 and r["max_abs"] == 0.0 and r["zero_mismatch"], (what, r)


MAMBA = ("mixer.A_log", "mixer.conv1d.weight", "mixer.conv1d.bias", "mixer.in_proj.weight", "mixer.dt_bias", "mixer.D",
         "mixer.norm.weight", "mixer.out_proj.weight")
LIVE = {  # model: (refused tensors, tensor families the optimizer step must have changed in the engine)
    "tiny-nemotronh-moe": (["backbone.layers.3.mixer.A_log", "backbone.layers.0.mixer.conv1d.weight"],
                           MAMBA + ("mixer.q_proj.weight", "mixer.o_proj.weight", "mixer.experts.0.up_proj.weight",
                                    "mixer.shared_experts.down_proj.weight", "mixer.gate.weight", "mixer.up_proj.weight")),
    "tiny-mamba2": (["backbone.layers.2.mixer.conv1d.weight", "backbone.layers.1.mixer.A_log"], MAMBA),  # attention-free
}


@pytest.mark.engine
@pytest.mark.parametrize("model", list(LIVE))
def test_live_hybrid_engine_refit_in_place(tmp_path, model):
    bad, families = LIVE[model]
    r = _live(tmp_path, model, bad)
    assert r["engine_names_equal_specs"]
    _bitwise(r["before"], "before the update")
    assert r["weights_before"]["equal"], r["weights_before"]
    step = r["step"]
    assert step["bitwise_equal"] and step["max_abs"] == 0.0, step  # rollout of the step, same version as the trainer
    assert step["optimizer_stepped"] and step["engine_version"] == step["sync_version"] == 1, step
    assert step["pointers_unchanged"] and step["trainer_pointers_unchanged"], step
    changed = set(r["changed"])
    for family in families:
        assert any(n.endswith(family) for n in changed), (family, sorted(changed))
    assert r["trainer_moved_on_old_tokens"]  # the old rollout no longer matches: a skipped push would fail below
    _bitwise(r["after"], "after the push")
    assert r["after"]["version"] == 1 and r["weights_after"]["equal"], r["weights_after"]
    assert [e["tensor"] for e in r["rejections"]] == bad
    for e in r["rejections"]:
        assert e["error"] and f"wrong shape for {e['tensor']}" in e["error"] and "nothing applied" in e["error"], e
        assert e["version_unchanged"] and e["pointers_unchanged"] and e["weights"]["equal"], e
    _bitwise(r["after_rejections"], "after the refused pushes")
    assert r["engine_version"] == 1

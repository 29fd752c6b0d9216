"""Hybrid Mamba-2 (issue #8) in vLLM: the plugin's mixer state and a real engine vs the Megatron recompute.

Two levels:

* the plugin's :class:`ConsistentMambaMixer` driven directly with vLLM-shaped
  metadata (decodes first, then prefill pieces; state slots; ``seq_lens``):
  hypothesis draws sequences, schedules (chunked-prefill pieces of any size,
  decode steps, requests joining/sitting out) and slot assignments; every output
  row must be bitwise the whole-sequence forward.  A variant that drops the
  pending tokens (replays from the boundary state without them) must be caught.
* one real engine with the plugin on ``tiny-nemotronh`` (M * - layers), chunked
  prefill forced (``max_num_batched_tokens=16``, prompts up to 70 tokens = 5
  chunks of 16): a request in a mixed batch, the same request alone, and the
  response re-fed as a prompt (whole-prompt prefill log-probs of the tokens that
  were decoded one by one) — all ``torch.equal`` to the Megatron recompute; and
  a second engine start with prefix caching, refused by name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_consistent.config import ArchConfig, builtin_model_dir, load_hf_config

from _mamba_meta import mamba_meta

pytest.importorskip("vllm", reason="the plugin's Mamba mixer is a vLLM layer: vLLM is not installed")

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- mixer state logic
def _arch(chunk: int = 4) -> ArchConfig:
    hf = load_hf_config(builtin_model_dir("tiny-mamba2"))
    hf.update(chunk_size=chunk, hidden_size=32, num_heads=4, head_dim=16, state_size=8)
    return ArchConfig.from_hf(hf)


def _mixer(arch: ArchConfig, slots: int, seed: int = 0, device: str = "cpu"):
    from megatron_consistent.vllm_plugin.mamba import ConsistentMambaMixer

    cfg = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={}))
    m = ConsistentMambaMixer(arch, cfg, "backbone.layers.0.mixer")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            v = torch.randn(p.shape, generator=g) * (0.5 if p.dim() > 1 else 1.0)
            if name == "dt_bias":
                v = v - 2.0
            p.copy_(v.to(torch.bfloat16).to(p.dtype))  # bf16-representable, like an exported checkpoint
    m.to(device)
    m.kv_cache = tuple(torch.full((slots, *shape), float("nan"), dtype=dt, device=device)  # unwritten slots hold garbage
                       for shape, dt in zip(m.get_state_shape(), m.get_state_dtype()))
    return m


def _forward(monkeypatch, mixer, meta, x):
    import vllm.forward_context as fc

    monkeypatch.setattr(fc, "get_forward_context", lambda: SimpleNamespace(
        attn_metadata=None if meta is None else {mixer.prefix: meta}, no_compile_layers={mixer.prefix: mixer}))
    return mixer(x)


@st.composite
def _schedules(draw):
    n = draw(st.integers(1, 3))
    lengths = [draw(st.integers(1, 19)) for _ in range(n)]
    steps, done = [], [0] * n
    while any(d < L for d, L in zip(done, lengths)):
        step = []
        for i in range(n):
            left = lengths[i] - done[i]
            if left and not draw(st.booleans()):  # True: sits this step out
                k = draw(st.integers(1, min(left, 9)))
                step.append((i, done[i], k))
                done[i] += k
        if step:
            steps.append(draw(st.permutations(step)))
    return lengths, steps, draw(st.permutations(list(range(n + 2))))[:n]


def _run_schedule(monkeypatch, mixer, hidden, steps, slots):
    out = [torch.full_like(h, float("nan")) for h in hidden]
    for step in steps:
        batch = [(slots[i], c, k) for i, c, k in step]
        ordered, meta = mamba_meta(batch, hidden[0].device)
        who = {(slots[i], c): i for i, c, _ in step}
        x = torch.cat([hidden[who[(s, c)]][c:c + k] for s, c, k in ordered])
        y = _forward(monkeypatch, mixer, meta, x)
        r = 0
        for s, c, k in ordered:
            out[who[(s, c)]][c:c + k] = y[r:r + k]
            r += k
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the mixer on the GPU kernels needs a CUDA device"))])
@settings(max_examples=15, suppress_health_check=[HealthCheck.large_base_example], deadline=None)
@given(sched=_schedules(), seed=st.integers(0, 2**16))
def test_mixer_any_schedule_equals_whole_sequence(device, sched, seed):
    """Chunked prefill pieces, decode steps and batch mates never change a row: bitwise the one-pass forward."""
    with pytest.MonkeyPatch.context() as mp:
        _check_schedule(mp, sched, seed, device)


def _check_schedule(monkeypatch, sched, seed, device="cpu"):
    lengths, steps, slots = sched
    arch = _arch()
    mixer = _mixer(arch, slots=len(lengths) + 2, seed=seed, device=device)
    g = torch.Generator().manual_seed(seed + 1)
    hidden = [torch.randn(L, arch.hidden_size, generator=g).to(torch.bfloat16).to(device) for L in lengths]
    whole = [_forward(monkeypatch, mixer, None, h) for h in hidden]
    got = _run_schedule(monkeypatch, mixer, hidden, steps, slots)
    for w, o in zip(whole, got):
        assert torch.equal(w, o)


def test_decode_batch_with_closing_open_and_first_tokens(monkeypatch):
    """One decode batch where a token completes its chunk (a new boundary state), another leaves it open and a third
    is a request's first token; the next steps read the states they left: bitwise the one-pass forward."""
    arch = _arch(chunk=4)
    mixer = _mixer(arch, slots=4, seed=5)
    g = torch.Generator().manual_seed(6)
    hidden = [torch.randn(n, arch.hidden_size, generator=g).to(torch.bfloat16) for n in (6, 5, 2)]
    whole = [_forward(monkeypatch, mixer, None, h) for h in hidden]
    steps = [[(0, 0, 3), (1, 0, 2)],
             [(0, 3, 1), (1, 2, 1), (2, 0, 1)],  # closes its chunk, leaves it open, a first token
             [(0, 4, 1), (1, 3, 1), (2, 1, 1)],  # after the closure; the second closes now
             [(0, 5, 1), (1, 4, 1)]]
    got = _run_schedule(monkeypatch, mixer, hidden, steps, [3, 0, 2])
    for w, o in zip(whole, got):
        assert torch.equal(w, o)


@settings(max_examples=15, suppress_health_check=[HealthCheck.large_base_example], deadline=None)
@given(sched=_schedules(), seed=st.integers(0, 2**16))
def test_decode_graphs_switch_any_schedule_equals_whole_sequence(sched, seed):
    """``MC_HYBRID_DECODE_GRAPHS=1`` (decode-only steps as a full CUDA graph runs them): every step with one-token
    requests runs them on the device alone (one :meth:`_step` call a step), still bitwise the one-pass forward, mixed
    with prefill pieces."""
    from megatron_consistent.vllm_plugin import mamba as mod

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mod, "DECODE_GRAPHS", True)
        calls = []
        real = mod.ConsistentMambaMixer._step
        mp.setattr(mod.ConsistentMambaMixer, "_step", lambda *a: calls.append(1) or real(*a))
        _check_schedule(mp, sched, seed)
        with_decodes = [st_ for st_ in sched[1] if any(k == 1 and c > 0 for _, c, k in st_)]
        assert len(calls) == len(with_decodes)


def test_device_only_decode_step_with_a_captured_batch_padding(monkeypatch):
    """A captured decode graph's batch is padded: extra rows with the null block (slot 0) and length 0.  The real
    requests keep their bits, now and at their next steps (the padding reads and writes slot 0 only)."""
    from megatron_consistent.vllm_plugin import mamba as mod

    monkeypatch.setattr(mod, "DECODE_GRAPHS", True)
    arch = _arch(chunk=4)
    mixer = _mixer(arch, slots=4, seed=8)
    g = torch.Generator().manual_seed(9)
    hidden = [torch.randn(n, arch.hidden_size, generator=g).to(torch.bfloat16) for n in (7, 6)]
    whole = [_forward(monkeypatch, mixer, None, h) for h in hidden]
    got = _run_schedule(monkeypatch, mixer, hidden, [[(0, 0, 3), (1, 0, 5)]], [2, 3])
    for c0, c1 in ((3, 5), (4, None), (5, None), (6, None)):
        batch = [(2, c0, 1)] + ([(3, c1, 1)] if c1 is not None else [])
        _, meta = mamba_meta(batch)
        pads = 3
        meta.state_indices_tensor_d = torch.cat([meta.state_indices_tensor_d, torch.zeros(pads, 1, dtype=torch.int32)])
        meta.seq_lens = torch.cat([meta.seq_lens, torch.zeros(pads, dtype=torch.int32)])
        x = torch.cat([hidden[0][c0:c0 + 1]] + ([hidden[1][c1:c1 + 1]] if c1 is not None else [])
                      + [torch.randn(pads, arch.hidden_size, generator=g).to(torch.bfloat16)])
        y = _forward(monkeypatch, mixer, meta, x)
        got[0][c0] = y[0]
        if c1 is not None:
            got[1][c1] = y[1]
    for w, o in zip(whole, got):
        assert torch.equal(w, o)


def test_mixer_without_pending_tokens_is_caught(monkeypatch):
    """A replay that forgets the tokens since the last boundary (a plausible bug) must differ: in a prefill piece and
    in a decode step."""
    from megatron_consistent.vllm_plugin import mamba as mod

    arch = _arch(chunk=4)
    mixer = _mixer(arch, slots=2, seed=3)
    h = torch.randn(10, arch.hidden_size, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    whole = _forward(monkeypatch, mixer, None, h)
    steps = [[(0, 0, 6)], [(0, 6, 1)], [(0, 7, 3)]]  # pieces start mid-chunk (6 % 4, 7 % 4)
    assert torch.equal(_run_schedule(monkeypatch, mixer, [h], steps, [1])[0], whole)
    real = mod.ssd_continue
    monkeypatch.setattr(mod, "ssd_continue", lambda b, p, *a: real(b, None, *a))
    broken = _run_schedule(monkeypatch, mixer, [h], steps, [1])[0]
    assert torch.equal(broken[:6], whole[:6]) and not torch.equal(broken[6:], whole[6:])
    monkeypatch.setattr(mod, "ssd_continue", real)
    from megatron_consistent.kernels import ssd as ssd_mod  # the decode step's outputs (ssd_step_outputs' CPU reference)

    real_at = ssd_mod.ssd_outputs_at  # a decode step that forgets them: only the new token, from the boundary state

    def new_token_only(x, dt, A, B, C, D, chunk, state, pos):
        return real_at(x[:, -1:], dt[:, -1:], A, B[:, -1:], C[:, -1:], D, chunk, state, torch.zeros_like(pos))

    monkeypatch.setattr(ssd_mod, "ssd_outputs_at", new_token_only)
    broken = _run_schedule(monkeypatch, mixer, [h], steps, [1])[0]
    assert torch.equal(broken[:6], whole[:6]) and not torch.equal(broken[6], whole[6])


# ---------------------------------------------------------------------------------------------- compile + CUDA graphs (host side)
@pytest.mark.parametrize("plugin_backend", [True, False])
def test_decode_graphs_off_resolves_default_graphs_to_piecewise_with_the_mixer_split_off(plugin_backend, monkeypatch):
    """``MC_HYBRID_DECODE_GRAPHS=0``: vLLM's default FULL_AND_PIECEWISE, resolved against the plugin's Mamba-2
    backend, becomes PIECEWISE with the mixer op among the splitting ops (vLLM's own Mamba-2 backend, the control,
    keeps full decode graphs)."""
    from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode
    from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionMetadataBuilder

    from megatron_consistent.vllm_plugin import mamba
    from megatron_consistent.vllm_plugin.mamba import MIXER_OP, ConsistentMamba2Backend, run_mixer_between_graphs

    monkeypatch.setattr(mamba, "DECODE_GRAPHS", False)
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    cc.set_splitting_ops_for_v1("allgather_reducescatter")
    run_mixer_between_graphs(cc)
    run_mixer_between_graphs(cc)
    assert cc.splitting_ops.count(MIXER_OP) == 1 and cc.splitting_ops_contain_attention()
    builder = ConsistentMamba2Backend.get_builder_cls() if plugin_backend else Mamba2AttentionMetadataBuilder
    mode = cc.resolve_cudagraph_mode_and_sizes(builder.get_cudagraph_support(None, None), "mamba")
    assert mode == (CUDAGraphMode.PIECEWISE if plugin_backend else CUDAGraphMode.FULL_AND_PIECEWISE)
    unsplit = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, splitting_ops=[])
    run_mixer_between_graphs(unsplit)
    assert unsplit.splitting_ops == []  # one unsplit graph asked for: left alone (vLLM refuses full graphs itself)


def test_decode_graphs_by_default_keep_full_decode_graphs(monkeypatch):
    """By default (``MC_HYBRID_DECODE_GRAPHS`` unset or ``1``) the plugin's backend declares vLLM's own Mamba-2
    support, so the default FULL_AND_PIECEWISE stays (decode-only steps in full graphs, the mixer split off for the
    rest); ``0`` turns it off, other values are refused by name."""
    from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode

    from megatron_consistent.vllm_plugin import mamba as mod

    monkeypatch.delenv("MC_SSD_SCAN", raising=False)
    for value, on in (("", True), ("1", True), ("0", False)):
        monkeypatch.setenv("MC_HYBRID_DECODE_GRAPHS", value)
        assert mod.decode_graphs() is on
    monkeypatch.setattr(mod, "DECODE_GRAPHS", True)
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    cc.set_splitting_ops_for_v1("allgather_reducescatter")
    mod.run_mixer_between_graphs(cc)
    support = mod.ConsistentMamba2Backend.get_builder_cls().get_cudagraph_support(None, None)
    assert cc.resolve_cudagraph_mode_and_sizes(support, "mamba") == CUDAGraphMode.FULL_AND_PIECEWISE
    monkeypatch.setenv("MC_HYBRID_DECODE_GRAPHS", "on")
    with pytest.raises(ValueError, match="MC_HYBRID_DECODE_GRAPHS='on': expected 0 or 1"):
        mod.decode_graphs()


def test_decode_graphs_off_by_default_with_the_torch_ssd_reference(monkeypatch):
    """``MC_SSD_SCAN=torch`` (the torch reference: its decode step reads the host) turns full decode graphs off by
    default, and asking for both is refused by name before any work."""
    from megatron_consistent.vllm_plugin import mamba as mod

    monkeypatch.setenv("MC_SSD_SCAN", "torch")
    monkeypatch.delenv("MC_HYBRID_DECODE_GRAPHS", raising=False)
    assert mod.decode_graphs() is False
    monkeypatch.setenv("MC_HYBRID_DECODE_GRAPHS", "1")
    with pytest.raises(ValueError, match="MC_HYBRID_DECODE_GRAPHS=1 with MC_SSD_SCAN=torch"):
        mod.decode_graphs()
    monkeypatch.setenv("MC_SSD_SCAN", "triton")
    assert mod.decode_graphs() is True


def test_mixer_is_one_splitting_node_of_the_compiled_layer(monkeypatch):
    """Dynamo traces the whole mixer layer without a break; vLLM's splitter finds exactly one node to run eagerly
    (the mixer core), and the compiled layer gives the eager bits."""
    from vllm.compilation.partition_rules import should_split

    from megatron_consistent.vllm_plugin.mamba import MIXER_OP

    arch = _arch()
    mixer = _mixer(arch, slots=3, seed=2)
    h = torch.randn(11, arch.hidden_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    eager = _forward(monkeypatch, mixer, None, h)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(mixer, fullgraph=True, backend=backend)
    assert torch.equal(_forward(monkeypatch, compiled, None, h), eager)
    split = [n for n in graphs[0].graph.nodes if should_split(n, [MIXER_OP])]
    assert len(graphs) == 1 and len(split) == 1


def test_mixer_rows_of_no_request_are_zero(monkeypatch):
    """A piecewise graph pads the batch: rows past the scheduled tokens must come out as zeros, whatever the
    buffer held (the next graph reads them)."""
    arch = _arch()
    mixer = _mixer(arch, slots=3, seed=4)
    g = torch.Generator().manual_seed(5)
    s = arch.ssm
    xbc = torch.randn(8, s.conv_dim, generator=g).to(torch.bfloat16)
    dt = torch.rand(8, s.num_heads, generator=g)
    _, meta = mamba_meta([(1, 0, 3), (2, 0, 2)])  # 5 scheduled tokens of 8 rows
    y = torch.full((8, s.d_inner), float("nan"), dtype=torch.bfloat16)
    mixer.mix(xbc, dt, y, meta)
    assert not torch.isnan(y[:5]).any() and torch.equal(y[5:], torch.zeros_like(y[5:]))


# ---------------------------------------------------------------------------------------------- real engine
ENGINE_SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
req = json.loads(open(sys.argv[1]).read())
llm = LLM(model=req["model"], skip_tokenizer_init=True, dtype="bfloat16", seed=0, gpu_memory_utilization=0.3,
          max_num_batched_tokens=16, max_num_seqs=8, max_model_len=256, block_size=32, enforce_eager=True,
          enable_prefix_caching=req["prefix_caching"], logprobs_mode="raw_logprobs")
def run(prompts, **kw):  # greedy (per-request seeds: "CPU Generator does not use offset"), raw log-probs
    ps = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], logprobs=0, ignore_eos=True, **kw)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], ps, use_tqdm=False)
def decoded(o):
    c = o.outputs[0]
    return {"tokens": list(c.token_ids), "logprobs": [s[t].logprob for s, t in zip(c.logprobs, c.token_ids)]}
P = req["prompts"]
batch = [decoded(o) for o in run(P)]
alone = decoded(run(P[:1])[0])
refed = run([p + b["tokens"] for p, b in zip(P, batch)], prompt_logprobs=0)
prefill = [[d[t].logprob for d, t in zip(o.prompt_logprobs[len(p):], o.prompt_token_ids[len(p):])] for o, p in zip(refed, P)]
open(sys.argv[2], "w").write(json.dumps({"batch": batch, "alone": alone, "prefill": prefill}))
"""


def _engine(tmp_path, name, request):
    req, res, log = tmp_path / f"{name}.json", tmp_path / f"{name}.result.json", tmp_path / f"{name}.log"
    req.write_text(json.dumps(request))
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", MEGATRON_CONSISTENT_VLLM="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, str(req), str(res)], env=env, cwd=REPO, stdout=f,
                            stderr=subprocess.STDOUT).returncode
    return rc, (json.loads(res.read_text()) if rc == 0 and res.exists() else None), log.read_text(errors="replace")


@pytest.fixture(scope="module")
def nemotronh(tmp_path_factory):
    from megatron_consistent.conversion import export_hf
    from megatron_consistent.layers import build_consistent_gpt_model

    arch = ArchConfig.from_hf(load_hf_config(builtin_model_dir("tiny-nemotronh")))
    model = build_consistent_gpt_model(arch, seed=5)
    out = tmp_path_factory.mktemp("nemotronh")
    export_hf(model, arch, out / "model")
    return arch, model, out


@pytest.mark.engine
def test_engine_batch_alone_chunked_prefill_decode_equal_megatron(nemotronh):
    from megatron_consistent.verify.check import recompute

    arch, model, out = nemotronh
    g = torch.Generator().manual_seed(7)
    lengths = [70, 5, 33, 17, 48, 1]  # up to 5 chunks of 16; pieces of 16 tokens cut them mid-chunk
    prompts = [torch.randint(3, arch.vocab_size, (n,), generator=g).tolist() for n in lengths]
    rc, res, log = _engine(out, "main", {"model": str(out / "model"), "prompts": prompts, "max_tokens": 12, "prefix_caching": False})
    assert rc == 0, log[-3000:]
    assert "Mamba state replayed from chunk boundaries" in log  # the plugin's hybrid class ran
    responses = [b["tokens"] for b in res["batch"]]
    want = recompute(model, prompts, responses, 1.0, batch=6, stock=False)
    decode_lp = torch.tensor([x for b in res["batch"] for x in b["logprobs"]], dtype=torch.float32)
    prefill_lp = torch.tensor([x for lps in res["prefill"] for x in lps], dtype=torch.float32)
    assert decode_lp.numel() == 12 * len(prompts)
    assert torch.equal(decode_lp, want)  # mixed batch, chunked prefill + decode == Megatron
    assert torch.equal(prefill_lp, want)  # the same tokens through (chunked) prefill == Megatron
    assert res["alone"]["tokens"] == res["batch"][0]["tokens"]
    assert torch.equal(torch.tensor(res["alone"]["logprobs"]), torch.tensor(res["batch"][0]["logprobs"]))


@pytest.mark.engine
def test_engine_refuses_prefix_caching_by_name(nemotronh):
    _, _, out = nemotronh
    rc, _, log = _engine(out, "prefix", {"model": str(out / "model"), "prompts": [[5, 6, 7]], "max_tokens": 2, "prefix_caching": True})
    assert rc != 0
    assert "UnsupportedConfigError" in log and "enable_prefix_caching" in log and "NemotronHForCausalLM" in log

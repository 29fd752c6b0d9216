"""The plugin's hybrid Mamba-2 / Nemotron-H model driven step by step in one rank of tests/_tp_ranks.py.

Two requests share the steps as vLLM schedules them (one-token requests first, then prefill pieces): chunked-prefill
pieces that leave a chunk open and cross a chunk boundary, then decode steps that close chunks, so every Mamba mixer
reads and writes its state slots (the boundary state, the pending tokens, the conv state) through vLLM-shaped metadata
(:func:`_mamba_meta.mamba_meta`, handed to the mixers by a stand-in forward context).  Each attention layer's vLLM
``Attention`` is replaced by the consistent causal attention kernel over the rank's heads and the keys / values its
requests wrote so far (what vLLM's paged cache holds).  The tokens are fixed (no sampling), so every TP runs the
same steps.  Per step ``j`` the outputs ``step<j>.embed``, ``step<j>.layer<i>``, ``step<j>.logits`` (float32, every
rank's) and ``step<j>.logprobs``.

Faults (TP > 1, to show the comparison can fail):

* ``norm_group``: every Mamba mixer's gated norm over the wrong group slice (its ``d_inner / t`` channels cut into
  the whole mixer's ``n_groups`` groups instead of its own ``n_groups / t``);
* ``conv_state``: after every step each rank's conv state holds the next rank's channels (the state of the wrong
  channels: the first prefill, which reads no state, still matches).
"""

from __future__ import annotations

import torch

from _mamba_meta import mamba_meta
from _tp_ranks import AttentionStub

# request -> its tokens (fixed: no sampling); its steps: its prefill pieces (PREFILL), then one token a step
REQUESTS = {0: [5, 17, 300, 42, 7, 511, 256, 3, 99, 128, 64, 1, 2, 450, 33, 77, 200, 301, 12, 8, 400, 9, 10, 11, 250, 499,
                6, 13, 14, 15, 16, 18, 19, 20, 21, 22, 23, 24],
            1: [44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72]}
SLOTS = {0: 1, 1: 3}  # state slots (slot 0: vLLM's null block)
PREFILL = {0: (21,), 1: (9, 14)}  # prefill pieces (tokens each); request 0 decodes from step 1, request 1 from step 2


def schedule() -> list[list[tuple[int, int, int]]]:
    """Steps of ``(request, computed tokens, new tokens)``: the prefill pieces, then a token a step."""
    pieces = {r: list(p) for r, p in PREFILL.items()}
    done = dict.fromkeys(REQUESTS, 0)
    steps = []
    while any(done[r] < len(t) for r, t in REQUESTS.items()):
        step = []
        for r, tokens in REQUESTS.items():
            if done[r] < len(tokens):
                n = pieces[r].pop(0) if pieces[r] else 1
                step.append((r, done[r], n))
                done[r] += n
        steps.append(step)
    return steps


def _norm_over_wrong_groups(tp: int):
    """``inference_ops.gated_rms_norm`` with each group cut into ``tp`` (the whole mixer's group count on one rank's
    channels)."""
    from megatron_consistent.kernels import inference_ops

    return lambda y, z, w, group_size, eps: inference_ops.gated_rms_norm(y, z, w, group_size // tp, eps)


def _next_ranks_conv_state(mixer):
    """``mixer.mix`` followed by each rank's conv state replaced with the next rank's (the wrong channels)."""
    from megatron_consistent.vllm_plugin.compat import tensor_parallel_all_gather
    from megatron_consistent.vllm_plugin.parallel import tp_rank_size

    mix = mixer.mix
    rank, size = tp_rank_size()

    def wrong(xbc, dt, y, meta):
        mix(xbc, dt, y, meta)
        conv = mixer.kv_cache[2]
        conv.copy_(tensor_parallel_all_gather(conv.unsqueeze(0), 0)[(rank + 1) % size])

    return wrong


def run_steps(model, fault: str, out: dict) -> None:
    """Every step of :func:`schedule` through the model (the mixers' state slots allocated here) into ``out``."""
    import vllm.forward_context as fc
    from types import SimpleNamespace

    from megatron_consistent.kernels import inference_ops, log_softmax
    from megatron_consistent.vllm_plugin import mamba as plugin_mamba

    arch, tp = model.arch, model.tp_size
    rows: list = []
    mixers = {}
    for layer in model.layers:
        m = layer.mixer
        if layer.kind == "attention":
            del m.attn  # the vLLM Attention module -> a plain callable
            m.attn = AttentionStub(arch.head_dim, arch.softmax_scale, rows)
        elif layer.kind == "mamba":
            m.kv_cache = tuple(torch.full((max(SLOTS.values()) + 1, *shape), float("nan"), dtype=dt)  # unwritten: garbage
                               for shape, dt in zip(m.get_state_shape(), m.get_state_dtype()))
            if fault == "conv_state":
                m.mix = _next_ranks_conv_state(m)
            mixers[m.prefix] = m
    real_context, real_ops = fc.get_forward_context, plugin_mamba.inference_ops
    if fault == "norm_group":
        plugin_mamba.inference_ops = SimpleNamespace(**{**vars(real_ops), "gated_rms_norm": _norm_over_wrong_groups(tp)})
    try:
        for j, step in enumerate(schedule()):
            order, meta = mamba_meta([(SLOTS[r], c, n) for r, c, n in step])
            by_slot = {SLOTS[r]: r for r, _, _ in step}
            rows[:] = [(by_slot[s], c, n) for s, c, n in order]
            fc.get_forward_context = lambda: SimpleNamespace(attn_metadata=dict.fromkeys(mixers, meta), no_compile_layers=mixers)
            ids = torch.tensor([t for r, c, n in rows for t in REQUESTS[r][c:c + n]]) % arch.vocab_size
            positions = torch.tensor([p for _, c, n in rows for p in range(c, c + n)])
            with torch.no_grad():
                h = model.embed_input_ids(ids)
                out[f"step{j}.embed"] = h.clone()
                for i, layer in enumerate(model.layers):
                    h = layer(h, positions)
                    out[f"step{j}.layer{i}"] = h.clone()
                logits = model.compute_logits(inference_ops.rms_norm(h, model.norm, arch.rms_norm_eps))
            out[f"step{j}.logits"] = logits.contiguous()
            out[f"step{j}.logprobs"] = log_softmax(logits).contiguous()
    finally:
        fc.get_forward_context, plugin_mamba.inference_ops = real_context, real_ops

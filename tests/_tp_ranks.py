"""The plugin's models at tensor-parallel size t, driven directly under a t-rank gloo group (tests/test_parallel_engine.py).

``python tests/_tp_ranks.py MODEL_DIR OUT_DIR TP [--fault allreduce] [--update UPDATE.json]``, or
``python tests/_tp_ranks.py --jobs JOBS.json TP`` (a JSON list of ``{"model_dir", "out_dir", "fault", "update"}``: every
job in the same ``TP`` ranks, one after the other, each on a model of its own).

Spawns ``TP`` processes (plain subprocesses: argv in, safetensors / JSON out, no pickle).  Each rank
initialises vLLM's distributed state (``init_distributed_environment`` + ``initialize_model_parallel``,
backend gloo) once; per job it builds a fresh :class:`ConsistentForCausalLM` (a hybrid config: the plugin's hybrid
model class) with ``tensor_parallel_size=TP`` (a ``VllmConfig`` of its own), loads the
whole-tensor checkpoint ``MODEL_DIR/model.safetensors`` through ``load_weights`` (each rank keeps its
part), optionally applies a weight update through the sync worker's ``mc_sync_apply`` (the update is a
JSON schema naming a shared-memory file, :mod:`megatron_consistent.sync.protocol`), then runs one
prompt through embedding, every decoder layer and the lm head.  vLLM's paged attention needs an engine's
forward context; each layer's ``attn`` is replaced by the consistent causal attention kernel over this
rank's heads (heads are independent, so this is the same function at every TP).  Rank 0 writes
``OUT_DIR/tp<TP>.safetensors`` (``embed``, ``layer<i>``, ``logits`` float32, ``logprobs``) and every
rank ``OUT_DIR/tp<TP>.rank<r>.json`` (sync replies and, after them, the digests and parts the weight check reads;
its held shapes; the part of every HF tensor it holds).
A hybrid model runs two requests through chunked-prefill and decode steps instead (tests/_tp_hybrid.py: outputs
``step<j>.*``; its faults ``norm_group`` and ``conv_state``).

``--fault allreduce``: o_proj and down computed the naive way — each rank's K shard through the
one-rank linear rounded to bf16, then ``all_reduce`` of the rounded partials (what the contract forbids).
``--fault moe_nosum``: every MoE layer combines its own experts' outputs without the ranks' sum;
``--fault moe_slice``: every MoE layer takes its weights for the next rank's run of experts (the wrong slice);
``--fault fp8_notree``: a block-FP8 model's o_proj and down sum the ranks' K shards each as one FP8 linear rounded
to the model dtype (no subtree of its S/t segments, an extra rounding).
A job's ``reload`` (a model folder): after the first load, that folder's checkpoint is loaded again in place through
``load_weights`` (what a refit does; block-FP8: values and block scales, each rank its part); the report gets
``reload_pointers_same``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

PROMPT = [5, 17, 300, 42, 7, 511, 256, 3, 99, 128, 64, 1, 2, 450, 33, 77, 200, 301, 12, 8, 400, 9, 10, 11, 250, 499,
          6, 13, 14, 15, 16, 18, 19, 20, 21, 22, 23]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model_dir: str, out_dir: str, tp: int, fault: str = "", update: str = "", timeout: float = 600) -> list[str]:
    """Run the ``tp`` ranks on one job; returns each rank's log text (raises ``RuntimeError`` with the logs on failure)."""
    return launch_jobs([{"model_dir": model_dir, "out_dir": out_dir, "fault": fault, "update": update}], tp, out_dir, timeout)


def launch_jobs(jobs: list[dict], tp: int, log_dir: str, timeout: float = 600) -> list[str]:
    """Run every job in one group of ``tp`` ranks (logs ``LOG_DIR/tp<TP>.rank<r>.log``); returns each rank's log text
    (raises ``RuntimeError`` with the logs on failure)."""
    port = _free_port()
    procs = []
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    jobs_file = Path(log_dir) / f"tp{tp}.jobs.json"
    jobs_file.write_text(json.dumps([{"fault": "", "update": "", "reload": "", **j} for j in jobs]))
    for r in range(tp):
        log = open(Path(log_dir) / f"tp{tp}.rank{r}.log", "w")
        cmd = [sys.executable, __file__, "--rank", str(r), str(port), str(jobs_file), str(tp)]
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", MEGATRON_CONSISTENT_VLLM="1",
                   VLLM_DIST_IDENT=f"mc-tp-{port}")  # vLLM's CPU communicator names its shared-memory group by it
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    codes = []
    for p, log in procs:
        try:
            codes.append(p.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
            codes.append(-9)
        log.close()
    logs = [(Path(log_dir) / f"tp{tp}.rank{r}.log").read_text() for r in range(tp)]
    if any(codes):
        raise RuntimeError(f"TP={tp} ranks exited with {codes}:\n" + "\n".join(t[-3000:] for t in logs))
    return logs


class AttentionStub:
    """A layer's vLLM ``Attention`` stand-in: the consistent causal attention kernel, each request's new queries over
    the keys / values it wrote so far, as vLLM's paged cache holds them (``rows``: the step's ``(request, computed
    tokens, new tokens)`` in batch order, kept up to date by the caller)."""

    def __init__(self, head_dim: int, scale: float, rows: list):
        self.head_dim, self.scale, self.rows = head_dim, scale, rows
        self.keys: dict = {}
        self.values: dict = {}

    def __call__(self, q, k, v):
        import torch

        from megatron_consistent.kernels import attention

        hd, out, first = self.head_dim, [], 0
        for r, computed, n in self.rows:
            sl = slice(first, first + n)
            first += n
            self.keys[r] = torch.cat([self.keys.get(r, k[:0]), k[sl]])
            self.values[r] = torch.cat([self.values.get(r, v[:0]), v[sl]])
            kk, vv = self.keys[r], self.values[r]
            pos = torch.arange(computed, computed + n).reshape(1, n)
            o = attention(q[sl].reshape(1, n, -1, hd), kk.reshape(1, kk.shape[0], -1, hd), vv.reshape(1, vv.shape[0], -1, hd),
                          pos, scale=self.scale)
            out.append(o.reshape(n, -1))
        return torch.cat(out)


def _broken_row_parallel(x, w, b=None):
    """Outside the contract: this rank's K shard rounded to bf16, then a plain all_reduce of the rounded partials."""
    from vllm.distributed import tensor_model_parallel_all_reduce

    from megatron_consistent.kernels import inference_ops

    return tensor_model_parallel_all_reduce(inference_ops.linear(x, w, b))


class _Worker:
    """Just enough of a vLLM worker for the sync extension's ``mc_sync_apply``."""

    def __init__(self, model, vllm_config):
        from types import SimpleNamespace

        self.model_runner = SimpleNamespace(model=model)
        self.vllm_config = vllm_config


def rank_main(rank: int, port: int, jobs_file: str, tp: int) -> None:
    import torch
    from vllm.config import (CacheConfig, CompilationConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig,
                             set_current_vllm_config)
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    from megatron_consistent import vllm_plugin
    from megatron_consistent.config import ArchConfig, load_hf_config

    vllm_plugin.register()
    torch.set_num_threads(1)
    jobs = json.loads(Path(jobs_file).read_text())

    def config(model_dir: str) -> VllmConfig:
        dtype = ArchConfig.from_hf(load_hf_config(model_dir)).dtype  # the checkpoint's (the plugin refuses another)
        mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype=dtype, max_model_len=256)
        return VllmConfig(model_config=mc, parallel_config=ParallelConfig(tensor_parallel_size=tp),
                          cache_config=CacheConfig(enable_prefix_caching=False),  # refused for hybrids
                          load_config=LoadConfig(load_format="dummy"), compilation_config=CompilationConfig(mode=0))

    with set_current_vllm_config(config(jobs[0]["model_dir"])):
        init_distributed_environment(world_size=tp, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=rank, backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=tp, backend="gloo")
    for job in jobs:
        _run_job(rank, tp, config(job["model_dir"]), job["model_dir"], job["out_dir"], job["fault"], job["update"],
                 job.get("reload", ""))
    # leave the group together and in order: a rank that exited with its communicators up aborted once in CI after
    # every job had written its outputs ("terminate called without an active exception")
    torch.distributed.barrier()
    destroy_model_parallel()
    destroy_distributed_environment()


def _run_job(rank: int, tp: int, vc, model_dir: str, out_dir: str, fault: str, update: str, reload: str = "") -> None:
    import torch
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config

    from megatron_consistent.sync.worker import WeightSyncExtension

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    with set_current_vllm_config(vc):
        from megatron_consistent.config import ArchConfig
        from megatron_consistent.vllm_plugin.hybrid_model import ConsistentMamba2ForCausalLM, ConsistentNemotronHForCausalLM
        from megatron_consistent.vllm_plugin.model import ConsistentForCausalLM

        arch = ArchConfig.from_hf(vc.model_config.hf_config.to_dict())
        cls = {"NemotronHForCausalLM": ConsistentNemotronHForCausalLM, "Mamba2ForCausalLM": ConsistentMamba2ForCausalLM}
        model = cls.get(arch.architecture, ConsistentForCausalLM)(vllm_config=vc)
    model.load_weights(load_file(str(Path(model_dir) / "model.safetensors")).items())
    report = {"rank": rank, "tp": model.tp_size, "held": {n: list(p.shape) for n, p in model.named_parameters()},
              "parts": model.hf_parts()}
    if reload:
        before = {n: p.data_ptr() for n, p in model.named_parameters()}
        model.load_weights(load_file(str(Path(reload) / "model.safetensors")).items())
        report["reload_pointers_same"] = before == {n: p.data_ptr() for n, p in model.named_parameters()}
    if update:
        worker = type("W", (_Worker, WeightSyncExtension), {})(model, vc)
        for u in json.loads(Path(update).read_text()):
            before = {n: p.data_ptr() for n, p in model.named_parameters()}
            reply = worker.mc_sync_apply(u)
            after = {n: p.data_ptr() for n, p in model.named_parameters()}
            reply["pointers_same"] = before == after
            report.setdefault("sync", []).append(reply)
        report.update(digests=worker.mc_sync_digests(), sync_parts=worker.mc_sync_parts())  # what the weight check reads
    out = {}
    if arch.is_hybrid:
        from _tp_hybrid import run_steps

        run_steps(model, fault, out)
        _write(rank, tp, out_dir, out, report)
        return
    ids = torch.tensor(PROMPT) % arch.vocab_size
    positions = torch.arange(len(PROMPT))
    for layer in model.layers:
        del layer.attn  # the vLLM Attention module -> a plain callable
        layer.attn = AttentionStub(arch.head_dim, arch.softmax_scale, [(0, 0, len(PROMPT))])
        if fault == "allreduce":
            layer.lin = {**layer.lin, "o_proj": _broken_row_parallel, "down": _broken_row_parallel}
        if fault == "moe_slice" and hasattr(layer, "expert_first"):
            layer.expert_first = (rank + 1) % tp * layer.experts_fc1.shape[0]
    from megatron_consistent.vllm_plugin import moe as plugin_moe

    from megatron_consistent.kernels import inference_ops

    summed, fp8_tree = plugin_moe.sum_owned_slots, inference_ops.fp8_linear_segment_tree
    if fault == "moe_nosum":
        plugin_moe.sum_owned_slots = lambda y: y  # this job only (restored below)
    if fault == "fp8_notree":  # the rank's K shard as one rounded FP8 linear (restored below)
        inference_ops.fp8_linear_segment_tree = lambda x, w_q, rows, w_fmt, a_fmt, block_rows, segments: inference_ops.fp8_linear(
            x, w_q, rows, None, w_fmt, a_fmt, block_rows).float()
    try:
        _forward(model, ids, positions, out)
    finally:
        plugin_moe.sum_owned_slots, inference_ops.fp8_linear_segment_tree = summed, fp8_tree
    _write(rank, tp, out_dir, out, report)


def _write(rank: int, tp: int, out_dir: str, out: dict, report: dict) -> None:
    """Rank 0: every output; every other rank: its logits (every rank holds the same full logits); each its report."""
    from safetensors.torch import save_file

    if rank == 0:
        save_file(out, str(Path(out_dir) / f"tp{tp}.safetensors"))
    else:
        save_file({k: v for k, v in out.items() if k.endswith("logits")}, str(Path(out_dir) / f"tp{tp}.rank{rank}.safetensors"))
    Path(out_dir, f"tp{tp}.rank{rank}.json").write_text(json.dumps(report))


def _forward(model, ids, positions, out: dict) -> None:
    """Embedding, every decoder layer, the final norm, float32 logits and log-probs of one prompt into ``out``."""
    import torch

    from megatron_consistent.kernels import inference_ops, log_softmax

    arch = model.arch
    with torch.no_grad():
        h = model.embed_input_ids(ids)
        out["embed"] = h.clone()
        rope = (model.rope_cos[positions], model.rope_sin[positions])
        for i, layer in enumerate(model.layers):
            h = layer(positions, h, rope)
            out[f"layer{i}"] = h.clone()
        hn = inference_ops.rms_norm(h, model.norm, arch.rms_norm_eps)
        logits = model.compute_logits(hn)
        out["logits"] = logits.contiguous()
        out["logprobs"] = log_softmax(logits).contiguous()


if __name__ == "__main__":
    a = sys.argv[1:]
    if a[0] == "--rank":
        rank_main(int(a[1]), int(a[2]), a[3], int(a[4]))
    elif a[0] == "--jobs":
        launch_jobs(json.loads(Path(a[1]).read_text()), int(a[2]), str(Path(a[1]).parent))
    else:
        fault = a[a.index("--fault") + 1] if "--fault" in a else ""
        upd = a[a.index("--update") + 1] if "--update" in a else ""
        launch(a[0], a[1], int(a[2]), fault, upd)

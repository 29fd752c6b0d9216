"""Running the consistent model at a TP x PP x DP (EP, CP) layout — CPU ranks (gloo) or GPU ranks (NCCL) — recomputing
token log-probs there, and exporting the whole model from it.

* :func:`spawn_ranks` — ``TP * CP * PP * DP`` processes (CPU: forked from a job process forked from the caller's warm
  rank launcher, which imported the modules once; CUDA: ``torch.multiprocessing`` spawn), each with
  ``torch.distributed`` (a ``FileStore`` in a work folder: no TCP port) and one thread;
  ``device="cpu"``: gloo; ``device="cuda"``: NCCL, rank r on ``cuda:r`` (NVLink multicast off:
  :data:`NVLINK_MULTICAST_OFF`).  Nothing is pickled but the worker function's name and plain
  strings / ints — tensors travel as safetensors files in the work folder or through
  ``torch.distributed``.
* :func:`build_parallel_model` — in a rank: the consistent model at that layout, loaded from
  an HF safetensors checkpoint (each rank takes its Megatron shard of the full tensors), on
  the rank's device (:func:`rank_device`).
* :func:`stage_forward` / :func:`stage_logprobs` — one pipeline stage: receives the previous
  stage's activations (``dist.recv``), runs, sends its output on (``dist.send``); the
  activations pass unchanged, so PP is bitwise neutral.  :func:`stage_backward` — the same forward, then the
  backward, the activations' gradients sent back stage by stage (training at PP > 1).
* :func:`recompute_logprobs_parallel` — all of the above from the caller's process (data-parallel replicas each
  take a share of the rows: :func:`data_parallel_chunks`).
* :func:`export_hf_parallel` — from every rank: the one-process HF checkpoint of the model (TP / EP pieces gathered).

Why not Megatron's ``get_forward_backward_func`` schedules: their point-to-point layer
allocates its receive buffers with ``device=torch.cuda.current_device()`` and the schedules
assume CUDA streams, so they do not run on a CPU-only gloo job; :func:`stage_forward` moves
the same tensors with ``dist.send`` / ``dist.recv`` on either backend (no arithmetic on them
either way).

Every collective of the consistent layers (:mod:`.tensor_parallel`, :func:`gather_vocab`,
Megatron's embedding all-reduce) takes tensors on the rank's device — CUDA tensors under NCCL —
and no object collective is used; tensors reach the CPU only to be written to the job's files.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..config import ArchConfig, UnsupportedConfigError
from . import tensor_parallel as tpar
from .context_parallel import (cp_positions, cp_rank, cp_share, gather_cp_sequence, sequence_length_refusal,
                               sequence_token_logprobs)
from .parallel import check_rank_devices, global_layer_name, rank_backend

__all__ = ["NVLINK_MULTICAST_OFF", "build_parallel_model", "data_parallel_chunks", "export_hf_parallel", "gather_vocab",
           "load_full_megatron_state", "megatron_state_from_hf",
           "rank_device", "recompute_logprobs_parallel", "spawn_ranks", "stage_backward", "stage_forward",
           "stage_logprobs"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# NVLink multicast stays off in NCCL ranks (as benchmarks/gpu_setup.sh sets for every GPU run): NCCL's NVLS
# algorithms, torch symmetric memory and NVSHMEM would otherwise use it
NVLINK_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# ---------------------------------------------------------------------------------------------- weights
def read_hf_tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF safetensors checkpoint folder (single file or sharded index) or one ``.safetensors`` file."""
    from ..conversion.hf import _checkpoint_files

    path = Path(path)
    files = [path] if path.is_file() else _checkpoint_files(path)[0]
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                out[k] = sf.get_tensor(k)
    return out


def megatron_state_from_hf(arch: ArchConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full (TP=1, global layer numbering) Megatron tensors of HF tensors, by the weight table's joins."""
    from ..conversion.hf import _join, _plan

    return {m: _join(arch, kind, [hf[n] for n in names]) for m, names, kind in _plan(arch)}


@torch.no_grad()
def load_full_megatron_state(model, full: dict[str, torch.Tensor]) -> None:
    """Copy this rank's piece (TP shard, PP stage, EP shard of the experts) of the full Megatron tensors into
    ``model``, in place."""
    missing = []
    for name, p in model.named_parameters():
        g = global_layer_name(model, name)
        if g == "output_layer.weight" and g not in full:  # tied embeddings: the last stage's copy (PP > 1)
            g = "embedding.word_embeddings.weight"
        if g not in full:
            missing.append(g)
            continue
        piece = tpar.shard_like(full[g], p)
        if tuple(piece.shape) != tuple(p.shape):
            raise ValueError(f"{g}: shard of shape {tuple(piece.shape)} for a parameter of shape {tuple(p.shape)}")
        p.data.copy_(piece.to(p.dtype))
    if missing:
        raise ValueError(f"the weights lack {missing[:8]}")


@torch.no_grad()
def export_hf_parallel(model, out_dir) -> Path:
    """The HF checkpoint of a model trained at any TP x PP x DP (EP) layout, bit for bit the tensors of the same
    weights at TP = PP = EP = 1 -- what a rollout engine loads or a weight push sends.  Every rank of the job calls it
    (collectives).  Each parameter's TP or EP pieces are all-gathered (concatenation, :func:`tensor_parallel.unshard_like`);
    data-parallel replica 0's first TP rank of each pipeline stage writes that stage's tensors
    (``model.safetensors`` at PP = 1, else ``model-0000k-of-0000p.safetensors``), then global rank 0 writes the index
    (PP > 1) and ``config.json``.  ``out_dir``: one folder every rank sees, new or without model files (else every
    rank refuses before any collective)."""
    from megatron.core import parallel_state as ps

    from ..conversion.hf import hf_tensors_from_megatron, segments_refusal, write_hf_config

    arch = model.arch_config
    reason = segments_refusal(model, arch)  # every rank holds row-parallel layers: every rank refuses, no collective
    if reason:
        raise UnsupportedConfigError(reason)
    out = Path(out_dir)
    old = sorted(f.name for f in out.glob("model*.safetensors*"))
    if old:  # every rank sees the folder, so every rank refuses, before any collective
        raise ValueError(f"export to {out}: the folder already holds {old[:3]}; export into a new or empty folder")
    dist.barrier()  # every rank has looked before any writes
    full = {global_layer_name(model, n): tpar.unshard_like(p.detach(), p) for n, p in model.named_parameters()}
    stage, stages = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    name = "model.safetensors" if stages == 1 else f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"
    if ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file(hf_tensors_from_megatron(arch, full), str(out / name), metadata={"format": "pt"})
    dist.barrier()
    if dist.get_rank() == 0:
        if stages > 1:
            weight_map = {}
            for f in sorted(out.glob("model-*-of-*.safetensors")):
                with safe_open(str(f), framework="pt") as sf:
                    weight_map.update(dict.fromkeys(sf.keys(), f.name))
            (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
        write_hf_config(arch, {p.dtype for p in model.parameters()}, out)
    dist.barrier()
    return out


def rank_device() -> torch.device:
    """This rank's device: ``cuda:<current device>`` in an NCCL job (:func:`spawn_ranks` sets rank r on ``cuda:r``),
    the CPU otherwise (gloo)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_parallel_model(hf_config, weights=None, *, tp: int = 1, pp: int = 1, dtype: torch.dtype | None = None,
                         seed: int = 0, sequence_parallel: bool = False, ep: int = 1, cp: int = 1):
    """In a rank of a ``TP * CP * PP * DP`` job: the consistent model of this rank (weights: HF checkpoint path or HF
    tensors dict; ``None`` keeps the seeded initialization), built and loaded on the CPU, then moved to
    :func:`rank_device` (a no-op in a gloo job).  ``ep``: expert parallelism (MoE; at TP > 1 with
    ``sequence_parallel``); ``cp``: context parallelism (GPT models; :mod:`.context_parallel`)."""
    from .model import build_consistent_model

    model = build_consistent_model(hf_config, seed=seed, dtype=dtype, tensor_model_parallel_size=tp,
                                   pipeline_model_parallel_size=pp, sequence_parallel=sequence_parallel,
                                   **({"expert_model_parallel_size": ep} if ep != 1 else {}),
                                   **({"context_parallel_size": cp} if cp != 1 else {}))
    if weights is not None:
        hf = weights if isinstance(weights, dict) else read_hf_tensors(weights)
        load_full_megatron_state(model, megatron_state_from_hf(model.arch_config, hf))
    return model.to(rank_device())


# ---------------------------------------------------------------------------------------------- one stage
def _stage_run(model, input_ids: torch.Tensor, *, requires_grad: bool = False):
    """``(received, out)``: the activations received from the previous stage (``None`` on the first; a leaf that
    requires grad when ``requires_grad``) and this stage's output -- the float32 logits shard on the last stage, else
    the activations, sent on to the next stage (detached: the sent tensor is a copy of the bytes).  At CP > 1 the
    stage runs the CP rank's share of ``input_ids`` (:func:`.context_parallel.cp_share`)."""
    from megatron.core import parallel_state as ps

    sp = getattr(model, "sequence_parallel", False)
    t = tpar.tp_size()
    reason = sequence_length_refusal(input_ids.shape[1], getattr(model, "context_parallel_size", 1), t, sp)
    if reason:
        raise UnsupportedConfigError(reason)
    input_ids = cp_share(input_ids)
    b, s = input_ids.shape
    positions = cp_positions(b, s, device=input_ids.device)
    received = None
    if not model.pre_process:
        chunk = s // t if sp else s
        received = torch.empty(chunk, b, model.config.hidden_size, dtype=model.config.params_dtype,
                               device=input_ids.device)
        dist.recv(received, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(received.requires_grad_(requires_grad))
    out = model(input_ids, positions, None)
    if not model.post_process:
        dist.send(out.detach().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
    return received, out


def stage_forward(model, input_ids: torch.Tensor):
    """This pipeline stage's forward: float32 logits shard ``[b, s, V/TP]`` on the last stage, ``None`` elsewhere.
    ``input_ids`` on the model's device (the received activations land there too)."""
    _, out = _stage_run(model, input_ids)
    return out if model.post_process else None


def stage_logprobs(model, input_ids: torch.Tensor, temperature: float = 1.0):
    """float32 ``[b, s-1]`` token log-probs on the last stage (``None`` elsewhere), vocab-parallel at TP > 1, in token
    order at CP > 1 (every CP rank: all of them, :func:`.context_parallel.sequence_token_logprobs`)."""
    logits = stage_forward(model, input_ids)
    if logits is None:
        return None
    return sequence_token_logprobs(logits, input_ids, temperature)


def stage_backward(model, input_ids: torch.Tensor, loss_fn, temperature: float = 1.0):
    """One micro-batch's forward and backward through this pipeline stage (every rank of the job calls it): the last
    stage backpropagates ``loss_fn(token log-probs [b, s-1])`` (a scalar), every other stage its output with the
    gradient the next stage sends back; each stage but the first then sends its input's gradient to the previous one
    (``dist.send`` / ``dist.recv``: the bytes unchanged, as the forward's activations).  The parameters' ``.grad``
    accumulate this stage's gradients, to be reduced over the TP / DP / expert-data-parallel ranks as usual (Megatron's
    ``finalize_model_grads``; at CP > 1 every CP rank backpropagates its own tokens' part of the loss, and the CP ranks'
    gradients are summed too: Megatron's data-parallel-with-context-parallel group).  At PP = 1 it is
    ``loss_fn(stage_logprobs(...)).backward()``.  Returns the loss on the last stage, ``None`` elsewhere."""
    from megatron.core import parallel_state as ps

    received, out = _stage_run(model, input_ids, requires_grad=True)
    loss = None
    if model.post_process:
        loss = loss_fn(sequence_token_logprobs(out, input_ids, temperature))
        loss.backward()
    else:
        grad = torch.empty_like(out)
        dist.recv(grad, src=ps.get_pipeline_model_parallel_next_rank())
        out.backward(grad)
    if received is not None:
        dist.send(received.grad.contiguous(), dst=ps.get_pipeline_model_parallel_prev_rank())
    return loss


def gather_vocab(shard: torch.Tensor) -> torch.Tensor:
    """The full last axis from the TP ranks' contiguous shards (all-gather + concatenation: no arithmetic)."""
    group = tpar.tp_group()
    if tpar.tp_size(group) == 1:
        return shard
    parts = [torch.empty_like(shard.contiguous()) for _ in range(tpar.tp_size(group))]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


# ---------------------------------------------------------------------------------------------- processes
def _rank_main(rank: int, worker, workdir: str, world: int, device: str, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    bind = {}
    if device == "cuda":  # NCCL: rank r owns cuda:r (bound at init: NCCL's communicators and barrier use it)
        os.environ.update(NVLINK_MULTICAST_OFF)
        torch.cuda.set_device(rank)
        bind["device_id"] = torch.device("cuda", rank)
    store = dist.FileStore(str(Path(workdir) / "store"), world)
    dist.init_process_group(rank_backend(device), store=store, rank=rank, world_size=world, **bind)
    try:
        worker(rank, workdir, *args)
        dist.barrier()
    except BaseException:
        _record_raised(workdir, rank)
        raise
    finally:
        dist.destroy_process_group()


def _record_raised(workdir: str, rank: int) -> None:
    """In a rank whose worker raised, before it leaves the process group: its traceback and the (machine-wide)
    monotonic clock, for :func:`_first_raised` -- a peer's error caused by this rank leaving comes later."""
    import traceback

    (Path(workdir) / f"rank{rank}.raised.json").write_text(json.dumps(
        {"rank": rank, "pid": os.getpid(), "at_ns": time.monotonic_ns(), "traceback": traceback.format_exc()}))


def _first_raised(workdir, reported):
    """``torch.multiprocessing`` reports the lowest-numbered failed rank it sees (``reported``, a raised one), which
    may be a peer that only lost its connection to the rank that raised first (``Connection closed by peer``): the
    first rank's error instead (in ``torch.multiprocessing``'s wording), or ``reported`` where no other rank raised
    earlier."""
    import torch.multiprocessing as mp

    records = [json.loads(f.read_text()) for f in Path(workdir).glob("rank*.raised.json")]
    if not records:
        return reported
    first = min(records, key=lambda r: r["at_ns"])
    if first["rank"] == reported.error_index:
        return reported
    return mp.ProcessRaisedException(f"\n\n-- Process {first['rank']} terminated with the following error:\n"
                                     f"{first['traceback']}", first["rank"], first["pid"])


def spawn_ranks(worker, world: int, workdir, *args, device: str = "cpu") -> None:
    """Run ``worker(rank, workdir, *args)`` in ``world`` processes (FileStore in ``workdir``): gloo on the CPU
    (``device="cpu"``), or NCCL with rank r on ``cuda:r`` (``device="cuda"``: ``world`` CUDA devices must be visible;
    NVLink multicast off in every rank).

    CPU: the warm rank launcher (:func:`_serve_rank_jobs`: a process spawned at this process's first CPU job, which
    imported this module -- Megatron-Core: seconds -- and computed nothing) forks a job process, which takes this
    process's environment, working directory, ``sys.path``, stdout and stderr, imports the worker's module and forks
    the ``world`` ranks from that clean state (no thread pool started, no tensor computed there), so the imports are
    paid once per calling process instead of once per job and rank; the ranks run the same code, so the bits are the
    same (a variable a module reads at import keeps the value it had when the launcher started: none of the modules
    it imports reads one).  CUDA: each rank spawned (a fork must not inherit a CUDA context).  A failing rank raises
    ``torch.multiprocessing``'s ``ProcessRaisedException`` / ``ProcessExitedException`` (its message carries the
    rank's traceback) either way; of ranks that raised, the first to raise is reported (:func:`_first_raised`), not a
    peer that lost its connection to it.

    ``worker`` must be importable by name (module level); ``args``: plain values (str / int / float / bool).
    """
    import torch.multiprocessing as mp

    check_rank_devices(device, world)
    for a in args:
        if not isinstance(a, (str, int, float, bool, type(None))):
            raise TypeError(f"spawn_ranks passes plain values only (tensors go through files), got {type(a).__name__}")
    for stale in (Path(workdir) / "store", *Path(workdir).glob("rank*.raised.json")):
        stale.unlink(missing_ok=True)
    try:
        _start_ranks(worker, world, str(workdir), args, device)
    except mp.ProcessRaisedException as e:  # an exited rank (a signal, os._exit) records nothing: reported as it is
        first = _first_raised(workdir, e)
        if first is e:
            raise
        raise first from None


def _start_ranks(worker, world: int, workdir: str, args: tuple, device: str) -> None:
    """:func:`spawn_ranks`' processes: spawned on CUDA, through the warm rank launcher on the CPU."""
    import torch.multiprocessing as mp

    if device == "cuda":
        mp.start_processes(_rank_main, args=(worker, workdir, world, device, args), nprocs=world, join=True,
                           start_method="spawn")
        return
    failure = Path(workdir) / "ranks.failure.json"
    failure.unlink(missing_ok=True)
    pid, exitcode = _run_rank_job((worker.__module__, worker.__qualname__, str(workdir), world, args, str(failure),
                              dict(os.environ), os.getcwd(), list(sys.path)))
    if failure.exists():
        f = json.loads(failure.read_text())
        if f["kind"] == "exited":
            raise mp.ProcessExitedException(f["msg"], f["index"], f["pid"], f["exit_code"], f["signal_name"])
        raise mp.ProcessRaisedException(f["msg"], f["index"], f["pid"])
    if exitcode != 0:
        raise mp.ProcessExitedException(f"the rank job process exited with code {exitcode}", 0, pid, exitcode, None)


_RANK_LAUNCHER = None  # (pid, process, connection): process pid's warm rank launcher, started at its first CPU job


def _run_rank_job(job: tuple) -> tuple[int, int]:
    """Hand ``job`` (:func:`_rank_job`'s arguments) and this process's stdout / stderr to the warm rank launcher
    (started here at this process's first job, and again where it has died: a forked copy of a caller starts its
    own); the job process's pid and exit code."""
    import multiprocessing as mp
    from multiprocessing import reduction, util

    global _RANK_LAUNCHER
    if _RANK_LAUNCHER is None or _RANK_LAUNCHER[0] != os.getpid() or not _RANK_LAUNCHER[1].is_alive():
        if _RANK_LAUNCHER is not None and _RANK_LAUNCHER[0] == os.getpid():
            _RANK_LAUNCHER[2].close()  # the dead launcher's end
        ours, theirs = mp.Pipe()
        launcher = mp.get_context("spawn").Process(target=_serve_rank_jobs, args=(theirs,))
        launcher.start()
        theirs.close()
        # at exit, before multiprocessing joins its children: the launcher reads the end of the pipe and leaves
        util.Finalize(None, ours.close, exitpriority=10)
        _RANK_LAUNCHER = (os.getpid(), launcher, ours)
    _, launcher, conn = _RANK_LAUNCHER
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send_bytes(json.dumps(job).encode())  # plain values as JSON: nothing pickled
    for fd in (1, 2):
        reduction.send_handle(conn, fd, launcher.pid)
    pid, exitcode = json.loads(conn.recv_bytes())
    return pid, exitcode


def _serve_rank_jobs(conn) -> None:
    """The warm rank launcher: for each job received, a forked job process runs :func:`_rank_job` with the caller's
    stdout / stderr; answers with its pid and exit code.  Leaves when the caller closes the pipe."""
    import multiprocessing as mp
    from multiprocessing import reduction

    while True:
        try:
            job = json.loads(conn.recv_bytes())
        except EOFError:
            return
        fds = [reduction.recv_handle(conn) for _ in (1, 2)]
        proc = mp.get_context("fork").Process(target=_rank_job, args=(*job, fds))
        proc.start()
        for fd in fds:
            os.close(fd)
        proc.join()
        conn.send_bytes(json.dumps([proc.pid, proc.exitcode]).encode())


def _rank_job(module: str, name: str, workdir: str, world: int, args: tuple, failure: str, env: dict, cwd: str,
              path: list, fds: list) -> None:
    """In a job process forked from the warm rank launcher: the caller's environment, working directory, ``sys.path``,
    stdout and stderr, then the ranks of the worker ``module.name`` (:func:`_fork_ranks`; ``args``, a JSON list, as the
    tuple the worker takes)."""
    import importlib

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    for target, fd in zip((1, 2), fds):
        os.dup2(fd, target)
    _fork_ranks(getattr(importlib.import_module(module), name), workdir, world, tuple(args), failure)


def _fork_ranks(worker, workdir: str, world: int, args: tuple, failure: str) -> None:
    """In the job process of :func:`spawn_ranks` (CPU): fork the ranks, join them; a failure is written to
    ``failure`` (JSON) for the caller to raise."""
    import torch.multiprocessing as mp

    try:
        mp.start_processes(_rank_main, args=(worker, workdir, world, "cpu", args), nprocs=world, join=True,
                           start_method="fork")
    except mp.ProcessExitedException as e:
        Path(failure).write_text(json.dumps({"kind": "exited", "msg": str(e), "index": e.error_index, "pid": e.error_pid,
                                             "exit_code": e.exit_code, "signal_name": e.signal_name}))
    except mp.ProcessRaisedException as e:
        Path(failure).write_text(json.dumps({"kind": "raised", "msg": str(e), "index": e.error_index, "pid": e.error_pid}))


def data_parallel_chunks(rows: int, dp: int, batch: int | None) -> list[list[tuple[int, int]]]:
    """The row chunks ``(start, stop)`` each of ``dp`` data-parallel ranks forwards, in rank order: rank d takes a
    contiguous share (the shares differ by one row at most), cut into as many chunks as the largest share needs at
    ``batch`` rows a chunk (``None``: one), so every rank runs the same number of forwards -- the collectives of an
    expert-parallel layer need every rank of its group in each.  No chunk is empty: where the smallest share has
    fewer rows than that, it sets the count (a chunk of the largest share may then hold ``batch + 1`` rows).
    Needs ``rows >= dp``."""
    if rows < dp:
        raise ValueError(f"{rows} rows cannot give each of {dp} data-parallel ranks a row")
    share = [rows // dp + (d < rows % dp) for d in range(dp)]
    n = min(-(-share[0] // (batch or share[0])), share[-1])
    out, start = [], 0
    for d in range(dp):
        sizes = [share[d] // n + (i < share[d] % n) for i in range(n)]
        chunks = []
        for size in sizes:
            chunks.append((start, start + size))
            start += size
        out.append(chunks)
    return out


def _recompute_worker(rank: int, workdir: str, tp: int, pp: int, ep: int, cp: int) -> None:
    from megatron.core import parallel_state as ps

    work = Path(workdir)
    job = json.loads((work / "job.json").read_text())
    model = build_parallel_model(job["config"], job["weights"], tp=tp, pp=pp, ep=ep, cp=cp,
                                 dtype=_DTYPES[job["dtype"]] if job["dtype"] else None,
                                 sequence_parallel=job["sequence_parallel"])
    model.eval()
    if job.get("quantization"):  # block-FP8 forward on the loaded bf16 masters (layers/fp8.py)
        from ..kernels.fp8 import QuantFormat
        from .fp8 import enable_fp8

        w_spec, a_spec = job["quantization"]
        enable_fp8(model, QuantFormat.from_spec(w_spec), QuantFormat.from_spec(a_spec) if a_spec else None)
    ids = load_file(str(work / "inputs.safetensors"))["input_ids"].to(rank_device())
    d, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    lps, logits_parts, routes = [], [], {}
    with torch.no_grad():
        for b0, b1 in data_parallel_chunks(ids.shape[0], dp, job.get("batch"))[d]:  # each row's bits: its own
            chunk = ids[b0:b1]
            logits = stage_forward(model, chunk)
            if job.get("return_routes"):  # MoE: this stage's routes of the chunk, global layer numbers ([s*b, k], [s, b] order)
                from .moe import collect_routes

                for i, r in collect_routes(model).items():
                    routes[f"r{b0}.l{model.decoder.layers[i].layer_number - 1}"] = r.cpu().contiguous()
            if logits is not None:
                lps.append(sequence_token_logprobs(logits, chunk, job["temperature"]))
                if job["return_logits"]:
                    logits_parts.append(gather_cp_sequence(gather_vocab(logits)))
    first_tp = ps.get_tensor_model_parallel_rank() == 0 and cp_rank() == 0
    if routes and first_tp:
        save_file(routes, str(work / f"routes.dp{d}.stage{ps.get_pipeline_model_parallel_rank()}.safetensors"))
    if lps and first_tp:
        out = {"logprobs": torch.cat(lps).cpu().contiguous()}
        if logits_parts:
            out["logits"] = torch.cat(logits_parts).cpu().contiguous()
        save_file(out, str(work / f"out.dp{d}.safetensors"))


def recompute_logprobs_parallel(hf_config, weights, input_ids: torch.Tensor, *, tp: int = 1, pp: int = 1,
                                dtype: torch.dtype | None = None, temperature: float = 1.0, return_logits: bool = False,
                                sequence_parallel: bool = False, workdir=None, batch: int | None = None,
                                return_routes: bool = False, device: str = "cpu", dp: int = 1, ep: int = 1, cp: int = 1,
                                quantization=None):
    """Token log-probs of ``input_ids`` by the consistent Megatron model at TP = ``tp``, PP = ``pp``, DP = ``dp``,
    EP = ``ep``, CP = ``cp``: ``tp * cp * pp * dp`` gloo ranks on the CPU (``device="cpu"``) or NCCL ranks on as many
    GPUs (``device="cuda"``, rank r on ``cuda:r``).  ``cp`` (GPT models; the sequence length divisible by 2 x CP,
    and with ``sequence_parallel`` by CP x TP too): each sequence's tokens over the CP ranks
    (:mod:`.context_parallel`) -- same bits.

    ``hf_config``: path to an HF config (folder with config.json, or the file) or an HF config dict.
    ``weights``: path to an HF safetensors checkpoint (folder or file) or a dict of HF-named tensors.
    ``input_ids``: int ``[b, s]`` (or a list of equal-length token lists).
    Returns float32 ``[b, s-1]``: log p(ids[:, t+1] | ids[:, :t+1]) — bitwise the TP=1 / PP=1 values
    (and those of the vLLM plugin for the same weights); with ``return_logits=True`` also the full float32
    logits ``[b, s, V]``.  ``sequence_parallel`` (TP > 1; s divisible by TP): Megatron's sequence parallelism,
    same bits.  ``dp``: data-parallel replicas, each forwarding its own contiguous share of the rows
    (:func:`data_parallel_chunks`; ``b >= dp``); ``ep`` (MoE, dividing ``tp * dp``; at TP > 1 with
    ``sequence_parallel``): the experts sharded over expert-parallel groups of that many ranks, whose tokens differ
    -- same bits.  Spawns the ranks once, whatever
    the batch; ``workdir`` (default: a temporary folder) holds the job files.  ``batch``: forward the rows in chunks
    of at most this many (bounds the logits' memory; the same bits).
    ``return_routes`` (MoE): also ``{first row of a chunk: {layer: experts [s*b_chunk, k]}}`` (global 0-based layer
    numbers, each chunk's routes in Megatron's ``[s, b]`` order, as ``layers.moe.collect_routes``) — appended to the
    return value.  Returned tensors are on the CPU.  Unsupported layouts, and ``device="cuda"`` with fewer than
    ``tp * pp * dp`` visible CUDA devices, raise ``UnsupportedConfigError`` in the caller before any process starts.
    ``quantization``: ``(weight format, activation format or None)`` -- every rank runs the FP8 / NVFP4 forward on
    the loaded masters (:func:`.fp8.enable_fp8`; at any PP, DP, CP and EP, and at TP > 1 layouts of whole scale
    blocks, dense or MoE: :func:`..conversion.fp8.fp8_tp_refusal`, refused here by name).
    """
    from .builder import as_arch_config, check_tp_shapes
    from .parallel import HYBRID_FEATURE, check_parallel_sizes

    arch = as_arch_config(hf_config)
    check_parallel_sizes(tp, pp, cp, sequence_parallel=sequence_parallel, expert_model_parallel_size=ep,
                         feature=HYBRID_FEATURE if arch.is_hybrid else None)
    check_tp_shapes(arch, tp, pp, ep)
    if quantization is not None:
        from ..conversion.fp8 import fp8_tp_refusal

        reason = fp8_tp_refusal(arch, tp, quantization[0])
        if reason:
            raise UnsupportedConfigError(reason)
    if dp < 1 or (tp * dp) % ep:
        raise UnsupportedConfigError(f"DP={dp}: the data-parallel size must be positive and EP={ep} must divide "
                                     f"TP x DP = {tp * dp} (the ranks of a pipeline stage)")
    check_rank_devices(device, tp * cp * pp * dp)
    ids = torch.as_tensor(input_ids, dtype=torch.int64)
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got {tuple(ids.shape)}")
    reason = sequence_length_refusal(ids.shape[1], cp, tp, sequence_parallel)
    if reason:
        raise UnsupportedConfigError(reason)
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    data_parallel_chunks(ids.shape[0], dp, batch)  # b >= dp: refused here, before the ranks start
    with tempfile.TemporaryDirectory() if workdir is None else _nullcontext(workdir) as wd:
        work = Path(wd)
        work.mkdir(parents=True, exist_ok=True)
        config = hf_config if isinstance(hf_config, dict) else None
        config_path = str(Path(hf_config)) if config is None else str(work / "config.json")
        if config is not None:
            (work / "config.json").write_text(json.dumps(config))
        if isinstance(weights, dict):
            save_file({k: v.contiguous() for k, v in weights.items()}, str(work / "weights.safetensors"))
            weights_path = str(work / "weights.safetensors")
        else:
            weights_path = str(Path(weights))
        save_file({"input_ids": ids.contiguous()}, str(work / "inputs.safetensors"))
        dname = {v: k for k, v in _DTYPES.items()}.get(dtype) if dtype is not None else None
        job = {"config": config_path, "weights": weights_path, "dtype": dname, "temperature": float(temperature),
               "return_logits": bool(return_logits), "sequence_parallel": bool(sequence_parallel), "batch": batch,
               "return_routes": bool(return_routes),
               "quantization": None if quantization is None else [quantization[0].spec, quantization[1].spec if quantization[1] else ""]}
        (work / "job.json").write_text(json.dumps(job))
        for old in [*work.glob("out.dp*.safetensors"), *work.glob("routes.dp*.safetensors")]:
            old.unlink()
        spawn_ranks(_recompute_worker, tp * cp * pp * dp, work, tp, pp, ep, cp, device=device)
        outs = [load_file(str(work / f"out.dp{d}.safetensors")) for d in range(dp)]
        out = {k: torch.cat([o[k] for o in outs]) for k in outs[0]}
        routes: dict[int, dict[int, torch.Tensor]] = {}
        for f in sorted(work.glob("routes.dp*.safetensors")):
            for k, v in load_file(str(f)).items():
                first, layer = k.split(".")
                routes.setdefault(int(first[1:]), {})[int(layer[1:])] = v
    result = (out["logprobs"], out["logits"]) if return_logits else (out["logprobs"],)
    if return_routes:
        result = (*result, routes)
    return result if len(result) > 1 else result[0]


class _nullcontext:
    def __init__(self, value):
        self.value = value

    def __enter__(self):
        return self.value

    def __exit__(self, *exc):
        return False

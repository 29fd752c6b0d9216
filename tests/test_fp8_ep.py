"""Block-FP8 MoE experts over expert-parallel ranks in the trainer (docs/fp8.md, "Expert parallelism").

``tiny-qwen2moe-fp8tp`` (8 experts of width 64, top-2, a 128-wide shared expert; attention of whole 128-blocks at TP 2),
the FP8 forward (``layers.fp8.enable_fp8``) on the bf16 masters, gloo ranks (all slow):

* ``recompute_logprobs_parallel`` at EP 2 over DP 2 replicas (5 rows: unequal shares) and at EP 2 over the two ranks
  of TP 2 with sequence parallelism: logits, log-probs and every MoE layer's routes ``torch.equal`` to the one-process
  FP8 forward -- each EP rank quantizes its 4 whole experts on their own grids (the TP = 1 values and scales), its
  received pairs run through the FP8 expert kernels, the outputs go back, the combine with the FP8 shared expert
  (whole on every rank) is the TP = 1 one;
* float32 FP8 gradients (STE; summed as Megatron's ``finalize_model_grads`` does) at both layouts vs the one-process
  float32 FP8 gradients: within ``GRAD_REL_TOL`` (the exchanges' adjoints move bytes; only the order of the gradient
  sums differs); the experts' gradients without the other ranks' tokens are caught;
* broken forwards caught: a rank quantizing its experts' down projections in 64-row slices, each on a grid of its own
  (as a rank holding part of an expert would), and each rank's outputs sent back in another order;
* Megatron's own ``MoELayer`` (the framework entry point, allgather dispatcher) at DP 2 x EP 2 and TP 2 + SP x EP 2
  with the FP8 experts: the one-process FP8 logits and log-probs; a framework-built model (no ``parallel_sizes`` of
  ours) at a misaligned TP 2 (tiny-qwen3moe-top1) refused by ``enable_fp8`` by name (the TP size from the model's own
  config);
* FP8 MoE at TP 2 and TP 2 + SP (EP 1: the experts over the TP ranks): float32 FP8 gradients within ``GRAD_REL_TOL``
  of the one-process ones; the TP ranks' input gradients left unsummed caught.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_context_parallel import QWEN3MOE
from test_fp8_tp import MOETP, _trainer_tp1, _weights
from test_parallel_trainer import (_data_parallel_gradients, _entry_point_model, _experts_without_other_ranks_gradients,
                                   _gloo_moe_dispatch_collectives)

LAYOUTS = {"dp2-ep2": (1, 2), "tp2sp-ep2": (2, 1)}  # (TP, DP); EP 2 each: over the replicas / over the TP group


@contextlib.contextmanager
def _outputs_back_in_another_order():
    """BROKEN on purpose: ``layers.moe.pairs_through_expert_ranks``' third exchange (the outputs back) hands each rank
    the outputs of each other rank reversed, so a pair gets another pair's output."""
    from megatron_consistent.layers import tensor_parallel as tpar

    real, calls = tpar.exchange_rows, itertools.count()

    def exchange(x, send, recv, group):
        got = real(x, send, recv, group)
        return torch.cat([b.flip(0) for b in got.split(recv)]) if next(calls) % 3 == 2 else got

    tpar.exchange_rows = exchange
    try:
        yield
    finally:
        tpar.exchange_rows = real


@contextlib.contextmanager
def _experts_quantized_in_slices(rows: int = 64):
    """BROKEN on purpose: a rank quantizes each expert's down projection ``[H, I]`` in slices of ``rows`` rows, each on
    a 128x128 grid of its own (what a rank holding part of an expert would do) instead of the HF tensor's grid."""
    from megatron_consistent.kernels.fp8 import FP8Weights
    from megatron_consistent.layers.fp8 import FP8MoEBinding

    real = FP8MoEBinding.quantize_weight

    def sliced(self, kind, weight):
        if kind != "experts_fc2":
            return real(self, kind, weight)
        parts = [real(self, kind, w) for w in weight.split(rows, dim=1)]
        return FP8Weights(torch.cat([p.q for p in parts], 1), torch.cat([p.rows for p in parts], 1), weight,
                          parts[0].block_rows)

    FP8MoEBinding.quantize_weight = sliced
    try:
        yield
    finally:
        FP8MoEBinding.quantize_weight = real


def _fp8_ep_worker(rank: int, workdir: str, tp: int) -> None:
    """EP 2 over DP 2 (TP 1) or over TP 2 with sequence parallelism, the FP8 forward: float32 gradients (and the
    experts' without the other ranks' tokens), then the bf16 logits of the two broken forwards."""
    from megatron.core import parallel_state as ps

    from megatron_consistent.layers.distributed import build_parallel_model, data_parallel_chunks, gather_vocab, stage_forward
    from megatron_consistent.layers.fp8 import enable_fp8

    work = Path(workdir)
    ids, weights, sp = load_file(str(work / "inputs.safetensors"))["input_ids"], str(work / "weights.safetensors"), tp > 1
    model32 = build_parallel_model(MOETP, weights, tp=tp, ep=2, dtype=torch.float32, sequence_parallel=sp)
    [(b0, b1)] = data_parallel_chunks(ids.shape[0], ps.get_data_parallel_world_size(), None)[ps.get_data_parallel_rank()]
    mine, tokens, ep_rank = ids[b0:b1], ids[:, 1:].numel(), ps.get_expert_model_parallel_rank()
    enable_fp8(model32)
    grads = _data_parallel_gradients(model32, mine, tokens)
    model32.zero_grad()
    with _experts_without_other_ranks_gradients(ep_rank):
        broken_grads = _data_parallel_gradients(model32, mine, tokens, only_experts=True)
    model = build_parallel_model(MOETP, weights, tp=tp, ep=2, dtype=torch.bfloat16, sequence_parallel=sp)
    enable_fp8(model)
    out = {}
    for name, broken in (("reordered", _outputs_back_in_another_order), ("sliced", _experts_quantized_in_slices)):
        with broken(), torch.no_grad():
            out[name] = gather_vocab(stage_forward(model, mine)).contiguous()
    if ps.get_tensor_model_parallel_rank() == 0:
        save_file(out, str(work / f"broken{ps.get_data_parallel_rank()}.safetensors"))
    if rank == 0:
        save_file(grads, str(work / "grads.safetensors"))
        save_file(broken_grads, str(work / "grads_broken.safetensors"))


def _one_process_fp8_gradients(weights: dict, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The one-process float32 FP8 model's gradients of ``-sum(log-probs) / tokens`` (Megatron names)."""
    from megatron_consistent.layers import build_consistent_model, compute_token_logprobs
    from megatron_consistent.layers.distributed import load_full_megatron_state, megatron_state_from_hf
    from megatron_consistent.layers.fp8 import enable_fp8

    model = build_consistent_model(MOETP, dtype=torch.float32)
    load_full_megatron_state(model, megatron_state_from_hf(model.arch_config, weights))
    enable_fp8(model)
    (-compute_token_logprobs(model, ids).sum() / ids[:, 1:].numel()).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _relative_errors(got: dict, want: dict) -> dict[str, float]:
    return {n: ((got[n] - w).norm() / w.norm()).item() if w.norm() > 0 else got[n].abs().max().item()
            for n, w in want.items() if n in got}


@pytest.fixture(scope="module")
def fp8_ep_runs(tmp_path_factory):
    """One process: the FP8 forward (logits, routes) and float32 FP8 gradients.  Ranks: ``recompute_logprobs_parallel``
    at each layout, and the gradient / broken-forward worker at each layout."""
    from megatron_consistent.kernels.fp8 import E4M3_ACT_1x128, E4M3_WEIGHT_128
    from megatron_consistent.layers.distributed import recompute_logprobs_parallel, spawn_ranks
    from megatron_consistent.layers.moe import collect_routes

    tmp = tmp_path_factory.mktemp("fp8ep")
    weights = _weights(0, MOETP)
    ids = torch.randint(0, 512, (5, 36), generator=torch.Generator().manual_seed(3))  # DP 2 shares: 3 and 2 rows
    logits1, model = _trainer_tp1(weights, ids, model_dir=MOETP)
    logits1 = logits1.transpose(0, 1) if logits1.shape[0] != ids.shape[0] else logits1  # [b, s, V]
    routes1, grads1 = collect_routes(model), _one_process_fp8_gradients(weights, ids)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "weights.safetensors"))
    save_file({"input_ids": ids}, str(tmp / "inputs.safetensors"))
    runs, secs = {}, {}
    for name, (tp, dp) in LAYOUTS.items():
        t0 = time.perf_counter()
        runs[name] = recompute_logprobs_parallel(MOETP, weights, ids, tp=tp, dp=dp, ep=2, sequence_parallel=tp > 1,
                                                 return_logits=True, return_routes=True,
                                                 quantization=(E4M3_WEIGHT_128, E4M3_ACT_1x128), workdir=tmp / name)
        secs[name] = time.perf_counter() - t0
        work = tmp / f"{name}-grads"
        work.mkdir()
        for f in ("weights.safetensors", "inputs.safetensors"):
            (work / f).symlink_to(tmp / f)
        t0 = time.perf_counter()
        spawn_ranks(_fp8_ep_worker, 2, work, tp)
        secs[f"{name}-grads"] = time.perf_counter() - t0
        broken = [load_file(str(work / f"broken{d}.safetensors")) for d in range(dp)]
        runs[name] = (*runs[name], {k: torch.cat([b[k] for b in broken]) for k in broken[0]},
                      load_file(str(work / "grads.safetensors")), load_file(str(work / "grads_broken.safetensors")))
    print("fp8 ep seconds:", json.dumps({k: round(v, 1) for k, v in secs.items()}))
    return {"ids": ids, "logits1": logits1, "routes1": routes1, "grads1": grads1, "runs": runs}


def _one_process_logprobs(runs: dict) -> torch.Tensor:
    """The one-process FP8 log-probs ``[b, s-1]`` of the fixture's rows (the kernels' log-softmax of its logits)."""
    from megatron_consistent.kernels import log_softmax

    ids = runs["ids"]
    return log_softmax(runs["logits1"].float())[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_experts_over_ep_ranks_logits_logprobs_and_routes_equal_one_process(fp8_ep_runs, layout):
    lp, logits, routes, *_ = fp8_ep_runs["runs"][layout]
    ids = fp8_ep_runs["ids"]
    assert torch.equal(logits, fp8_ep_runs["logits1"].float())
    assert torch.equal(lp, _one_process_logprobs(fp8_ep_runs))
    s, b = ids.shape[1], ids.shape[0]
    starts = sorted(routes)  # one chunk a replica: {first row: {layer: experts [s * rows, k]}}
    for first, stop in zip(starts, [*starts[1:], b]):
        assert set(routes[first]) == set(fp8_ep_runs["routes1"]) == {0, 1}
        for layer, experts in fp8_ep_runs["routes1"].items():
            k = experts.shape[-1]
            assert torch.equal(routes[first][layer], experts.view(s, b, k)[:, first:stop].reshape(-1, k)), (layer, first)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_ep_gradients_within_bound_and_without_other_ranks_tokens_caught(fp8_ep_runs, layout):
    from megatron_consistent.verify.reference import GRAD_REL_TOL

    *_, grads, broken_grads = fp8_ep_runs["runs"][layout]
    errs = _relative_errors(grads, fp8_ep_runs["grads1"])
    assert len(errs) == len(fp8_ep_runs["grads1"])
    print(f"FP8 {layout}: max relative gradient error vs one process {max(errs.values()):.3g} ({max(errs, key=errs.get)})")
    assert max(errs.values()) < GRAD_REL_TOL, errs
    broken = max(_relative_errors(broken_grads, fp8_ep_runs["grads1"]).values())
    print(f"FP8 {layout}: the experts' gradients without the other ranks' tokens: max relative error {broken:.3g}")
    assert broken > 1e3 * GRAD_REL_TOL


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("fault", ["reordered", "sliced"])
def test_fp8_ep_outputs_in_another_order_or_sliced_experts_are_caught(fp8_ep_runs, layout, fault):
    broken = fp8_ep_runs["runs"][layout][3]
    assert not torch.equal(broken[fault], fp8_ep_runs["logits1"].float())


TP_LAYOUTS = {"tp2": False, "tp2sp": True}  # EP 1: the experts over the TP ranks (kernels.moe.owned_pair_outputs)


@contextlib.contextmanager
def _tp_input_gradients_unsummed(sequence_parallel: bool):
    """BROKEN on purpose, inside the ``with``: the TP ranks' input gradients left unsummed -- under sequence
    parallelism the backward of ``tensor_parallel.sum_owned_slots`` (each rank's experts then miss the gradients of the
    other rank's tokens), without it the backward of ``tensor_parallel.copy_to_tp`` (a column-parallel input's gradient,
    the experts' rows included, then misses the other rank's heads / experts)."""
    from megatron_consistent.layers import tensor_parallel as tpar

    cls = tpar._SumOwnedSlots if sequence_parallel else tpar._CopyToTP
    real = cls.backward
    cls.backward = staticmethod(lambda ctx, g: (g, *[None] * (2 if sequence_parallel else 1)))
    try:
        yield
    finally:
        cls.backward = real


def _fp8_tp_gradients_worker(rank: int, workdir: str) -> None:
    """TP 2 without and with sequence parallelism (EP 1: each rank its 4 whole experts), the FP8 forward: float32
    gradients summed as Megatron does, then the same with the TP ranks' input gradients unsummed (broken)."""
    from megatron_consistent.layers.distributed import build_parallel_model
    from megatron_consistent.layers.fp8 import enable_fp8

    work = Path(workdir)
    ids, weights = load_file(str(work / "inputs.safetensors"))["input_ids"], str(work / "weights.safetensors")
    out = {}
    for name, sp in TP_LAYOUTS.items():
        model32 = build_parallel_model(MOETP, weights, tp=2, dtype=torch.float32, sequence_parallel=sp)
        enable_fp8(model32)
        out[name] = _data_parallel_gradients(model32, ids, ids[:, 1:].numel())
        model32.zero_grad()
        with _tp_input_gradients_unsummed(sp):
            out[f"{name}-broken"] = _data_parallel_gradients(model32, ids, ids[:, 1:].numel())
    if rank == 0:
        for name, grads in out.items():
            save_file(grads, str(work / f"{name}.safetensors"))


@pytest.fixture(scope="module")
def fp8_tp_gradients(fp8_ep_runs, tmp_path_factory):
    """The float32 FP8 gradients at TP 2 (and TP 2 + SP) of the fixture's rows, and their broken variants."""
    from megatron_consistent.layers.distributed import spawn_ranks

    tmp = tmp_path_factory.mktemp("fp8tpgrads")
    save_file({k: v.contiguous() for k, v in _weights(0, MOETP).items()}, str(tmp / "weights.safetensors"))
    save_file({"input_ids": fp8_ep_runs["ids"]}, str(tmp / "inputs.safetensors"))
    t0 = time.perf_counter()
    spawn_ranks(_fp8_tp_gradients_worker, 2, tmp)
    print(f"fp8 tp gradients seconds: {time.perf_counter() - t0:.1f}")
    return {name: load_file(str(tmp / f"{name}.safetensors")) for name in (*TP_LAYOUTS, *(f"{n}-broken" for n in TP_LAYOUTS))}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(TP_LAYOUTS))
def test_fp8_moe_tp2_gradients_within_bound_and_unsummed_input_gradients_caught(fp8_ep_runs, fp8_tp_gradients, layout):
    """FP8 MoE at TP 2 (+ SP): the forward is the one-process bits (test_fp8_tp), so the float32 STE gradients differ
    from the one-process float32 FP8 gradients only by the order of float32 sums (the input gradients' all-reduce over
    the TP ranks, the sequence-parallel weights' sum): within ``GRAD_REL_TOL``, as at EP; unsummed input gradients
    (:func:`_tp_input_gradients_unsummed`) are caught."""
    from megatron_consistent.verify.reference import GRAD_REL_TOL

    errs = _relative_errors(fp8_tp_gradients[layout], fp8_ep_runs["grads1"])
    assert len(errs) == len(fp8_ep_runs["grads1"])
    print(f"FP8 MoE {layout}: max relative gradient error vs one process {max(errs.values()):.3g} ({max(errs, key=errs.get)})")
    assert max(errs.values()) < GRAD_REL_TOL, errs
    broken = max(_relative_errors(fp8_tp_gradients[f"{layout}-broken"], fp8_ep_runs["grads1"]).values())
    print(f"FP8 MoE {layout}: the TP ranks' input gradients unsummed: max relative error {broken:.3g}")
    assert broken > 1e3 * GRAD_REL_TOL


MEGATRON_LAYOUTS = {"dp2-ep2": 1, "tp2sp-ep2": 2}  # TP (with SP at 2); EP 2 over the replicas / over the TP group


def _megatron_fp8_ep_worker(rank: int, workdir: str, tp: int) -> None:
    """Megatron's MoELayer through the entry point at DP 2 x EP 2 or TP 2 + SP x EP 2 (allgather dispatcher), the FP8
    forward: each replica's logits and (vocab-parallel) log-probs.  At TP 2 first a framework-built model of a layout
    the FP8 alignment refuses (tiny-qwen3moe-top1: 64 q rows a rank, half a scale block) goes to ``enable_fp8``: the
    refusal's text (empty if none) is written out."""
    from megatron.core import parallel_state as ps

    from megatron_consistent.config import UnsupportedConfigError
    from megatron_consistent.layers import as_arch_config
    from megatron_consistent.layers.context_parallel import sequence_token_logprobs
    from megatron_consistent.layers.distributed import gather_vocab, stage_forward
    from megatron_consistent.layers.fp8 import enable_fp8

    work, arch = Path(workdir), as_arch_config(MOETP)
    ids = load_file(str(work / "inputs.safetensors"))["input_ids"]
    _gloo_moe_dispatch_collectives()
    if tp > 1:
        misaligned = _entry_point_model(as_arch_config(QWEN3MOE), work / "misaligned.safetensors", tp=tp, sp=True, ep=2)
        misaligned.arch_config = as_arch_config(QWEN3MOE)
        try:
            enable_fp8(misaligned)
            refusal = ""
        except UnsupportedConfigError as err:
            refusal = str(err)
        (work / f"refusal{rank}.txt").write_text(refusal)
    model = _entry_point_model(arch, work / "weights.safetensors", tp=tp, sp=tp > 1, ep=2)
    model.arch_config = arch  # what enable_fp8 reads (a framework model has none of its own)
    enable_fp8(model)
    replica, n = ps.get_data_parallel_rank(), ids.shape[0] // ps.get_data_parallel_world_size()
    mine = ids[replica * n:(replica + 1) * n]
    with torch.no_grad():
        logits = stage_forward(model, mine)
        out = {"logits": gather_vocab(logits).contiguous(), "logprobs": sequence_token_logprobs(logits, mine).contiguous()}
    if ps.get_tensor_model_parallel_rank() == 0:
        save_file(out, str(work / f"out{replica}.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(MEGATRON_LAYOUTS))
def test_fp8_megatron_moelayer_at_ep2_equals_one_process_and_misaligned_tp_refused(fp8_ep_runs, tmp_path, layout):
    """The framework's Megatron MoELayer with the FP8 experts (each EP rank's 4 whole experts quantized on their own
    grids, the FP8 shared expert whole) at DP 2 x EP 2 and TP 2 + SP x EP 2: the one-process FP8 logits and log-probs,
    bit for bit.  At TP 2 a framework-built model (no ``parallel_sizes`` of ours: ``enable_fp8`` reads the TP size off
    the model's own config) of a misaligned layout is refused by name on every rank."""
    from megatron_consistent.layers.distributed import spawn_ranks

    tp, rows = MEGATRON_LAYOUTS[layout], 4
    ids = fp8_ep_runs["ids"][:rows]
    save_file({"input_ids": ids}, str(tmp_path / "inputs.safetensors"))
    save_file({k: v.contiguous() for k, v in _weights(0, MOETP).items()}, str(tmp_path / "weights.safetensors"))
    if tp > 1:
        save_file({k: v.contiguous() for k, v in _weights(0, QWEN3MOE).items()}, str(tmp_path / "misaligned.safetensors"))
    spawn_ranks(_megatron_fp8_ep_worker, 2, tmp_path, tp)
    dp = 2 // tp
    outs = [load_file(str(tmp_path / f"out{d}.safetensors")) for d in range(dp)]
    logits = torch.cat([o["logits"].transpose(0, 1) if o["logits"].shape[0] != rows // dp else o["logits"] for o in outs])
    assert torch.equal(logits, fp8_ep_runs["logits1"][:rows].float())  # [b, s, V]
    assert torch.equal(torch.cat([o["logprobs"] for o in outs]), _one_process_logprobs(fp8_ep_runs)[:rows])
    if tp > 1:
        for rank in range(2):
            refusal = (tmp_path / f"refusal{rank}.txt").read_text()
            assert refusal.startswith("fp8 quantization at TP=2: model.layers.0.self_attn.q_proj.weight (128, 128) gives "
                                      "each rank 64 rows, not whole 128-wide scale blocks"), refusal

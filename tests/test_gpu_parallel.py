"""The trainer's TP x PP layouts on GPUs (issue #19): NCCL ranks, rank r on ``cuda:r``, give the bits of the
single-GPU model (TP = PP = 1 in this process, the trainer ``check --device cuda`` compares at TP = 1).

Zero means zero: logits and token log-probs ``torch.equal``.  A rank that silently ran on the CPU would fail here
(the CPU kernels' bits are not the GPU's).  Needs 2 CUDA devices (an nvidia-h200-x2 machine: docs/parallel.md
"Two GPUs"); the same layouts run as CPU gloo ranks in tests/test_parallel_trainer.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _parallel_layouts import check_layouts

from megatron_consistent.config import builtin_model_dir

VISIBLE = torch.cuda.device_count()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    VISIBLE < 2, reason=f"needs 2 CUDA devices (NCCL ranks, one GPU each); {VISIBLE} visible")]


def _rank_setup_worker(rank: int, workdir: str) -> None:
    """What an NCCL rank runs on, and the row-parallel tree's top over CUDA tensors of both ranks."""
    import os

    import torch.distributed as dist

    from megatron_consistent.kernels.numerics import adjacent_tree_sum
    from megatron_consistent.layers import tensor_parallel as tpar
    from megatron_consistent.layers.distributed import NVLINK_MULTICAST_OFF, rank_device

    device = rank_device()
    g = torch.Generator().manual_seed(11)
    parts = torch.randn(dist.get_world_size(), 3, 50, generator=g) * 1e3  # every rank's float32 subtree, known to all
    top = tpar.gather_tree(parts[rank].to(device), dist.group.WORLD)
    (Path(workdir) / f"rank{rank}.json").write_text(json.dumps({
        "backend": dist.get_backend(), "device": str(device), "top_device": str(top.device),
        "env": {k: os.environ.get(k) for k in NVLINK_MULTICAST_OFF},
        "top_equal": torch.equal(top.cpu(), adjacent_tree_sum(parts.to(device), dim=0).cpu())}))


def test_nccl_ranks_one_gpu_each_multicast_off(tmp_path):
    from megatron_consistent.layers.distributed import NVLINK_MULTICAST_OFF, spawn_ranks

    spawn_ranks(_rank_setup_worker, 2, tmp_path, device="cuda")
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["backend"] == "nccl" and got["device"] == got["top_device"] == f"cuda:{r}", got
        assert got["env"] == NVLINK_MULTICAST_OFF and got["top_equal"], got


@pytest.mark.parametrize("name, layouts", [
    ("tiny-llama", [(2, 1), (1, 2), (2, 1, True)]),  # TP = 2, PP = 2, TP = 2 + sequence parallelism
    ("tiny-qwen3moe-top1", [(2, 1), (1, 2)]),  # experts sharded over the TP ranks (trainer and engine alike)
    ("tiny-qwen3-qknorm-tied", [(2, 1), (1, 2)]),  # tied LM head; at PP = 2 Megatron's embedding-group all-reduce
])
def test_nccl_layouts_equal_one_gpu(tmp_path, name, layouts):
    check_layouts(builtin_model_dir(name), layouts, tmp_path, device="cuda")


@pytest.mark.parametrize("dp, ep, tp", [(2, 2, 1), (1, 2, 2)], ids=["dp2-ep2", "tp2sp-ep2"])
def test_nccl_expert_parallel_equal_one_gpu(tmp_path, dp, ep, tp):
    """The consistent MoE layer's experts over EP = 2 NCCL ranks (two replicas with different rows, or the TP = 2 group
    with sequence parallelism, each rank its chunk): every pair's row to its expert's GPU and the output back by
    ``all_to_all_single`` on NCCL -- the single-GPU logits and log-probs bit for bit."""
    from _parallel_layouts import reference

    from megatron_consistent.layers.distributed import recompute_logprobs_parallel

    config = builtin_model_dir("tiny-qwen2moe-top8-shared")
    weights, ids, logits, lp = reference(config, tmp_path, batch=3, device="cuda")
    got_lp, got_logits = recompute_logprobs_parallel(config, weights, ids, tp=tp, dp=dp, ep=ep, sequence_parallel=tp > 1,
                                                     return_logits=True, device="cuda", workdir=tmp_path / "ranks")
    assert torch.equal(got_logits, logits) and torch.equal(got_lp, lp)

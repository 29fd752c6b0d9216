"""The CUDA MoE and conv1d kernels compile once per model, not once per batch size (CPU: the launches are recorded,
not run).

A rollout engine meets every token count between 1 and its largest prefill chunk.  Triton compiles one binary per
distinct compile key: the ``constexpr`` values, the launch options, and, for every integer argument not marked
``do_not_specialize``, whether it is 1 or a multiple of 16.  A key that follows the token count therefore compiles
new binaries in the middle of a rollout (seconds each).  Here each MoE kernel's keys are collected over T = 1 .. 9000
tokens of a Qwen3-30B-A3B layer: the router, the counting sort and its block counts have one key; the tile table and
the grouped GEMM one per row tile of ``GROUPED_ROW_TILES`` (plus the config's own).  The hybrid's conv1d has two keys
over T = 1 .. 9000 and any number of sequences: decode (T = 1) and prefill.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

pytest.importorskip("triton")

from megatron_consistent.kernels.triton import causal_conv1d as tconv
from megatron_consistent.kernels.triton import moe as tmoe

KERNELS = ("_select_experts_kernel", "_expert_block_counts_kernel", "_expert_sort_kernel", "_tile_table_kernel",
           "_grouped_gemm_kernel")
TOKENS = list(range(1, 70)) + [127, 128, 129, 255, 256, 511, 512, 513, 1023, 1024, 1025, 2047, 3000, 4096, 8191, 9000]


def _compile_key(kernel, args, kwargs) -> tuple:
    key = []
    for i, p in enumerate(kernel.params):
        v = args[i] if i < len(args) else kwargs[p.name]
        if p.is_constexpr:
            key.append((p.name, v))
        elif isinstance(v, torch.Tensor):
            key.append((p.name, v.dtype))
        elif isinstance(v, bool) or not isinstance(v, int) or p.do_not_specialize:
            key.append((p.name, type(v).__name__))
        else:
            key.append((p.name, v == 1, v % 16 == 0))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in kernel.arg_names))
    return tuple(key) + options


def _spy_on(monkeypatch, module, names) -> defaultdict:
    """Replace ``module``'s kernels ``names`` by recorders of their launches' compile keys (kernel name -> keys)."""
    keys = defaultdict(set)

    class Spy:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: keys[self.name].add(_compile_key(self.kernel, args, kwargs))

    for name in names:
        monkeypatch.setattr(module, name, Spy(name, getattr(module, name)))
    return keys


@pytest.fixture
def compile_keys(monkeypatch):
    return _spy_on(monkeypatch, tmoe, KERNELS)


def test_each_moe_kernel_compiles_once_per_model_not_per_token_count(compile_keys):
    e, k, h, inter = 128, 8, 2048, 768
    w_gate_up = torch.empty(e, 2 * inter, h, dtype=torch.bfloat16)
    w_down = torch.empty(e, h, inter, dtype=torch.bfloat16)
    for t in TOKENS:
        tmoe.select_experts(torch.zeros(t, e), k, "softmax", None, True, 1, 1, 1.0)
        experts = torch.arange(t * k).reshape(t, k) % e
        pair_of_row, counts = tmoe.expert_sort(experts, e)
        tiles = tmoe.tile_table(counts, tmoe.grouped_tiles(tmoe.config_for(2 * inter, h, torch.bfloat16, None, False),
                                                             t * k, e)[0], t * k)
        tmoe.grouped_gemm(torch.empty(t, h, dtype=torch.bfloat16), w_gate_up, counts, tiles=tiles,
                          pair_of_row=pair_of_row, gather=True, slots=k)
        tmoe.grouped_gemm(torch.empty(t * k, inter, dtype=torch.bfloat16), w_down, counts, tiles=tiles,
                          pair_of_row=pair_of_row, scatter=True, slots=k)
    row_tiles = len(tmoe.GROUPED_ROW_TILES) + 1
    assert len(compile_keys["_select_experts_kernel"]) == 1
    assert len(compile_keys["_expert_block_counts_kernel"]) == 1
    assert len(compile_keys["_expert_sort_kernel"]) == 1
    assert len(compile_keys["_tile_table_kernel"]) <= row_tiles
    assert len(compile_keys["_grouped_gemm_kernel"]) <= 2 * row_tiles  # two projections


def test_a_specialised_pair_count_is_caught(compile_keys, monkeypatch):
    """The check sees a key that follows T: the sort kernel's pair count specialised again (its ``do_not_specialize``
    dropped) gives one binary per (pairs == 1, pairs % 16 == 0) class."""
    pairs = next(p for p in tmoe._expert_sort_kernel.kernel.params if p.name == "pairs")
    monkeypatch.setattr(pairs, "do_not_specialize", False)
    for t in (1, 2, 3):
        tmoe.expert_sort(torch.arange(t * 8).reshape(t, 8) % 128, 128)
    assert len(compile_keys["_expert_sort_kernel"]) > 1


def _conv_keys(monkeypatch) -> set:
    """The conv1d kernel's compile keys over T = 1 .. 9000 tokens of 1-3 sequences, Nemotron-H 8B's conv width."""
    keys = _spy_on(monkeypatch, tconv, ["_causal_conv1d_kernel"])
    c, k = 10240, 4
    weight, bias = torch.empty(c, k), torch.empty(c)
    for t in TOKENS:
        for seqs in (1, 3):
            tconv.causal_conv1d_triton(torch.empty(seqs, t, c, dtype=torch.bfloat16), weight, bias,
                                       torch.empty(seqs, k - 1, c, dtype=torch.bfloat16), "silu")
    return keys["_causal_conv1d_kernel"]


def test_conv1d_kernel_compiles_twice_per_model_decode_and_prefill(monkeypatch):
    assert len(_conv_keys(monkeypatch)) == 2


def test_a_specialised_conv_block_count_is_caught(monkeypatch):
    """The check sees the conv's block count specialised again (its ``do_not_specialize`` dropped)."""
    blocks = next(p for p in tconv._causal_conv1d_kernel.params if p.name == "n_t_blocks")
    monkeypatch.setattr(blocks, "do_not_specialize", False)
    assert len(_conv_keys(monkeypatch)) > 2

"""Which calls the Gluon switch (``MC_GLUON``) hands to the Gluon kernels (kernels/triton/_common.py, segment_tree.py,
fp8_linear.py): on by default since session 31, ``MC_GLUON=0`` off, only where they are measured ahead and give the
committed bits, a bad value refused by name.  The kernels themselves run on a Hopper GPU only (tests/test_gpu_gluon_candidates.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_consistent.kernels.triton import attention, fp8_linear, paged_attention, segment_tree  # noqa: E402

BF16, F32 = torch.bfloat16, torch.float32


def test_the_switch_is_on_unless_turned_off_and_refuses_other_values(monkeypatch):
    from megatron_consistent.kernels.dispatch import env_switch
    from megatron_consistent.kernels.triton._common import GLUON_DEFAULT

    assert GLUON_DEFAULT is True
    monkeypatch.delenv("MC_GLUON", raising=False)
    assert env_switch("MC_GLUON", GLUON_DEFAULT) and not env_switch("MC_GLUON")
    monkeypatch.setenv("MC_GLUON", "0")
    assert not env_switch("MC_GLUON", GLUON_DEFAULT)
    monkeypatch.setenv("MC_GLUON", "1")
    assert env_switch("MC_GLUON", GLUON_DEFAULT)
    monkeypatch.setenv("MC_GLUON", "yes")
    with pytest.raises(ValueError, match="MC_GLUON='yes': expected 0 or 1"):
        env_switch("MC_GLUON", GLUON_DEFAULT)


def test_off_means_no_call_goes_to_gluon(monkeypatch):
    for module in (segment_tree, fp8_linear, attention, paged_attention):
        monkeypatch.setattr(module, "GLUON", False)
    assert not segment_tree.gluon_tree_applies(4096, 4096, 4096, 8, BF16, BF16)
    assert not fp8_linear.gluon_fp8_applies(4096, 6144, 4096, BF16, 128)
    q, k = torch.empty(1, 4096, 32, 128, dtype=BF16), torch.empty(1, 4096, 8, 128, dtype=BF16)
    assert not attention.gluon_attention_applies(q, k)
    assert not paged_attention.gluon_paged_applies(q[0], torch.empty(64, 16, 8, 128, dtype=BF16), 4096, 0, 4)


def test_a_cpu_tensor_is_never_on_hopper():
    """With the switch on by default, Triton's interpreter (CPU tensors) must reach the committed kernels: the rules
    pass such a call, the device check refuses it without asking CUDA."""
    from megatron_consistent.kernels.triton._common import on_hopper

    q, k = torch.empty(1, 4096, 32, 128, dtype=BF16), torch.empty(1, 4096, 8, 128, dtype=BF16)
    assert attention.gluon_attention_applies(q, k) == attention.GLUON
    assert not on_hopper(q)


def test_tree_rule(monkeypatch):
    monkeypatch.setattr(segment_tree, "GLUON", True)
    applies = segment_tree.gluon_tree_applies
    big = segment_tree.GLUON_TREE_MIN_M
    assert applies(big, 4096, 4096, 8, BF16, BF16)  # 8B o_proj, TP = 1
    assert applies(big, 4096, 14336 // 2, 4, BF16, F32)  # 8B down, a TP = 2 rank's float32 subtree
    assert not applies(big - 1, 4096, 4096, 8, BF16, BF16)  # decode / small prefill: the committed kernel
    assert not applies(big, 4096, 4096, 8, F32, F32)  # float32 operands: not written for them
    assert not applies(big, 4096, 8 * 96, 8, BF16, BF16)  # 96-column segments: not whole 64-column steps
    assert not applies(big, 4100, 4096, 8, BF16, BF16)  # output rows not 16-byte aligned for TMA


def test_tree_rule_refuses_a_split_segment(monkeypatch):
    """A segment the committed table splits (its chain restarts at the split) is not the Gluon kernel's one chain:
    different bits, so never routed."""
    monkeypatch.setattr(segment_tree, "GLUON", True)
    k_seg = 4096
    cfg = segment_tree.segment_config(4096, 8 * k_seg, 8, BF16, 4096)
    monkeypatch.setattr(segment_tree, "segment_config", lambda *a: {**cfg, "SPLIT_STEPS": k_seg // cfg["BK"] // 2})
    assert not segment_tree.gluon_tree_applies(4096, 4096, 8 * k_seg, 8, BF16, BF16)
    monkeypatch.setattr(segment_tree, "segment_config", lambda *a: {**cfg, "SPLIT_STEPS": k_seg // cfg["BK"]})
    assert segment_tree.gluon_tree_applies(4096, 4096, 8 * k_seg, 8, BF16, BF16)


def test_fp8_rule(monkeypatch):
    monkeypatch.setattr(fp8_linear, "GLUON", True)
    applies = fp8_linear.gluon_fp8_applies
    m = fp8_linear.GLUON_FP8_MIN_M
    for n, k in ((6144, 4096), (28672, 4096)):  # 8B qkv (2 splits), gate/up (1): measured ahead
        assert applies(m, n, k, BF16, 128), (n, k)
        assert not applies(m - 1, n, k, BF16, 128)
        assert not applies(m, n, k, BF16, 0)  # per-column weight scales (unknown row blocks): spills, 0.2
        assert not applies(m, n, k, BF16, 64)
        assert fp8_linear.gluon_fp8_schedule(n, k) == "ws regs"
    for n, k in ((4096, 4096), (4096, 14336)):  # four splits: the split sums in shared memory (in registers they spill)
        assert fp8_linear.fp8_config(n, k)["SPLIT_GROUPS"] * 2 < k // fp8_linear.GROUP
        assert applies(m, n, k, BF16, 128), (n, k)
        assert fp8_linear.gluon_fp8_schedule(n, k) == "ws smem sums"
    assert not applies(m, 6144, 4096 + 64, BF16, 128)  # not whole 128-column groups


def test_attention_rule(monkeypatch):
    """Prefill-sized dense calls (more than 64 packed query rows) in bf16 / fp16 with head dim 64 or 128; decode and
    other head dims keep the committed kernel."""
    monkeypatch.setattr(attention, "GLUON", True)
    applies = attention.gluon_attention_applies

    def qk(t, hq, hkv, d, dtype=BF16):
        return torch.empty(1, t, hq, d, dtype=dtype), torch.empty(1, t, hkv, d, dtype=dtype)

    assert applies(*qk(4096, 32, 8, 128))  # 8B prefill
    assert applies(*qk(17, 32, 8, 64))  # 68 packed rows, head dim 64
    assert applies(*qk(1000, 16, 16, 128, torch.float16))
    assert not applies(*qk(16, 32, 8, 128))  # 64 packed rows: the committed kernel's 64-row tiles
    assert not applies(*qk(1, 32, 8, 128))  # decode: the split path
    assert not applies(*qk(4096, 32, 8, 256))  # head dim 256: not written for it
    assert not applies(*qk(4096, 32, 8, 128, F32))


def test_paged_attention_rule(monkeypatch):
    """A step's sequences after its leading one-token ones (the engine's hint ``decode_requests``), with a cache in
    q's dtype, head dim 64 or 128 and enough rows for a 128-row tile; a step of decodes only, an unknown hint and an
    FP8 cache keep the committed kernel."""
    monkeypatch.setattr(paged_attention, "GLUON", True)
    applies = paged_attention.gluon_paged_applies
    q = torch.empty(4096, 32, 128, dtype=BF16)
    cache = torch.empty(64, 16, 8, 128, dtype=BF16)
    assert applies(q, cache, 4096, 0, 4)  # prefill chunks only
    assert applies(q, cache, 4096, 3, 4)  # three decodes, then a chunk: the chunk takes Gluon, the decodes their own launch
    assert not applies(q, cache, 4096, 4, 4)  # decodes only
    assert not applies(q, cache, 4096, -1, 4)  # no hint, or a decode after a chunk
    assert not applies(q, cache, 16, 0, 4)  # 64 rows at most a sequence: the committed kernel's tiles
    assert not applies(q, cache.to(torch.float8_e4m3fn), 4096, 0, 4)  # FP8 cache: read by the committed kernel only
    assert not applies(torch.empty(4096, 32, 256, dtype=BF16), torch.empty(64, 16, 8, 256, dtype=BF16), 4096, 0, 4)


@pytest.mark.parametrize("lens, expected", [([1, 1, 1, 300], 3), ([300, 17], 0), ([1, 1], 2), ([], 0),
                                            ([1, 300, 1], -1), ([300, 1], -1), ([1, 0, 5], -1)])
def test_leading_decodes(lens, expected):
    """The engine's reading of a step: its leading one-token requests when only longer ones follow, else -1 (then
    the whole step keeps the committed kernel); a deliberately wrong reading would route a decode into a tile of
    128 rows or a chunk into the decode launch, which tests/test_gpu_gluon_candidates.py's mixed step catches."""
    assert paged_attention.leading_decodes(lens) == expected

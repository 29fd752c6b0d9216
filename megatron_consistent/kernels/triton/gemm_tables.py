"""M-class GEMM table (issue #15), filled from an H200 run of ``benchmarks/sweep_gpu_gemm.py``.

``(N, K, dtype) -> {"BK", "SPLIT_STEPS", "classes": [(max_M, tile), ..., (None, tile)]}``: the numerics (BLOCK_K
and the split of K) are one per (N, K, dtype); only the tile / schedule (``tile`` = ``{"BM", "BN", "W", "S"`` and
optionally ``"G", "SWAP", "SPILL", "PATH"}``) is picked by M.  An entry goes here only when the sweep found every
one of its tiles bit-identical, row for row, to the others of the same numerics at every M it tried;
tests/test_gpu_kernels.py checks that again for every entry.  Empty: :data:`linear.CONFIG_TABLE` decides.
Paste the sweep's ``gemm_tables.py`` over this file to adopt its recommendation.
"""

import torch  # noqa: F401  (entries name torch dtypes)

GEMM_M_CLASS_TABLE: dict = {}

# FP8 block GEMM tiles, (N, K) -> fp8_linear._fp8_cfg(...) dict (scheduling only: BLOCK_K = 128 and the split are
# fixed by fp8_linear.fp8_config).  Empty: fp8_linear.FP8_TILE_TABLE decides.
FP8_TILE_OVERRIDES: dict = {}

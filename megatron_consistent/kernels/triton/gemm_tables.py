"""M-class GEMM table (issue #15), written by benchmarks/sweep_gpu_gemm.py on NVIDIA H100 80GB HBM3 2026-12-06 (torch 2.11.0+cu130, triton 3.6.0).

Only configs that were bit-identical row for row (M = 1 .. 2048, float32 and bf16 out) to the other tiles
of the same numerics (BK, SPLIT_STEPS) in that run.  See linear.m_class_config / fp8_linear.FP8_TILE_TABLE.
Entries marked 'kept' were not swept in this run and come from the table it replaced (NVIDIA H200, sweeps of sessions
7-21, 2026-12-01 .. 12-04; "session 21 (A3B)": Qwen3-30B-A3B's shapes).  Session 40 (H100) swept the 8B row-parallel
segments at S = 2 / 4 / 8 and the 1B model's plain GEMMs (docs/benchmarks.md, "Session 40"); session 41 (H100) the 1B
down's segment at S = 2 (2048 x 4096; its sweep of 2048 x 1024, the 1B o_proj at S = 2, was slower on the 1B down at
S = 8, the default, which shares that entry: not taken).
"""

import torch

GEMM_M_CLASS_TABLE: dict = {
    # bk64 nosplit: ratio vs cuBLAS by M 1: 0.89, 16: 0.95, 64: 0.95, 256: 0.82, 1024: 0.88, 4096: 0.80 (targets met 2/6)
    (2048, 4096, torch.bfloat16): {"BK": 64, "SPLIT_STEPS": 1048576, "classes": [
                    (16, {'BM': 16, 'BN': 64, 'W': 4, 'S': 8, 'SWAP': True}),
                    (64, {'BM': 64, 'BN': 64, 'W': 4, 'S': 8}),
                    (256, {'BM': 64, 'BN': 128, 'W': 4, 'S': 6}),
                    (None, {'BM': 128, 'BN': 128, 'W': 8, 'S': 4, 'TREE_PATH': 'serial', 'TREE_REG': 4, 'TREE_LANES': 2})]},
    # bk64 nosplit: ratio vs cuBLAS by M 1: 0.93, 16: 0.95, 64: 0.73, 256: 0.65, 1024: 0.62, 4096: 0.66 (targets met 1/6)
    (4096, 512, torch.bfloat16): {"BK": 64, "SPLIT_STEPS": 1048576, "classes": [
                    (16, {'BM': 16, 'BN': 128, 'W': 4, 'S': 6}),
                    (64, {'BM': 64, 'BN': 128, 'W': 4, 'S': 6, 'TREE_PATH': 'parallel', 'TREE_REG': 2}),
                    (256, {'BM': 64, 'BN': 128, 'W': 4, 'TREE_PROGS': 2, 'S': 4, 'TREE_PATH': 'parallel', 'TREE_REG': 4}),
                    (None, {'BM': 128, 'BN': 128, 'W': 8, 'S': 4, 'TREE_PATH': 'serial', 'TREE_REG': 4, 'TREE_LANES': 2})]},
    # bk64 nosplit: ratio vs cuBLAS by M 1: 0.98, 16: 0.96, 64: 0.94, 256: 0.85, 1024: 0.76, 4096: 0.77 (targets met 2/6)
    (4096, 1792, torch.bfloat16): {"BK": 64, "SPLIT_STEPS": 1048576, "classes": [
                    (16, {'BM': 16, 'BN': 128, 'W': 4, 'S': 6}),
                    (64, {'BM': 64, 'BN': 64, 'W': 4, 'S': 8}),
                    (256, {'BM': 128, 'BN': 128, 'W': 8, 'S': 4, 'TREE_PATH': 'parallel', 'TREE_REG': 4}),
                    (None, {'BM': 128, 'BN': 128, 'W': 8, 'S': 4, 'TREE_PATH': 'serial', 'TREE_REG': 4, 'TREE_LANES': 2})]},
    # bk64 nosplit: ratio vs cuBLAS by M 1: 1.04, 16: 1.02, 64: 0.85, 256: 1.01, 1024: 0.83, 4096: 0.90 (targets met 3/6)
    (4096, 2048, torch.bfloat16): {"BK": 64, "SPLIT_STEPS": 1048576, "classes": [
                    (1, {'BM': 16, 'BN': 128, 'W': 4, 'S': 6}),
                    (16, {'BM': 16, 'BN': 64, 'W': 4, 'S': 8, 'SWAP': True}),
                    (64, {'BM': 64, 'BN': 64, 'W': 4, 'S': 8}),
                    (256, {'BM': 64, 'BN': 128, 'W': 4, 'S': 6, 'TREE_PATH': 'serial', 'TREE_REG': 4, 'TREE_LANES': 2}),
                    (None, {'BM': 128, 'BN': 128, 'W': 8, 'S': 4, 'TREE_PATH': 'serial', 'TREE_REG': 4, 'TREE_LANES': 2})]},
    # bk64 nosplit: ratio vs cuBLAS by M 1: 1.02, 16: 0.99, 64: 0.77, 256: 0.86, 1024: 0.80, 4096: 0.85 (targets met 2/6)
    (4096, 1024, torch.bfloat16): {"BK": 64, "SPLIT_STEPS": 1048576, "classes": [
                    (16, {'BM': 16, 'BN': 128, 'W': 4, 'S': 6}),
                    (64, {'BM': 64, 'BN': 64, 'W': 4, 'S': 8}),
                    (256, {'BM': 64, 'BN': 128, 'W': 4, 'S': 6, 'TREE_PATH': 'serial', 'TREE_REG': 4, 'TREE_LANES': 2}),
                    (None, {'BM': 128, 'BN': 128, 'W': 8, 'S': 4, 'TREE_PATH': 'serial', 'TREE_REG': 4, 'TREE_LANES': 2})]},
    # bk64 nosplit: ratio vs cuBLAS by M 1: 0.99, 16: 1.00, 64: 1.01, 256: 0.98, 1024: 0.91, 4096: 0.89 (targets met 3/6)
    (4096, 7168, torch.bfloat16): {"BK": 64, "SPLIT_STEPS": 1048576, "classes": [
                    (16, {'BM': 16, 'BN': 64, 'W': 4, 'S': 8, 'SWAP': True}),
                    (64, {'BM': 64, 'BN': 64, 'W': 4, 'S': 8}),
                    (256, {'BM': 64, 'BN': 128, 'W': 4, 'S': 6, 'TREE_PATH': 'serial', 'TREE_REG': 4, 'TREE_LANES': 2}),
                    (None, {'BM': 128, 'BN': 128, 'W': 8, 'S': 4, 'TREE_PATH': 'serial', 'TREE_REG': 4, 'TREE_LANES': 2})]},
    # bk64 nosplit: ratio vs cuBLAS by M 1: 0.99, 16: 0.97, 64: 0.97, 256: 0.97, 1024: 0.82, 4096: 0.88 (targets met 3/6)
    (4096, 3584, torch.bfloat16): {"BK": 64, "SPLIT_STEPS": 1048576, "classes": [
                    (1, {'BM': 16, 'BN': 128, 'W': 4, 'S': 6}),
                    (16, {'BM': 16, 'BN': 64, 'W': 4, 'S': 8, 'SWAP': True}),
                    (64, {'BM': 64, 'BN': 64, 'W': 4, 'S': 8}),
                    (256, {'BM': 64, 'BN': 128, 'W': 4, 'S': 6, 'TREE_PATH': 'serial', 'TREE_REG': 4, 'TREE_LANES': 2}),
                    (None, {'BM': 128, 'BN': 128, 'W': 8, 'S': 4, 'TREE_PATH': 'serial', 'TREE_REG': 4, 'TREE_LANES': 2})]},
    # bk64 nosplit: ratio vs cuBLAS by M 1: 0.85, 16: 0.84, 64: 0.82, 256: 0.81, 1024: 0.86, 4096: 1.05 (targets met 1/6)
    (3072, 2048, torch.bfloat16): {"BK": 64, "SPLIT_STEPS": 1048576, "classes": [
                    (16, {'BM': 16, 'BN': 64, 'W': 4, 'S': 8, 'SWAP': True}),
                    (64, {'BM': 64, 'BN': 64, 'W': 4, 'S': 8}),
                    (256, {'BM': 64, 'BN': 128, 'W': 4, 'S': 6}),
                    (None, {'BM': 128, 'BN': 256, 'W': 8, 'S': 3})]},
    # bk64 nosplit: ratio vs cuBLAS by M 1: 0.99, 16: 0.99, 64: 0.98, 256: 0.94, 1024: 1.03, 4096: 0.96 (targets met 5/6)
    (16384, 2048, torch.bfloat16): {"BK": 64, "SPLIT_STEPS": 1048576, "classes": [
                    (16, {'BM': 16, 'BN': 128, 'W': 4, 'S': 6, 'SWAP': True}),
                    (64, {'BM': 64, 'BN': 128, 'W': 4, 'S': 6}),
                    (None, {'BM': 128, 'BN': 256, 'W': 8, 'S': 3})]},
    # bk64 nosplit: ratio vs cuBLAS by M 1: 0.74, 16: 0.75, 64: 0.78, 256: 0.80, 1024: 0.89, 4096: 1.06 (targets met 1/6)
    (2048, 2048, torch.bfloat16): {"BK": 64, "SPLIT_STEPS": 1048576, "classes": [
                    (64, {'BM': 16, 'BN': 64, 'W': 4, 'S': 8, 'SWAP': True}),
                    (256, {'BM': 64, 'BN': 64, 'W': 4, 'S': 8}),
                    (1024, {'BM': 128, 'BN': 128, 'W': 8, 'S': 4}),
                    (None, {'BM': 128, 'BN': 256, 'W': 8, 'S': 3})]},
    # bk64 split4: ratio vs cuBLAS by M 1: 1.03, 16: 1.04, 64: 0.95, 256: 0.69, 1024: 0.98, 4096: 0.82 (targets met 4/6)
    (2048, 8192, torch.bfloat16): {"BK": 64, "SPLIT_STEPS": 32, "classes": [
                    (16, {'BM': 16, 'BN': 64, 'W': 4, 'S': 8, 'SWAP': True, 'PATH': 'parallel'}),
                    (64, {'BM': 32, 'BN': 128, 'W': 4, 'S': 6, 'SWAP': True, 'PATH': 'parallel'}),
                    (None, {'BM': 128, 'BN': 128, 'W': 8, 'S': 4})]},
    # kept: session 21 (A3B): bk64 nosplit: ratio vs cuBLAS by M 1: 0.85, 16: 0.85, 64: 0.82, 256: 0.65, 1024: 0.74, 4096: 1.02 (targets met 1/6)
    (5120, 2048, torch.bfloat16): {"BK": 64, "SPLIT_STEPS": 1048576, "classes": [
                    (16, {'BM': 16, 'BN': 64, 'W': 4, 'S': 8, 'SWAP': True}),
                    (64, {'BM': 64, 'BN': 64, 'W': 4, 'S': 8}),
                    (1024, {'BM': 128, 'BN': 128, 'W': 8, 'S': 4}),
                    (None, {'BM': 128, 'BN': 256, 'W': 8, 'S': 3})]},
    # kept: session 21 (A3B): bk64 nosplit: ratio vs cuBLAS by M 1: 1.11, 16: 1.03, 64: 0.85, 256: 0.56, 1024: 0.69, 4096: 0.59 (targets met 2/6)
    (2048, 512, torch.bfloat16): {"BK": 64, "SPLIT_STEPS": 1048576, "classes": [
                    (16, {'BM': 16, 'BN': 128, 'W': 4, 'S': 6}),
                    (64, {'BM': 64, 'BN': 64, 'W': 4, 'S': 8}),
                    (256, {'BM': 64, 'BN': 128, 'W': 4, 'S': 6, 'TREE_PATH': 'parallel', 'TREE_REG': 4}),
                    (None, {'BM': 128, 'BN': 128, 'W': 8, 'S': 4, 'TREE_PATH': 'serial', 'TREE_REG': 4, 'TREE_LANES': 2})]},
    # kept: session 21 (A3B): bk64 split2: ratio vs cuBLAS by M 1: 0.81, 16: 0.79, 64: 0.81, 256: 0.65, 1024: 0.65, 4096: 0.49 (targets met 0/6)
    (128, 2048, torch.bfloat16): {"BK": 64, "SPLIT_STEPS": 16, "classes": [
                    (64, {'BM': 16, 'BN': 64, 'W': 4, 'S': 8, 'SWAP': True, 'PATH': 'parallel'}),
                    (256, {'BM': 64, 'BN': 64, 'W': 4, 'S': 8}),
                    (1024, {'BM': 64, 'BN': 128, 'W': 4, 'S': 6}),
                    (None, {'BM': 128, 'BN': 128, 'W': 8, 'S': 4})]},
    # kept: bk64 nosplit: ratio vs cuBLAS by M 1: 0.90, 16: 0.79, 64: 0.64, 256: 0.55, 1024: 0.57, 4096: 0.55 (targets met 0/6)
    (2048, 256, torch.bfloat16): {"BK": 64, "SPLIT_STEPS": 1048576, "classes": [
                    (16, {'BM': 16, 'BN': 128, 'W': 4, 'S': 6}),
                    (64, {'BM': 64, 'BN': 64, 'W': 4, 'S': 8}),
                    (256, {'BM': 64, 'BN': 128, 'W': 8, 'S': 2, 'TREE_PATH': 'parallel', 'TREE_REG': 4, 'TREE_LANES': 4}),
                    (None, {'BM': 128, 'BN': 128, 'W': 8, 'S': 4, 'TREE_PATH': 'serial', 'TREE_REG': 4, 'TREE_LANES': 2})]},
    # kept: bk64 nosplit: ratio vs cuBLAS by M 1: 1.08, 16: 1.04, 64: 0.90, 256: 0.77, 1024: 0.76, 4096: 0.75 (targets met 2/6)
    (2048, 1024, torch.bfloat16): {"BK": 64, "SPLIT_STEPS": 1048576, "classes": [
                    (16, {'BM': 16, 'BN': 128, 'W': 4, 'S': 6}),
                    (64, {'BM': 64, 'BN': 64, 'W': 4, 'S': 8}),
                    (256, {'BM': 64, 'BN': 128, 'W': 4, 'S': 6, 'TREE_PATH': 'parallel', 'TREE_REG': 4}),
                    (None, {'BM': 128, 'BN': 128, 'W': 8, 'S': 4, 'TREE_PATH': 'serial', 'TREE_REG': 4, 'TREE_LANES': 2})]},
    # kept: bk64 nosplit: ratio vs cuBLAS by M 1: 0.87, 16: 0.95, 64: 0.80, 256: 1.00, 1024: 0.98, 4096: 0.99 (targets met 4/6)
    (4096, 4096, torch.bfloat16): {"BK": 64, "SPLIT_STEPS": 1048576, "classes": [
                    (16, {'BM': 16, 'BN': 64, 'W': 4, 'S': 8, 'SWAP': True}),
                    (64, {'BM': 64, 'BN': 64, 'W': 4, 'S': 8}),
                    (256, {'BM': 64, 'BN': 128, 'W': 4, 'S': 6}),
                    (None, {'BM': 128, 'BN': 256, 'W': 8, 'S': 3})]},
    # kept: bk64 nosplit: ratio vs cuBLAS by M 1: 0.98, 16: 0.94, 64: 0.94, 256: 0.74, 1024: 0.90, 4096: 1.00 (targets met 3/6)
    (6144, 4096, torch.bfloat16): {"BK": 64, "SPLIT_STEPS": 1048576, "classes": [
                    (16, {'BM': 16, 'BN': 64, 'W': 4, 'S': 8, 'SWAP': True}),
                    (64, {'BM': 64, 'BN': 64, 'W': 4, 'S': 8}),
                    (1024, {'BM': 128, 'BN': 128, 'W': 8, 'S': 4}),
                    (None, {'BM': 128, 'BN': 256, 'W': 8, 'S': 3})]},
    # kept: bk64 nosplit: ratio vs cuBLAS by M 1: 0.90, 16: 0.90, 64: 0.99, 256: 0.98, 1024: 1.02, 4096: 1.02 (targets met 4/6)
    (28672, 4096, torch.bfloat16): {"BK": 64, "SPLIT_STEPS": 1048576, "classes": [
                    (16, {'BM': 16, 'BN': 128, 'W': 4, 'S': 6, 'SWAP': True}),
                    (64, {'BM': 64, 'BN': 128, 'W': 4, 'S': 6}),
                    (None, {'BM': 128, 'BN': 256, 'W': 8, 'S': 3})]},
    # kept: bk64 split2: ratio vs cuBLAS by M 1: 0.97, 16: 1.00, 64: 0.98, 256: 0.97, 1024: 0.96, 4096: 0.92 (targets met 4/6)
    (4096, 14336, torch.bfloat16): {"BK": 64, "SPLIT_STEPS": 112, "classes": [
                    (16, {'BM': 16, 'BN': 64, 'W': 4, 'S': 8, 'SWAP': True, 'PATH': 'parallel'}),
                    (64, {'BM': 32, 'BN': 128, 'W': 4, 'S': 6, 'SWAP': True, 'PATH': 'parallel'}),
                    (256, {'BM': 64, 'BN': 128, 'W': 4, 'S': 6}),
                    (None, {'BM': 128, 'BN': 256, 'W': 8, 'S': 3, 'SPILL': True})]},
}

FP8_TILE_OVERRIDES: dict = {
    # kept: 64x128 w4 s4 p2 sws: ratio vs _scaled_mm by M 256: 0.62, 1024: 0.74, 4096: 0.70
    (4096, 4096): {'BM': 64, 'BN': 128, 'BK': 128, 'W': 4, 'S': 4, 'G': 8, 'P': 2, 'SWS': True},
    # kept: 64x128 w4 s4 p2 sws: ratio vs _scaled_mm by M 256: 0.77, 1024: 0.74, 4096: 0.75
    (6144, 4096): {'BM': 64, 'BN': 128, 'BK': 128, 'W': 4, 'S': 4, 'G': 8, 'P': 2, 'SWS': True},
    # kept: 64x128 w4 s4 p2 sws: ratio vs _scaled_mm by M 256: 0.68, 1024: 0.73, 4096: 0.71
    (28672, 4096): {'BM': 64, 'BN': 128, 'BK': 128, 'W': 4, 'S': 4, 'G': 8, 'P': 2, 'SWS': True},
    # kept: 128x128 w8 s4 p1 sws in the same run: 0.70, 0.70, 0.70)
    (4096, 14336): {'BM': 64, 'BN': 128, 'BK': 128, 'W': 4, 'S': 4, 'G': 8, 'P': 2, 'SWS': True},
}

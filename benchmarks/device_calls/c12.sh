# Call 12 (after call 3; carry .whl): what the row-parallel FP8 tree costs a block-FP8 rollout (session 36 put FP8
# o_proj / down through the S-segment tree so FP8 runs at TP > 1: S FP8 GEMM launches on K slices where one ran) --
# shape b8 (the 8B Llama widths in block-FP8, 8 layers) at S = 8, consistent and stock vLLM in one run, then the
# consistent engine alone at S = 1 (one FP8 GEMM a linear: the launch count before session 36).
source benchmarks/device_calls/engine_tests.sh
engine_call rollout_fp8_s8 280 python benchmarks/bench_rollout_gpu.py --shapes b8 --layers 8 --engines consistent stock \
  --out "$OUT/${TAG}_rollout_fp8_s8.json"
engine_call rollout_fp8_s1 200 python benchmarks/bench_rollout_gpu.py --shapes b8 --layers 8 --engines consistent \
  --row-parallel-segments 1 --out "$OUT/${TAG}_rollout_fp8_s1.json"

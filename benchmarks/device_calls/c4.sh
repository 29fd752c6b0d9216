# Call 4 (after calls 1-3; carry .whl): the bf16 rollout of shape b (8B widths, 8 layers) at S = 2 with session 40's
# table (its S = 2 segments swept: 0.94 / 1.01 of cuBLAS at M = 256, were 0.66 / 0.71) against stock vLLM in ONE run
# (session 39: S = 8 0.925 of stock in one run, S = 2 16 230 gen tok/s in another start).
source benchmarks/device_calls/engine_tests.sh
engine_call rollout_s2 560 python benchmarks/bench_rollout_gpu.py --shapes b --layers 8 --engines consistent stock \
  --row-parallel-segments 2 --out "$OUT/${TAG}_rollout_s2.json"

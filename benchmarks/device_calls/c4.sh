# Call 4 (after calls 1-3; carry .whl): the bf16 rollout of shape b (8B widths, 8 layers) at S = 2 -- the committed
# table, call 1's swept table (a package copy in /tmp/cand) and stock vLLM in ONE run (session 39: S = 8 0.925 of
# stock in one run; S = 2's M = 256 segments 0.72 of the pre-tree GEMM).
source benchmarks/device_calls/engine_tests.sh
engine_call rollout_s2_swept 560 python benchmarks/bench_rollout_gpu.py --shapes b --layers 8 --engines consistent stock \
  --row-parallel-segments 2 --variant "swept:PYTHONPATH=/tmp/cand:/tmp/vsite:/tmp/site" --out "$OUT/${TAG}_rollout_s2_swept.json"

# Call 8 (after call 3; carry .whl): the same rollout (shape b, 8 layers) at S = 2 and S = 1, consistent engines only
# (call 4 has S = 8 and stock): what each per-model tree width costs a whole rollout (docs/parallel.md, "Choosing S").
source benchmarks/device_calls/engine_tests.sh
engine_call rollout_s2 270 python benchmarks/bench_rollout_gpu.py --shapes b --layers 8 --engines consistent \
  --row-parallel-segments 2 --out "$OUT/${TAG}_rollout_s2.json"
engine_call rollout_s1 270 python benchmarks/bench_rollout_gpu.py --shapes b --layers 8 --engines consistent \
  --row-parallel-segments 1 --out "$OUT/${TAG}_rollout_s1.json"

# Call 10 (after call 3; carry .whl): what a model's row-parallel tree width S costs in a rollout (issue #18) -- the
# 8B Llama shape (b, 8 layers) at S = 8 (consistent and stock vLLM, generated tok/s in one run), then the consistent
# engine alone at S = 1 (no tree: what S = 8's tree costs the rollout) on the same machine
# (`consistent_row_parallel_segments` in the random model's config.json).
source benchmarks/device_calls/engine_tests.sh
engine_call rollout_s8 280 python benchmarks/bench_rollout_gpu.py --shapes b --layers 8 --engines consistent stock \
  --out "$OUT/${TAG}_rollout_s8.json"
engine_call rollout_s1 200 python benchmarks/bench_rollout_gpu.py --shapes b --layers 8 --engines consistent \
  --row-parallel-segments 1 --out "$OUT/${TAG}_rollout_s1.json"

# Call 5: carry .whl. The same rollout at S = 8 (the default S; session 40 re-swept its segments, within the spread of
# session 39's) against stock in one run, and the kernels compiled inside timed passes named (pass_new_kernels).
source benchmarks/device_calls/engine_tests.sh
engine_call rollout_s8 560 python benchmarks/bench_rollout_gpu.py --shapes b --layers 8 --engines consistent stock \
  --row-parallel-segments 8 --out "$OUT/${TAG}_rollout_s8.json"

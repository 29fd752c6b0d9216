# Call 6: carry .whl. The hybrid's rollout at 13 layers, consistent and stock (after call 5: its SSD kernels compiled).
source benchmarks/device_calls/engine_tests.sh
engine_call rollout_h13 560 python benchmarks/bench_rollout_gpu.py --shapes h --layers 13 --engines consistent stock \
  --prompts 64 --min-seconds 10 --engine-timeout 300 --out "$OUT/${TAG}_rollout_h13.json"

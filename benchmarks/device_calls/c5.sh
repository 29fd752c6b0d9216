# Call 5: carry .whl. The hybrid's check (shape h, 4 layers) at session 28's SSD defaults (its engine's first start
# compiles the SSD kernels' unrolled trees: 480 s; they stay in Triton's cache for call 6's rollout).
source benchmarks/device_calls/engine_tests.sh
engine_call check_h 560 python benchmarks/check_shapes_gpu.py --shapes h --layers 4 --num-prompts 16 --max-prompt-len 256 \
  --max-tokens 32 --work /tmp/w_h --out "$OUT/${TAG}_check_h.json"

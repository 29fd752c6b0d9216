# Call 4: carry .whl (vLLM from call 3 in /tmp/vsite). The hybrid's check at session 28's SSD defaults (session 31:
# no result within 250 s -- the engine's first start compiles the SSD kernels' unrolled trees -- so 480 s now; the
# compiled kernels stay in Triton's cache for a rollout after it: c5.sh).
TAG=${TAG:-next}
source benchmarks/gpu_setup.sh > "$OUT/${TAG}_setup4.log" 2>&1 || echo "gpu_setup failed"
date +%T
timeout 480 python benchmarks/check_shapes_gpu.py --shapes h --layers 4 --num-prompts 16 --max-prompt-len 256 --max-tokens 32 \
  --work /tmp/w_h --out "$OUT/${TAG}_check_h.json" > "$OUT/${TAG}_check_h.log" 2>&1
echo "check h rc $?"; tail -6 "$OUT/${TAG}_check_h.log"; date +%T

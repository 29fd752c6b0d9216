# Call 4: carry .whl. The hybrid's check and rollout at the SSD defaults of session 28 (vLLM from call 3 in /tmp/vsite).
TAG=${TAG:-next}
source benchmarks/gpu_setup.sh > "$OUT/${TAG}_setup4.log" 2>&1 || echo "gpu_setup failed"
date +%T
timeout 250 python benchmarks/check_shapes_gpu.py --shapes h --layers 4 --num-prompts 16 --max-prompt-len 256 --max-tokens 32 \
  --work /tmp/w_h --out "$OUT/${TAG}_check_h.json" > "$OUT/${TAG}_check_h.log" 2>&1
echo "check h rc $?"; tail -6 "$OUT/${TAG}_check_h.log"; date +%T
timeout 330 python benchmarks/bench_rollout_gpu.py --shapes h --layers 13 --engines consistent stock --prompts 64 \
  --min-seconds 10 --engine-timeout 300 --out "$OUT/${TAG}_rollout_h13.json" > "$OUT/${TAG}_rollout_h13.log" 2>&1
echo "rollout h13 rc $?"; grep -E "^\[h\]|failed|ratio" "$OUT/${TAG}_rollout_h13.log" | cut -c1-300; date +%T

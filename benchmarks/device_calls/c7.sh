# Call 7: carry .whl. The hybrid's rollout at 13 layers, consistent and stock (vLLM from call 3 in /tmp/vsite; the SSD
# kernels compiled by call 4's check, so the timed passes compile nothing -- session 31's did).
TAG=${TAG:-next}
source benchmarks/gpu_setup.sh > "$OUT/${TAG}_setup7.log" 2>&1 || echo "gpu_setup failed"
date +%T
timeout 560 python benchmarks/bench_rollout_gpu.py --shapes h --layers 13 --engines consistent stock --prompts 64 \
  --min-seconds 10 --engine-timeout 300 --out "$OUT/${TAG}_rollout_h13.json" > "$OUT/${TAG}_rollout_h13.log" 2>&1
echo "rollout h13 rc $?"; grep -E "^\[h\]|failed|ratio" "$OUT/${TAG}_rollout_h13.log" | cut -c1-300; date +%T

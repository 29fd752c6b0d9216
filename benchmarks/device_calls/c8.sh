# Call 8 (after call 3's install; carry .whl): the soak on the GPU -- a randomized request stream (arrivals, aborts,
# n in {1, 2}, two temperatures, shared prefixes, a KV cache small enough to preempt) through the compiled engine with
# CUDA graphs, every finished sample recomputed by the trainer on the same GPU; zero mismatched tokens required.
TAG=${TAG:-next}
source benchmarks/gpu_setup.sh > "$OUT/${TAG}_setup8.log" 2>&1 || echo "gpu_setup failed"
date +%T
timeout 420 megatron-consistent soak --device cuda --requests 400 --models tiny-llama,tiny-qwen3moe-top1 \
  --out-dir /tmp/soak --json "$OUT/${TAG}_soak_gpu.json" > "$OUT/${TAG}_soak_gpu.log" 2>&1
echo "soak gpu rc $?"; tail -6 "$OUT/${TAG}_soak_gpu.log"; date +%T

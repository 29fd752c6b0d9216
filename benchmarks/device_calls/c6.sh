# Call 6 (after call 3's install; carry .whl): the GPU engine and lifecycle tests, last run before the Gluon kernels
# became the default on Hopper (session 31) -- the compiled vLLM engine vs the trainer on tiny-llama / the MoE model /
# the hybrid (eager vs CUDA graphs), and the GRPO lifecycle with Megatron's optimizer and a dist_checkpointing restore.
TAG=${TAG:-next}
source benchmarks/gpu_setup.sh > "$OUT/${TAG}_setup6.log" 2>&1 || echo "gpu_setup failed"
date +%T
timeout 500 python -m pytest -q -p no:cacheprovider tests/test_gpu_vllm.py tests/test_gpu_lifecycle.py \
  > "$OUT/${TAG}_engine_lifecycle_tests.log" 2>&1
echo "engine / lifecycle tests rc $?"; tail -3 "$OUT/${TAG}_engine_lifecycle_tests.log"
grep -E "^FAILED" "$OUT/${TAG}_engine_lifecycle_tests.log" | head -8; date +%T

# Call 5: carry .whl. `check` on CUDA (the GPU engine vs the Megatron-Core trainer on the same GPU; each case also runs
# the stock engine: two engines a case) on the two MoE models: Qwen3-MoE (vLLM's V1 runner) and Qwen2-MoE (its V2
# runner, whose kernel warm-up step broke the route recorder until session 39).
source benchmarks/device_calls/engine_tests.sh
engine_call check_tests 560 python -m pytest -q -p no:cacheprovider tests/test_gpu_vllm.py \
  -k "check_zero_mismatch and (qwen3moe or qwen2moe)"

# Call 5: carry .whl. `check` on CUDA (the GPU engine vs the Megatron-Core trainer on the same GPU; each case also runs
# the stock engine: two engines a case) on tiny-llama and the MoE model.
source benchmarks/device_calls/engine_tests.sh
engine_call check_tests 560 python -m pytest -q -p no:cacheprovider tests/test_gpu_vllm.py \
  -k "check_zero_mismatch and (tiny-llama or qwen3moe)"

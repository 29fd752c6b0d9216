# Call 5: carry .whl. On CUDA: `check` of the Qwen2-MoE model (vLLM's V2 runner, whose kernel warm-up step broke the
# route recorder until session 39; its check and the stock engine: two engines), then the block-FP8 GRPO lifecycle
# (`grpo_tiny.py --device cuda --quantization fp8`: bf16 masters in Megatron's optimizer, quantized pushes in place
# into a compiled FP8 engine, save and restore; session 40's RLSession quantization).
source benchmarks/device_calls/engine_tests.sh
engine_call check_qwen2moe 280 python -m pytest -q -p no:cacheprovider tests/test_gpu_vllm.py \
  -k "check_zero_mismatch and qwen2moe"
engine_call grpo_fp8 300 python -m pytest -q -p no:cacheprovider tests/test_gpu_lifecycle.py \
  -k "grpo_tiny_cuda_save_restore and fp8"

# Call 8: carry .whl. The GRPO lifecycle on CUDA (Megatron's distributed optimizer, dist_checkpointing restore), then the
# two other dense models' `check`.
source benchmarks/device_calls/engine_tests.sh
engine_call lifecycle_tests 300 python -m pytest -q -p no:cacheprovider tests/test_gpu_lifecycle.py
engine_call check_dense_tests 260 python -m pytest -q -p no:cacheprovider tests/test_gpu_vllm.py \
  -k "check_zero_mismatch and (mqa or qknorm)"

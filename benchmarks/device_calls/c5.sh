# Call 5: carry .whl. The MoE and hybrid engines eager vs compiled with CUDA graphs (the MoE case with a generator per
# request since session 34), then the dense engine eager / compiled / graphs.  Seven engines.
source benchmarks/device_calls/engine_tests.sh
engine_call engine_modes_tests 560 python -m pytest -q -p no:cacheprovider tests/test_gpu_vllm.py \
  -k "moe_and_hybrid or engine_bits_same"

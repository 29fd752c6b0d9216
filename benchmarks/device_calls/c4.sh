# Call 4 (after call 3; carry .whl): the engine-mode tests again -- the hybrid's eager-vs-graphs test failed in session
# 37 only on a stale log assertion (its bits were equal; it now asserts full decode graphs), the MoE case with a
# generator per request passed -- then the block-FP8 MoE model at Qwen3-30B-A3B widths (d8, 4 layers) through
# `check` on CUDA: session 37 split the FP8 expert path into outputs + combine (TP = 1 too).
source benchmarks/device_calls/engine_tests.sh
engine_call engine_modes_tests 330 python -m pytest -q -p no:cacheprovider tests/test_gpu_vllm.py -k "moe_and_hybrid"
engine_call check_d8 220 python benchmarks/check_shapes_gpu.py --shapes d8 --layers 4 --out "$OUT/${TAG}_check_d8.json"

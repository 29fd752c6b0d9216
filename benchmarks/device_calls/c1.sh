# Call 1 (no vLLM): carry .gw/part1 (with .whl the carry passes 64 MiB). Stashes the bundle's part 1; then what session
# 37 changed on the GPU without running it there: the FP8 MoE expert path split into outputs + combine (TP = 1 too) and
# a tensor-parallel rank's owned FP8 experts (`tests/test_gpu_fp8.py`, whole, and `tests/test_gpu_moe.py`); then issue
# #15's GEMM-by-M figures with today's defaults (`bench_gpu.py --quick`: the last full table is session 7's).
# TAG=s38 bash benchmarks/device_calls/c1.sh   (repo root, on the GPU; $OUT from the device tool; TAG names the outputs)
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part1 /tmp/stash/ && echo part1 stashed
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/${TAG}_gpu.txt" 2>&1; cat "$OUT/${TAG}_gpu.txt"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 240 python -m pytest -q -p no:cacheprovider tests/test_gpu_fp8.py tests/test_gpu_moe.py > "$OUT/${TAG}_fp8_moe_tests.log" 2>&1
echo "fp8 + moe GPU tests rc $?"; tail -2 "$OUT/${TAG}_fp8_moe_tests.log"; grep -E "^FAILED" "$OUT/${TAG}_fp8_moe_tests.log" | head; date +%T
timeout 260 python benchmarks/bench_gpu.py --quick --out "$OUT/${TAG}_bench_gpu" > "$OUT/${TAG}_bench_gpu.log" 2>&1
echo "bench_gpu --quick rc $?"; grep -iE "gemm|ratio|M=" "$OUT/${TAG}_bench_gpu.log" | head -20; date +%T

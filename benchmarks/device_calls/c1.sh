# Call 1 (no vLLM): carry .gw/part1 (with .whl the carry passes 64 MiB). Stashes the bundle's part 1; then the
# row-parallel tree at S = 1, 2 and 8 on every shape and M (issue #18: session 38's one clean S = 8 rollout pass ran at
# about 0.78 of stock, S = 1 at 0.963; the decode sizes M = 16 / 256 were not in session 37's quick set), then the NVFP4 GPU tests (the
# NVFP4 MoE experts of session 38 run the per-expert FP8 path on CUDA, eager).
# TAG=s39 bash benchmarks/device_calls/c1.sh   (repo root, on the GPU; $OUT from the device tool; TAG names the outputs)
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part1 /tmp/stash/ && echo part1 stashed
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/${TAG}_gpu.txt" 2>&1; cat "$OUT/${TAG}_gpu.txt"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 300 python benchmarks/bench_gpu_row_parallel.py --no-variants --segments 1,2,8 --out "$OUT/${TAG}_row_parallel.json" \
  > "$OUT/${TAG}_row_parallel.log" 2>&1
echo "row-parallel tree rc $?"; grep -E "^\| .* \| (1|2|8) \|" "$OUT/${TAG}_row_parallel.log" | cut -c1-160 | head -80; date +%T
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_gpu_fp8.py -k "nvfp4" > "$OUT/${TAG}_nvfp4_tests.log" 2>&1
echo "nvfp4 GPU tests rc $?"; tail -2 "$OUT/${TAG}_nvfp4_tests.log"; grep -E "^FAILED" "$OUT/${TAG}_nvfp4_tests.log" | head; date +%T

# Call 1 (no vLLM): carry .gw/part1 (with .whl the carry passes 64 MiB). Stashes the bundle's part 1; the paged-attention suite (the padding rows written by the Triton kernel's last launch since session 34: one launch
# fewer a call) and the decode timings with the variant without the zeroing; then the row-parallel tree at S = 1, 2, 4
# and 8 K segments (a model's consistent_row_parallel_segments) against the pre-tree GEMM in one run (issue #18's
# figure; call 4 runs the MoE trainer on CUDA).
# TAG=s35 bash benchmarks/device_calls/c1.sh   (repo root, on the GPU; $OUT from the device tool; TAG names the outputs)
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part1 /tmp/stash/ && echo part1 stashed
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/${TAG}_gpu.txt" 2>&1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 240 python -m pytest -q -p no:cacheprovider tests/test_gpu_paged_attention.py > "$OUT/${TAG}_paged_tests.log" 2>&1
echo "paged attention tests rc $?"; tail -2 "$OUT/${TAG}_paged_tests.log"; grep -E "^FAILED" "$OUT/${TAG}_paged_tests.log" | head
timeout 100 python benchmarks/bench_gpu_attention.py --quick --decode-only --out "$OUT/${TAG}_attention_decode.json" \
  > "$OUT/${TAG}_attention_decode.log" 2>&1
echo "attention decode rc $?"; grep -E "^decode|zeroing" "$OUT/${TAG}_attention_decode.log" | cut -c1-220; date +%T
timeout 240 python benchmarks/bench_gpu_row_parallel.py --quick --segments 1,2,4,8 --out "$OUT/${TAG}_row_parallel.json" \
  > "$OUT/${TAG}_row_parallel.log" 2>&1
echo "row parallel rc $?"; grep -E "^S = |^bits|errors" "$OUT/${TAG}_row_parallel.log"; date +%T

# Call 1 (no vLLM): carry .gw/part1 (with .whl the carry passes 64 MiB). Stashes the bundle's part 1; then what session
# 36 changed on the GPU without a GPU to run it: the row-parallel tree at S = 1, 2, 4, 8 against the pre-tree GEMM
# (S = 1 now runs the GEMM itself; the 8B o_proj / down segments at S = 4 / 2 have table entries with one chain a
# segment), the tree's GPU tests (S = 1's bits among them), and the row-parallel FP8 tree's GPU tests (FP8 at TP > 1).
# TAG=s37 bash benchmarks/device_calls/c1.sh   (repo root, on the GPU; $OUT from the device tool; TAG names the outputs)
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part1 /tmp/stash/ && echo part1 stashed
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/${TAG}_gpu.txt" 2>&1; cat "$OUT/${TAG}_gpu.txt"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 200 python benchmarks/bench_gpu_row_parallel.py --quick --segments 1,2,4,8 --out "$OUT/${TAG}_row_parallel.json" \
  > "$OUT/${TAG}_row_parallel.log" 2>&1
echo "row parallel rc $?"; grep -E "^S = |^bits|errors|Error" "$OUT/${TAG}_row_parallel.log" | head -30; date +%T
timeout 120 python -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py \
  -k "segment_tree_batch_invariant or segment_tree_equals_naive_loop and 4096" > "$OUT/${TAG}_tree_tests.log" 2>&1
echo "tree tests rc $?"; tail -2 "$OUT/${TAG}_tree_tests.log"; grep -E "^FAILED" "$OUT/${TAG}_tree_tests.log" | head; date +%T
timeout 100 python -m pytest -q -p no:cacheprovider tests/test_gpu_fp8.py -k "row_parallel" > "$OUT/${TAG}_fp8_tree_tests.log" 2>&1
echo "fp8 tree tests rc $?"; tail -2 "$OUT/${TAG}_fp8_tree_tests.log"; grep -E "^FAILED" "$OUT/${TAG}_fp8_tree_tests.log" | head; date +%T

# Call 1 (no vLLM): carry .gw/part1 (with .whl the carry passes 64 MiB). Stashes the bundle's part 1; then the
# one-launch split decode (MC_ATTN_LAST_MERGES: the last partition program of a tile merges it, session 40, written
# and tested on the CPU in Triton's interpreter only) on the GPU: its tests (bits against the merge launch and the
# in-program path, CUDA-graph capture and replay: the counters reset), then the decode cases of
# bench_gpu_attention.py, the variant among SPLIT_VARIANTS beside the committed two launches and SDPA (issue #15:
# every decode case >= SDPA, 0.87-0.90 at B = 1 / 8 on an H100 in session 33), every variant's bits checked.
# TAG=s41 bash benchmarks/device_calls/c1.sh   (repo root, on the GPU; $OUT from the device tool; TAG names the outputs)
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part1 /tmp/stash/ && echo part1 stashed
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/${TAG}_gpu.txt" 2>&1; cat "$OUT/${TAG}_gpu.txt"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py tests/test_gpu_paged_attention.py \
  -k "last_partition or last_merges" > "$OUT/${TAG}_last_merges_tests.log" 2>&1
echo "last-merges tests rc $?"; tail -2 "$OUT/${TAG}_last_merges_tests.log"; grep -E "^FAILED" "$OUT/${TAG}_last_merges_tests.log" | head
date +%T
timeout 300 python benchmarks/bench_gpu_attention.py --quick --decode-only --out "$OUT/${TAG}_attention_decode.json" \
  > "$OUT/${TAG}_attention_decode.log" 2>&1
echo "decode bench rc $?"; grep -E "^\||last partition|bits" "$OUT/${TAG}_attention_decode.log" | cut -c1-200 | head -40
date +%T

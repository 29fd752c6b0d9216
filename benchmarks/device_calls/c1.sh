# Call 1 (no vLLM): carry .gw/part1 (with .whl the carry passes 64 MiB). Stashes the bundle's part 1; then the GPU
# suites of the kernels changed since their last full GPU run: the paged-attention suite in full (session 46 ran 18 of
# its tests with the merge binaries built ahead, `attention._build_merge_binaries`) and the conv1d suite (session 46
# gave `_causal_conv1d_kernel` unspecialised token counts and a position block of 1 or 16 after its last device call:
# a hybrid rollout had compiled the `n_t_blocks == 1` binary mid-pass). FULL_TABLE=1 adds the thirteen default decode cases of bench_gpu_attention.py (an H200's
# table: sessions 42 / 46 ran H100s), CASES=B:CTX,... those cases.
# TAG=s47 bash benchmarks/device_calls/c1.sh   (repo root, on the GPU; $OUT from the device tool; TAG names the outputs)
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part1 /tmp/stash/ && echo part1 stashed
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/${TAG}_gpu.txt" 2>&1; cat "$OUT/${TAG}_gpu.txt"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 330 python -m pytest -q -p no:cacheprovider tests/test_gpu_paged_attention.py tests/test_gpu_conv1d.py \
  > "$OUT/${TAG}_paged_conv_tests.log" 2>&1
echo "paged attention and conv1d suites rc $?"; tail -2 "$OUT/${TAG}_paged_conv_tests.log"
grep -E "^FAILED" "$OUT/${TAG}_paged_conv_tests.log" | head
date +%T
if [ "${FULL_TABLE:-0}" = 1 ] || [ -n "${CASES:-}" ]; then
  timeout 270 python benchmarks/bench_gpu_attention.py --decode-only --out "$OUT/${TAG}_attention_decode.json" \
    ${CASES:+--decode-cases $CASES} > "$OUT/${TAG}_attention_decode.log" 2>&1
  echo "decode bench rc $?"; grep -E "^decode" "$OUT/${TAG}_attention_decode.log" | cut -c1-170
  date +%T
fi

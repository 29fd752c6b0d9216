# Call 1 (no vLLM): carry .gw/part1 (with .whl the carry passes 64 MiB). Stashes the bundle's part 1; then the split
# path's early-exit tests (session 45: partition programs past the batch's longest row return after one load,
# `MC_ATTN_EMPTY_EXIT`, on for these tests; bits against the in-program path on a NaN workspace, the broken variant
# caught, CUDA-graph replay); then
# eleven decode cases of bench_gpu_attention.py (B = 1-64 at 2k-32k; both paths timed, every split variant's time and
# bits -- the early exit among them; issue #15: every decode case >= SDPA).
# TAG=s45 bash benchmarks/device_calls/c1.sh   (repo root, on the GPU; $OUT from the device tool; TAG names the outputs)
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part1 /tmp/stash/ && echo part1 stashed
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/${TAG}_gpu.txt" 2>&1; cat "$OUT/${TAG}_gpu.txt"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
MC_ATTN_EMPTY_EXIT=1 timeout 150 python -m pytest -q -p no:cacheprovider tests/test_gpu_paged_attention.py \
  -k "past_the_longest or one_rows_length or only_written or cuda_graph" > "$OUT/${TAG}_early_exit_tests.log" 2>&1
echo "early-exit tests rc $?"; tail -2 "$OUT/${TAG}_early_exit_tests.log"
date +%T
# ten of the thirteen default decode cases and B = 16 at 2k (where the early exit can matter: contexts well under the
# 32k bound); FULL_TABLE=1: every default case; CASES=B:CTX,...: those
CASES=${CASES:-1:4096,1:32768,4:4096,4:8192,4:32768,16:2048,16:4096,16:8192,16:32768,8:16384,64:4096}
timeout 300 python benchmarks/bench_gpu_attention.py --decode-only --out "$OUT/${TAG}_attention_decode.json" \
  $([ "${FULL_TABLE:-0}" = 1 ] || echo --decode-cases $CASES) > "$OUT/${TAG}_attention_decode.log" 2>&1
echo "decode bench rc $?"; grep -E "^decode|exit early" "$OUT/${TAG}_attention_decode.log" | cut -c1-200 | head -40
date +%T

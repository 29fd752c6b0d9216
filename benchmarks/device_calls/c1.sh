# Call 1 (no vLLM): carry .gw/part1 (with .whl the carry passes 64 MiB). Stashes the bundle's part 1; then the
# attention tests of the kernel suites (the paged-attention suite whole, the attention tests of test_gpu_kernels.py):
# the first run since session 41 removed the one-launch split decode (MC_ATTN_LAST_MERGES, measured slower) and
# stopped specialising the padding-row kernel's counts.  The whole kernel suites (issue #18 asks them on an H200 with
# the Gluon default; they take two calls' time) are solo.sh's.
# TAG=s42 bash benchmarks/device_calls/c1.sh   (repo root, on the GPU; $OUT from the device tool; TAG names the outputs)
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part1 /tmp/stash/ && echo part1 stashed
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/${TAG}_gpu.txt" 2>&1; cat "$OUT/${TAG}_gpu.txt"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 420 python -m pytest -q -p no:cacheprovider tests/test_gpu_paged_attention.py tests/test_gpu_kernels.py \
  -k "attention or attn or paged or split or decode or merge" > "$OUT/${TAG}_attention_tests.log" 2>&1
echo "attention tests rc $?"; tail -2 "$OUT/${TAG}_attention_tests.log"; grep -E "^FAILED" "$OUT/${TAG}_attention_tests.log" | head
date +%T

# Call 2: carry .gw/part2. Stashes the bundle's part 2; then the attention tests of the kernel suites (the
# paged-attention suite whole, the attention tests of test_gpu_kernels.py): session 42 ran them on an H100 after the
# split path came to write and read only valid workspace rows (42 + 31 passed over three calls); here they run in one
# call, on whichever card comes.
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part2 /tmp/stash/ && echo part2 stashed && ls /tmp/stash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 480 python -m pytest -q -p no:cacheprovider tests/test_gpu_paged_attention.py tests/test_gpu_kernels.py \
  -k "attention or attn or paged or split or decode or merge" > "$OUT/${TAG}_attention_tests.log" 2>&1
echo "attention tests rc $?"; tail -2 "$OUT/${TAG}_attention_tests.log"; grep -E "^FAILED" "$OUT/${TAG}_attention_tests.log" | head
date +%T

# Call 2: carry .gw/part2. Stashes the bundle's part 2; then the kernel suites' other half on the current kernels:
# the tests of test_gpu_kernels.py that are not attention (GEMM, M-class and tree tables, norms, log-softmax, MoE, SSD)
# and the block-FP8 and attention-backward suites -- session 42 ran the attention half (42 + 31 passed on an H100)
# after its last kernel change, so the two halves together are every kernel suite on this code.  KERNEL_TESTS=0: the
# stash only (little device time left: the vLLM calls next).
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part2 /tmp/stash/ && echo part2 stashed && ls /tmp/stash
[ "${KERNEL_TESTS:-1}" = 0 ] && exit 0
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 300 python -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py \
  -k "not (attention or attn or paged or split or decode or merge)" > "$OUT/${TAG}_kernel_tests.log" 2>&1
echo "kernel tests (not attention) rc $?"; tail -2 "$OUT/${TAG}_kernel_tests.log"; date +%T
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_gpu_fp8.py tests/test_gpu_attention_bwd.py \
  >> "$OUT/${TAG}_kernel_tests.log" 2>&1
echo "block-FP8 and attention-backward tests rc $?"; tail -2 "$OUT/${TAG}_kernel_tests.log"; grep -E "^FAILED" "$OUT/${TAG}_kernel_tests.log" | head
date +%T

# Call 1 (no vLLM): carry .gw/part1 .whl. Stashes the bundle's part 1, installs Megatron-Core 0.19.2 into /tmp/site;
# the paged-attention suite (the padding rows written by the Triton kernel's last launch since session 34: one launch
# fewer a call) and the decode timings with the variant without the zeroing; then the MoE trainer on CUDA: Megatron's
# MoELayer with both dispatchers == ConsistentMoELayer (session 34's rewritten experts passed on an H100, 4 in 47 s)
# and the trainer's gradients / row-alone tests (tests/test_gpu_megatron.py).
# TAG=s35 bash benchmarks/device_calls/c1.sh   (repo root, on the GPU; $OUT from the device tool; TAG names the outputs)
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part1 /tmp/stash/ && echo part1 stashed
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/${TAG}_gpu.txt" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
date +%T
timeout 240 python -m pytest -q -p no:cacheprovider tests/test_gpu_paged_attention.py > "$OUT/${TAG}_paged_tests.log" 2>&1
echo "paged attention tests rc $?"; tail -2 "$OUT/${TAG}_paged_tests.log"; grep -E "^FAILED" "$OUT/${TAG}_paged_tests.log" | head
timeout 100 python benchmarks/bench_gpu_attention.py --quick --decode-only --out "$OUT/${TAG}_attention_decode.json" \
  > "$OUT/${TAG}_attention_decode.log" 2>&1
echo "attention decode rc $?"; grep -E "^decode|zeroing" "$OUT/${TAG}_attention_decode.log" | cut -c1-220; date +%T
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_gpu_moe_dispatch.py tests/test_gpu_megatron.py \
  > "$OUT/${TAG}_trainer_tests.log" 2>&1
echo "trainer tests rc $?"; tail -2 "$OUT/${TAG}_trainer_tests.log"; grep -E "^FAILED" "$OUT/${TAG}_trainer_tests.log" | head; date +%T

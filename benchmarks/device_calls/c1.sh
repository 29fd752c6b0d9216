# Call 1 (no vLLM): carry .gw/part1 (with .whl the carry passes 64 MiB). Stashes the bundle's part 1; then every decode
# case of bench_gpu_attention.py (B = 1-64 at 4k-32k, B = 8 at 16k; both paths timed, the split variants' bits
# checked): the first full table with session 42's path rule (split below 1 program per SM) and valid-rows workspace,
# on whichever card comes (session 42's table is an H100's; issue #15: every decode case >= SDPA).
# TAG=s43 bash benchmarks/device_calls/c1.sh   (repo root, on the GPU; $OUT from the device tool; TAG names the outputs)
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part1 /tmp/stash/ && echo part1 stashed
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/${TAG}_gpu.txt" 2>&1; cat "$OUT/${TAG}_gpu.txt"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 300 python benchmarks/bench_gpu_attention.py --decode-only --out "$OUT/${TAG}_attention_decode.json" \
  > "$OUT/${TAG}_attention_decode.log" 2>&1
echo "decode bench rc $?"; grep -E "^decode" "$OUT/${TAG}_attention_decode.log" | cut -c1-200 | head -20
date +%T

# Call 1 (no vLLM): carry .gw/part1 (with .whl the carry passes 64 MiB). Stashes the bundle's part 1; then every decode
# case of bench_gpu_attention.py (B = 1-64 at 4k-32k, B = 8 at 16k; both paths timed, the split variants' bits
# checked) on an H200 only (session 42's table, the same kernels, is an H100's; issue #15: every decode case >= SDPA);
# then B = 40-112 at
# 2k / 4k / 16k, both paths timed: session 42's guess that the in-program path loses at B = 64 (4k+) to a short last wave
# (about 3 programs per SM fit: 396 on 132 SMs) predicts split faster where the last wave holds under 132 programs
# (B = 56-64, 104-112) and in-program faster elsewhere -- a rule on it needs these cases first.
# TAG=s43 bash benchmarks/device_calls/c1.sh   (repo root, on the GPU; $OUT from the device tool; TAG names the outputs)
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part1 /tmp/stash/ && echo part1 stashed
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/${TAG}_gpu.txt" 2>&1; cat "$OUT/${TAG}_gpu.txt"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
if grep -q H200 "$OUT/${TAG}_gpu.txt"; then  # session 42's full table is an H100's (the same kernels): an H200's only
  timeout 300 python benchmarks/bench_gpu_attention.py --decode-only --out "$OUT/${TAG}_attention_decode.json" \
    > "$OUT/${TAG}_attention_decode.log" 2>&1
  echo "decode bench rc $?"; grep -E "^decode" "$OUT/${TAG}_attention_decode.log" | cut -c1-200 | head -20
fi
date +%T
CASES=$(for c in 2048 4096 16384; do for b in 40 48 56 64 80 96 104 112; do printf "%s:%s," $b $c; done; done)
timeout 240 python benchmarks/bench_gpu_attention.py --decode-only --out "$OUT/${TAG}_attention_decode_waves.json" \
  --decode-cases "$CASES" \
  > "$OUT/${TAG}_attention_decode_waves.log" 2>&1
echo "wave cases rc $?"; grep -E "^decode" "$OUT/${TAG}_attention_decode_waves.log" | cut -c1-200
date +%T

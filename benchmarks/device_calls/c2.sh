# Call 2: carry .gw/part2. Stashes the bundle's part 2; then the decode cases of bench_gpu_attention.py (the split
# variants beside the committed two launches and SDPA; issue #15: every decode case >= SDPA -- session 41 on an H100:
# 0.95 / 0.95 / 0.89 at B = 1 4k / B = 1 32k / B = 8 16k; the path rule: at B = 64 32k the split path 3.16 ms against
# the in-program 3.45).
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part2 /tmp/stash/ && echo part2 stashed && ls /tmp/stash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 300 python benchmarks/bench_gpu_attention.py --quick --decode-only --out "$OUT/${TAG}_attention_decode.json" \
  > "$OUT/${TAG}_attention_decode.log" 2>&1
echo "decode bench rc $?"; grep -E "^decode|^prefill" "$OUT/${TAG}_attention_decode.log" | cut -c1-200 | head -20
date +%T

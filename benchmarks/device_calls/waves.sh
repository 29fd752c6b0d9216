# If time is left (no vLLM, nothing carried): B = 40-112 at 2k / 4k / 16k, both paths timed: session 42's guess that the
# in-program path loses at B = 64 (4k+) to a short last wave (about 3 programs per SM fit: 396 on 132 SMs) predicts
# split faster where the last wave holds under 132 programs (B = 56-64, 104-112) and in-program faster elsewhere -- a
# rule on it needs these cases first.
TAG=${TAG:-next}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
CASES=$(for c in 2048 4096 16384; do for b in 40 48 56 64 80 96 104 112; do printf "%s:%s," $b $c; done; done)
timeout 240 python benchmarks/bench_gpu_attention.py --decode-only --out "$OUT/${TAG}_attention_decode_waves.json" \
  --decode-cases "${CASES%,}" > "$OUT/${TAG}_attention_decode_waves.log" 2>&1
echo "wave cases rc $?"; grep -E "^decode" "$OUT/${TAG}_attention_decode_waves.log" | cut -c1-200
date +%T

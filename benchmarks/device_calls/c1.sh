# Call 1 (no vLLM): carry .gw/part1 (with .whl the carry passes 64 MiB). Stashes the bundle's part 1; then the decode
# cases of bench_gpu_attention.py twice: with the committed tiles and with the in-program decode tile at 4 warps /
# 4 stages (`MC_ATTN_TILES=16:0:4:4`; session 45, H100: B = 64 0.98 -> 1.19-1.21x SDPA at 4k / 16k, B = 128 +7 %,
# B = 32 +4 %, B = 56 / 80 -1-2 %; launch shape only, bits checked by the paged suite with it: 27 passed). Default
# cases: B = 32-128 at 4k and 16k (the in-program path); FULL_TABLE=1: the thirteen default cases of the benchmark
# (an H200's table: session 42's is an H100's), CASES=B:CTX,...: those.
# TAG=s46 bash benchmarks/device_calls/c1.sh   (repo root, on the GPU; $OUT from the device tool; TAG names the outputs)
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part1 /tmp/stash/ && echo part1 stashed
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/${TAG}_gpu.txt" 2>&1; cat "$OUT/${TAG}_gpu.txt"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
CASES=${CASES:-32:4096,48:4096,56:4096,64:4096,80:4096,128:4096,32:16384,64:16384,128:16384}
for tiles in "" "16:0:4:4"; do
  date +%T
  name=${TAG}_attention_decode${tiles:+_tiles44}
  MC_ATTN_TILES=$tiles timeout 270 python benchmarks/bench_gpu_attention.py --decode-only --out "$OUT/$name.json" \
    $([ "${FULL_TABLE:-0}" = 1 ] || echo --decode-cases $CASES) > "$OUT/$name.log" 2>&1
  echo "decode bench, tiles [${tiles:-committed}] rc $?"; grep -E "^decode" "$OUT/$name.log" | cut -c1-170
done
date +%T

# Call 1 (no vLLM): carry .gw/part1. Stashes the bundle's part 1, then issue #18's figure with the Gluon default:
# the row-parallel tree as the model runs it against the pre-tree GEMM and cuBLAS (`default/gemm`), bits checked.
# bash benchmarks/device_calls/c1.sh   (repo root, on the GPU; $OUT from the device tool; TAG names the outputs)
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part1 /tmp/stash/ && echo part1 stashed
source benchmarks/device_calls/row_parallel.sh
# issue #15's decode cases: the split path without its padding rows' zeroing launch among the variants (session 33's
# B = 1 gap to SDPA, 2-3 us, is about one graph node; the dependent merge launch did not close it)
timeout 100 python benchmarks/bench_gpu_attention.py --quick --decode-only --out "$OUT/${TAG}_attention_decode.json" \
  > "$OUT/${TAG}_attention_decode.log" 2>&1
echo "attention decode rc $?"; grep -E "^decode|zeroing" "$OUT/${TAG}_attention_decode.log" | cut -c1-220; date +%T

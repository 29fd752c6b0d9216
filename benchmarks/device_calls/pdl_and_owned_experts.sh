# Sourced by c6.sh and solo.sh (repo root, on the GPU; $OUT and TAG set): session 32's kernel work -- the split
# decode's merge as a dependent launch (MC_ATTN_PDL: its bits tests, then bench_gpu_attention.py's decode cases with
# the PDL row among the split variants, bits against the default) and a TP rank's experts (others' pairs as expert
# -1: bench_gpu_moe.py --owned-tp 2, bits checked; its stock column needs vLLM).
timeout 60 python -m pytest -q -p no:cacheprovider tests/test_gpu_paged_attention.py -k "dependent or cuda_graph" \
  > "$OUT/${TAG}_pdl_tests.log" 2>&1
echo "pdl tests rc $?"; tail -2 "$OUT/${TAG}_pdl_tests.log"
timeout 100 python benchmarks/bench_gpu_attention.py --quick --decode-only --out "$OUT/${TAG}_attention_pdl.json" \
  > "$OUT/${TAG}_attention_pdl.log" 2>&1
echo "attention decode rc $?"; grep -E "^decode|PDL" "$OUT/${TAG}_attention_pdl.log" | cut -c1-220; date +%T
timeout 60 python benchmarks/bench_gpu_moe.py --owned-tp 2 --tokens 16 256 4096 --out "$OUT/${TAG}_moe_owned.json" \
  > "$OUT/${TAG}_moe_owned.log" 2>&1
echo "moe owned rc $?"; tail -6 "$OUT/${TAG}_moe_owned.log"; date +%T

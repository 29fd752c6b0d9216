# Call 6 (after call 3's install; carry .whl): `diagnose` on the GPU -- tests/test_gpu_diagnose.py (a fault named
# exactly and replayed on the GPU; an MoE model's every op equal) -- then a TP rank's experts (others' pairs as expert
# -1, session 32) timed and bit-checked on the GPU, then the diagnose command itself with a fault, for its table.
TAG=${TAG:-next}
source benchmarks/gpu_setup.sh > "$OUT/${TAG}_setup6.log" 2>&1 || echo "gpu_setup failed"
date +%T
timeout 240 python -m pytest -q -p no:cacheprovider -s tests/test_gpu_diagnose.py > "$OUT/${TAG}_diagnose_tests.log" 2>&1
echo "diagnose gpu tests rc $?"; grep -E "FIRST DIVERGENCE|no divergence|passed|failed|Error" "$OUT/${TAG}_diagnose_tests.log" | tail -8
date +%T
timeout 100 python benchmarks/bench_gpu_moe.py --owned-tp 2 --tokens 16 256 4096 --out "$OUT/${TAG}_moe_owned.json" \
  > "$OUT/${TAG}_moe_owned.log" 2>&1
echo "moe owned rc $?"; tail -6 "$OUT/${TAG}_moe_owned.log"; date +%T
timeout 120 megatron-consistent diagnose --device cuda --prompt 5,17,99,4,250,31,8,77,12,64,3,210 --response 9,41,6 \
  --inject-fault layer1.o_proj --out-dir /tmp/diag_cli --json "$OUT/${TAG}_diagnose_cli.json" \
  > "$OUT/${TAG}_diagnose_cli.log" 2>&1
echo "diagnose cli rc $? (1 = a divergence found, as injected)"; grep -E "FIRST DIVERGENCE|replay" "$OUT/${TAG}_diagnose_cli.log" | head -4; date +%T

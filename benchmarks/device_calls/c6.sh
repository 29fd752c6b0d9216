# Call 6 (after call 3's install; carry .whl): `diagnose` on the GPU -- tests/test_gpu_diagnose.py (a fault named
# exactly and replayed on the GPU; an MoE model's every op equal), then the command itself on tiny-llama with the
# fault, for its table.
TAG=${TAG:-next}
source benchmarks/gpu_setup.sh > "$OUT/${TAG}_setup6.log" 2>&1 || echo "gpu_setup failed"
date +%T
timeout 300 python -m pytest -q -p no:cacheprovider -s tests/test_gpu_diagnose.py > "$OUT/${TAG}_diagnose_tests.log" 2>&1
echo "diagnose gpu tests rc $?"; grep -E "FIRST DIVERGENCE|no divergence|passed|failed|Error" "$OUT/${TAG}_diagnose_tests.log" | tail -8
date +%T
timeout 150 megatron-consistent diagnose --device cuda --prompt 5,17,99,4,250,31,8,77,12,64,3,210 --response 9,41,6 \
  --inject-fault layer1.o_proj --out-dir /tmp/diag_cli --json "$OUT/${TAG}_diagnose_cli.json" \
  > "$OUT/${TAG}_diagnose_cli.log" 2>&1
echo "diagnose cli rc $? (1 = a divergence found, as injected)"; grep -E "FIRST DIVERGENCE|layer1.o_proj|replay" "$OUT/${TAG}_diagnose_cli.log" | head -4; date +%T

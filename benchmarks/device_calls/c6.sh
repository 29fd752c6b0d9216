# Call 6 (after call 3's install; carry .whl), session 32's new work on the GPU:
# 1. `diagnose` on the GPU -- tests/test_gpu_diagnose.py (a fault named exactly and replayed on the GPU; an MoE
#    model's every op equal; -s prints each report's table into the log);
# 2. the split decode's merge as a programmatic dependent launch (MC_ATTN_PDL): its bits tests, then the decode
#    cases of bench_gpu_attention.py --quick (the PDL row among the split variants, bits against the default);
# 3. a TP rank's experts (others' pairs as expert -1): bench_gpu_moe.py --owned-tp 2, bits checked;
# 4. the hybrid's diagnose (tiny-nemotronh, a fault in its MLP layer), for what is left of the call.
TAG=${TAG:-next}
source benchmarks/gpu_setup.sh > "$OUT/${TAG}_setup6.log" 2>&1 || echo "gpu_setup failed"
date +%T
timeout 200 python -m pytest -q -p no:cacheprovider -s tests/test_gpu_diagnose.py -k "not hybrid" \
  > "$OUT/${TAG}_diagnose_tests.log" 2>&1
echo "diagnose gpu tests rc $?"; grep -E "FIRST DIVERGENCE|no divergence|passed|failed|Error" "$OUT/${TAG}_diagnose_tests.log" | tail -8
date +%T
source benchmarks/device_calls/pdl_and_owned_experts.sh
# last, as long as the call lasts: the hybrid's diagnose (its engine's first start compiles the SSD kernels)
python -m pytest -q -p no:cacheprovider -s tests/test_gpu_diagnose.py -k hybrid > "$OUT/${TAG}_diagnose_hybrid.log" 2>&1
echo "diagnose hybrid rc $?"; grep -E "FIRST DIVERGENCE|passed|failed" "$OUT/${TAG}_diagnose_hybrid.log" | tail -3; date +%T

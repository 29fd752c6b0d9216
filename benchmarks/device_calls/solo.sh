# One call, no vLLM (a session with little device time or no machine for a second call): the kernel suites with the
# Gluon default (call 1's, without stashing the bundle), the dependent merge launch's bits tests and decode timings,
# and a TP rank's experts (the stock fused-MoE column is skipped without vLLM; the rank's rows are measured).
# carry: nothing.  TAG=s32 bash benchmarks/device_calls/solo.sh
TAG=${TAG:-next}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/${TAG}_gpu.txt" 2>&1
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/${TAG}_gpu.txt" 2>&1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 280 python -m pytest -q -p no:cacheprovider tests/test_gpu_paged_attention.py tests/test_gpu_kernels.py \
  tests/test_gpu_fp8.py tests/test_gpu_attention_bwd.py > "$OUT/${TAG}_kernel_suites.log" 2>&1
echo "kernel suites with the Gluon default rc $?"; tail -3 "$OUT/${TAG}_kernel_suites.log"; grep -E "^FAILED" "$OUT/${TAG}_kernel_suites.log" | head -8; date +%T
timeout 60 python -m pytest -q -p no:cacheprovider tests/test_gpu_paged_attention.py -k "dependent or cuda_graph" \
  > "$OUT/${TAG}_pdl_tests.log" 2>&1
echo "pdl tests rc $?"; tail -2 "$OUT/${TAG}_pdl_tests.log"
timeout 100 python benchmarks/bench_gpu_attention.py --quick --decode-only --out "$OUT/${TAG}_attention_pdl.json" \
  > "$OUT/${TAG}_attention_pdl.log" 2>&1
echo "attention decode rc $?"; grep -E "^decode|PDL" "$OUT/${TAG}_attention_pdl.log" | cut -c1-220; date +%T
timeout 60 python benchmarks/bench_gpu_moe.py --owned-tp 2 --tokens 16 256 4096 --out "$OUT/${TAG}_moe_owned.json" \
  > "$OUT/${TAG}_moe_owned.log" 2>&1
echo "moe owned rc $?"; tail -6 "$OUT/${TAG}_moe_owned.log"; date +%T

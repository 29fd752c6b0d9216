# Call 5 (last, if device time is left): carry .whl (vLLM from call 3 in /tmp/vsite). The SSD timings: every schedule
# of the chunk terms (the runtime loop's leaves a step beside the unrolled tree) and the outputs, bits against the
# first row, and vLLM's own prefill scan beside this package's in the same run.
TAG=${TAG:-next}
source benchmarks/gpu_setup.sh > "$OUT/${TAG}_setup5.log" 2>&1 || echo "gpu_setup failed"
date +%T
timeout 400 python benchmarks/bench_gpu_ssd.py --out "$OUT/${TAG}_ssd_bench.json" > "$OUT/${TAG}_ssd_bench.log" 2>&1
echo "ssd bench rc $?"; tail -40 "$OUT/${TAG}_ssd_bench.log"; date +%T

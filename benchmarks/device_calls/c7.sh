# Call 7 (if device time is left): carry .whl. The SSD timings: every schedule of the chunk terms (the runtime loop's
# leaves a step beside the unrolled tree) and the outputs, bits against the first row, vLLM's prefill scan beside.
source benchmarks/device_calls/engine_tests.sh
engine_call ssd_bench 400 python benchmarks/bench_gpu_ssd.py --out "$OUT/${TAG}_ssd_bench.json"

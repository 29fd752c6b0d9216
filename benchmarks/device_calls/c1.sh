# Call 1 (no vLLM): carry .gw/part1. Stashes the bundle's part 1, then the SSD timings and the Gluon FP8 edges.
# bash benchmarks/device_calls/c1.sh   (repo root, on the H200; $OUT from the device tool; TAG names the outputs)
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part1 /tmp/stash/ && echo part1 stashed
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/${TAG}_gpu.txt" 2>&1
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/${TAG}_gpu.txt" 2>&1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 150 python -m pytest -q tests/test_gpu_gluon_candidates.py -k "fp8 and 5120" > "$OUT/${TAG}_gluon_fp8_a3b.log" 2>&1
echo "gluon fp8 A3B qkv rc $?"; tail -2 "$OUT/${TAG}_gluon_fp8_a3b.log"; date +%T
timeout 400 python benchmarks/bench_gpu_ssd.py --out "$OUT/${TAG}_ssd_bench.json" > "$OUT/${TAG}_ssd_bench.log" 2>&1
echo "ssd bench rc $?"; tail -30 "$OUT/${TAG}_ssd_bench.log"; date +%T

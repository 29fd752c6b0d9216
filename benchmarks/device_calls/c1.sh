# Call 1 (no vLLM): carry .gw/part1. Stashes the bundle's part 1, then two edges (the Gluon FP8 GEMM at three uneven
# splits; KV pages past 32-bit element offsets, committed and Gluon kernels). The SSD timings run last (c6.sh).
# bash benchmarks/device_calls/c1.sh   (repo root, on the H200; $OUT from the device tool; TAG names the outputs)
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part1 /tmp/stash/ && echo part1 stashed
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/${TAG}_gpu.txt" 2>&1
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/${TAG}_gpu.txt" 2>&1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 200 python -m pytest -q tests/test_gpu_gluon_candidates.py tests/test_gpu_paged_attention.py \
  -k "(fp8 and 5120) or 32_bit" > "$OUT/${TAG}_edges.log" 2>&1
echo "edges (Gluon FP8 at A3B's qkv, pages past 32-bit offsets) rc $?"; tail -2 "$OUT/${TAG}_edges.log"; date +%T

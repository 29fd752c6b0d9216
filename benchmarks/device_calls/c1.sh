# Call 1 (no vLLM): carry .gw/part1. Stashes the bundle's part 1, then the kernel suites that the Gluon default (session
# 31) routes through the Gluon kernels at their sizes -- GEMM / tree / attention, block-FP8, paged attention (with
# the 32-bit pages test mended in session 31), the attention backward -- never run in full with them on.
# bash benchmarks/device_calls/c1.sh   (repo root, on the GPU; $OUT from the device tool; TAG names the outputs)
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part1 /tmp/stash/ && echo part1 stashed
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/${TAG}_gpu.txt" 2>&1
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/${TAG}_gpu.txt" 2>&1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 360 python -m pytest -q -p no:cacheprovider tests/test_gpu_paged_attention.py tests/test_gpu_kernels.py \
  tests/test_gpu_fp8.py tests/test_gpu_attention_bwd.py > "$OUT/${TAG}_kernel_suites.log" 2>&1
echo "kernel suites with the Gluon default rc $?"; tail -4 "$OUT/${TAG}_kernel_suites.log"; date +%T

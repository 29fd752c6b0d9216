# Sourced by solo.sh (repo root, on the GPU; $OUT, TAG and SUITES_TIMEOUT set): the GPU's name and versions,
# then the kernel suites with the Gluon kernels on by default (session 31) -- GEMM / tree / attention, block-FP8, paged
# attention (the 32-bit pages test mended in session 31), the attention backward.
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/${TAG}_gpu.txt" 2>&1
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/${TAG}_gpu.txt" 2>&1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
date +%T
timeout "$SUITES_TIMEOUT" python -m pytest -q -p no:cacheprovider tests/test_gpu_paged_attention.py tests/test_gpu_kernels.py \
  tests/test_gpu_fp8.py tests/test_gpu_attention_bwd.py > "$OUT/${TAG}_kernel_suites.log" 2>&1
echo "kernel suites with the Gluon default rc $?"; tail -3 "$OUT/${TAG}_kernel_suites.log"
grep -E "^FAILED" "$OUT/${TAG}_kernel_suites.log" | head -8; date +%T

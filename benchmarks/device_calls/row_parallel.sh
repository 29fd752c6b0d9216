# Sourced by c1.sh and solo.sh (repo root, on the GPU; $OUT and TAG set): the GPU's name and versions, then
# bench_gpu_row_parallel.py --quick (the row-parallel tree with the Gluon default vs the pre-tree GEMM and cuBLAS).
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/${TAG}_gpu.txt" 2>&1
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/${TAG}_gpu.txt" 2>&1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
date +%T
timeout 150 python benchmarks/bench_gpu_row_parallel.py --quick --out "$OUT/${TAG}_row_parallel.json" > "$OUT/${TAG}_row_parallel.log" 2>&1
echo "row parallel rc $?"; tail -14 "$OUT/${TAG}_row_parallel.log"; date +%T

# Call 1 (no vLLM): carry .gw/part1 (with .whl the carry passes 64 MiB). Stashes the bundle's part 1; then sweeps the
# GEMM table for the shapes session 39 found without a swept entry (issue #18: the 8B o_proj / down trees at S = 2 and
# 4, 0.72-0.74 of the pre-tree GEMM at M = 256; issue #15 / rollout a: the 1B model's four plain GEMMs, 0.40-0.90 of
# cuBLAS), last the S = 8 trees again (swept on an H200 in sessions 8-13; their M = 256 cell, a decode step of 256
# sequences, is the rollout's costliest: 0.71 of the pre-tree GEMM on an H100) -- skipped if the budget runs out; every
# candidate's bits checked in the same run; the written table is stashed for calls 2 and 4 (adopt entry by entry).
# TAG=s40 bash benchmarks/device_calls/c1.sh   (repo root, on the GPU; $OUT from the device tool; TAG names the outputs)
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part1 /tmp/stash/ && echo part1 stashed
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/${TAG}_gpu.txt" 2>&1; cat "$OUT/${TAG}_gpu.txt"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
SHAPES="8B o_proj tree S2,8B o_proj tree S4,8B down tree S2,8B down tree S4,1B qkv 2048->3072,1B gate/up 2048->16384,1B o_proj 2048x2048,1B down 8192->2048,8B o_proj tree,8B down tree"
timeout 400 python benchmarks/sweep_gpu_gemm.py --no-fp8 --shapes "$SHAPES" --budget 330 --out "$OUT/${TAG}_sweep.json" \
  --tables-out "$OUT/${TAG}_gemm_tables.py" > "$OUT/${TAG}_sweep.log" 2>&1
echo "sweep rc $?"; grep -iE "ratio vs cuBLAS|targets met|error|Traceback" "$OUT/${TAG}_sweep.log" | cut -c1-200 | tail -30
cp "$OUT/${TAG}_gemm_tables.py" /tmp/stash/gemm_tables_swept.py && echo "swept table stashed"
# the package with the swept table, for call 4's rollout variant (PYTHONPATH=/tmp/cand:...)
rm -rf /tmp/cand && mkdir -p /tmp/cand && cp -r megatron_consistent /tmp/cand/ \
  && cp /tmp/stash/gemm_tables_swept.py /tmp/cand/megatron_consistent/kernels/triton/gemm_tables.py && echo "/tmp/cand ready"
date +%T

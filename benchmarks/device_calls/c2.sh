# Call 2: carry .gw/part2. Stashes the bundle's part 2; sweeps the GEMM table for the shapes left unswept by session
# 40 (the 1B down tree at S = 2, segment 2048 x 4096: 0.46-0.64 of cuBLAS; Qwen3-30B-A3B's qkv, o_proj tree and router,
# never swept), every candidate's bits checked in the run; then, with the written table in this call's tree, the
# table's GPU tests and the row-parallel tree at S = 1, 2 (what the new entries buy). The table is stashed for call 4
# (/tmp/cand: a package copy with it). Adopt entry by entry (README).
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part2 /tmp/stash/ && echo part2 stashed && ls /tmp/stash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
SHAPES="1B down tree S2,A3B qkv 2048->5120,A3B o_proj tree,A3B router 2048->128"
timeout 300 python benchmarks/sweep_gpu_gemm.py --no-fp8 --shapes "$SHAPES" --budget 240 --out "$OUT/${TAG}_sweep.json" \
  --tables-out "$OUT/${TAG}_gemm_tables.py" > "$OUT/${TAG}_sweep.log" 2>&1
echo "sweep rc $?"; grep -iE "targets met|error|Traceback" "$OUT/${TAG}_sweep.log" | cut -c1-200 | tail -12
cp "$OUT/${TAG}_gemm_tables.py" /tmp/stash/gemm_tables_swept.py && echo "swept table stashed" || exit 1
rm -rf /tmp/cand && mkdir -p /tmp/cand && cp -r megatron_consistent /tmp/cand/ \
  && cp /tmp/stash/gemm_tables_swept.py /tmp/cand/megatron_consistent/kernels/triton/gemm_tables.py && echo "/tmp/cand ready"
cp /tmp/stash/gemm_tables_swept.py megatron_consistent/kernels/triton/gemm_tables.py && echo "swept table installed"
date +%T
timeout 150 python -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py -k "m_class_table or segment_tree" \
  > "$OUT/${TAG}_table_tests.log" 2>&1
echo "table tests rc $?"; tail -2 "$OUT/${TAG}_table_tests.log"; grep -E "^FAILED" "$OUT/${TAG}_table_tests.log" | head; date +%T
timeout 120 python benchmarks/bench_gpu_row_parallel.py --no-variants --segments 1,2 --out "$OUT/${TAG}_row_parallel.json" \
  > "$OUT/${TAG}_row_parallel.log" 2>&1
echo "row-parallel tree rc $?"; grep -E "^\| 1B .* \| (1|2) \|" "$OUT/${TAG}_row_parallel.log" | cut -c1-160 | head -30; date +%T

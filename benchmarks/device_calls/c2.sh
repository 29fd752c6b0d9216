# Call 2: carry .gw/part2. Stashes the bundle's part 2; sweeps the GEMM table for the shapes left unswept by session
# 40: the 1B trees at S = 2 (down: segment 2048 x 4096, no entry, 0.46-0.64 of cuBLAS; o_proj: segment 2048 x 1024,
# the S = 8 down's entry, 0.63-0.76 at M <= 256), every candidate's bits checked in the run; then, with the written table in this call's tree, the
# table's GPU tests and the row-parallel tree at S = 1, 2, 8 (what the new entries buy; 2048 x 1024 also serves the
# 1B down at S = 8). The table is stashed for call 4
# (/tmp/cand: a package copy with it). Adopt entry by entry (README).
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part2 /tmp/stash/ && echo part2 stashed && ls /tmp/stash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
SHAPES="1B down tree S2,1B o_proj tree S2"
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
timeout 200 python benchmarks/bench_gpu_row_parallel.py --no-variants --segments 1,2,8 --out "$OUT/${TAG}_row_parallel.json" \
  > "$OUT/${TAG}_row_parallel.log" 2>&1
echo "row-parallel tree rc $?"; grep -E "^\| 1B .* \| (1|2|8) \|" "$OUT/${TAG}_row_parallel.log" | cut -c1-160 | head -40; date +%T

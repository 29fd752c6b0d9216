# Call 2: carry .gw/part2. Stashes the bundle's part 2; then, with call 1's swept table in this call's tree, the
# table's GPU tests (every entry bit-identical across M classes; the trees' TP splits equal to TP = 1) and the
# row-parallel tree at S = 1, 2, 4, 8 on every shape and M (what the swept entries buy against session 39's table).
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part2 /tmp/stash/ && echo part2 stashed && ls /tmp/stash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
cp /tmp/stash/gemm_tables_swept.py megatron_consistent/kernels/triton/gemm_tables.py && echo "swept table installed" || exit 1
date +%T
timeout 240 python -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py -k "m_class_table or segment_tree" \
  > "$OUT/${TAG}_table_tests.log" 2>&1
echo "table tests rc $?"; tail -2 "$OUT/${TAG}_table_tests.log"; grep -E "^FAILED" "$OUT/${TAG}_table_tests.log" | head; date +%T
timeout 300 python benchmarks/bench_gpu_row_parallel.py --no-variants --segments 1,2,4,8 --out "$OUT/${TAG}_row_parallel.json" \
  > "$OUT/${TAG}_row_parallel.log" 2>&1
echo "row-parallel tree rc $?"; grep -E "^\| .* \| (1|2|4|8) \|" "$OUT/${TAG}_row_parallel.log" | cut -c1-160 | head -100; date +%T

# Call 4 (after calls 1-3; carry .whl): the bf16 rollout of shape b (8B widths, 8 layers) at S = 8 against stock in
# ONE run, with a third engine whose path rule splits the decode at B = 64 too (MC_ATTN_SPLIT_PER_SM=8: the split path
# measured faster there in every kernel benchmark since session 12 -- 3.16 vs 3.45 ms at 32k on an H100 in session 41
# -- and never in a rollout). Session 41: S = 8 0.902 of stock, consistent passes 5.5-8.2 s for the same tokens.
source benchmarks/device_calls/engine_tests.sh
engine_call rollout_split8 580 python benchmarks/bench_rollout_gpu.py --shapes b --layers 8 --engines consistent stock \
  --variant split8:MC_ATTN_SPLIT_PER_SM=8 --out "$OUT/${TAG}_rollout_split8.json"

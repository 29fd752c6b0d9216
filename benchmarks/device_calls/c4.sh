# Call 4 (after calls 1-3; carry .whl): the bf16 rollout of shape b (8B widths, 8 layers) at S = 8 against stock in
# ONE run, with a third engine on session 42's path rule at 2 programs per SM (MC_ATTN_SPLIT_PER_SM=2: B = 17-32 decode
# split, the kernel benchmark had them in-program faster; no rollout has measured the rule). Session 46: consistent 0.879
# of stock (its first timed pass compiled a merge binary: since built ahead, so every pass should count now), the
# in-program tile at 4 / 4 0.784 (kept at 2 / 2).
source benchmarks/device_calls/engine_tests.sh
engine_call rollout_split2 580 python benchmarks/bench_rollout_gpu.py --shapes b --layers 8 --engines consistent stock \
  --variant split2:MC_ATTN_SPLIT_PER_SM=2 --out "$OUT/${TAG}_rollout_split2.json"

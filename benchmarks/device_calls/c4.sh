# Call 4 (after calls 1-3; carry .whl): the bf16 rollout of shape b (8B widths, 8 layers) at S = 8 against stock in
# ONE run, with a third engine on session 41's path rule (MC_ATTN_SPLIT_PER_SM=2: decode batches of 17-32 sequences
# split; session 42 made it 1 from the kernel benchmark -- B = 32 in-program 1.02-1.45x faster at 1k-32k on an H100 --
# and a rollout has not measured it). Session 41: S = 8 0.902 of stock, consistent passes 5.5-8.2 s for the same tokens.
source benchmarks/device_calls/engine_tests.sh
engine_call rollout_rule2 580 python benchmarks/bench_rollout_gpu.py --shapes b --layers 8 --engines consistent stock \
  --variant rule2:MC_ATTN_SPLIT_PER_SM=2 --out "$OUT/${TAG}_rollout_rule2.json"

# Call 4 (after calls 1-3; carry .whl): the bf16 rollout of shape b (8B widths, 8 layers) at S = 8 against stock in
# ONE run, with a third engine on the in-program decode tile at 4 warps / 4 stages (MC_ATTN_TILES=16:0:4:4). Session 45's
# kernel benchmark (H100): B = 64 decode 0.98 -> 1.19-1.21x SDPA, B = 128 +7 %, B = 32 +4 %, B = 56 / 80 -1-2 %; session
# 9's rollout fell (0.897 -> 0.697) with 4 / 4 among five changes, never isolated: this run decides the default
# (shape b decodes up to 256 sequences, in-program). Session 41: S = 8 0.902 of stock, consistent passes 5.5-8.2 s.
# Session 41's path rule (MC_ATTN_SPLIT_PER_SM=2) as a variant is the next question after this one.
source benchmarks/device_calls/engine_tests.sh
engine_call rollout_tiles44 580 python benchmarks/bench_rollout_gpu.py --shapes b --layers 8 --engines consistent stock \
  --variant tiles44:MC_ATTN_TILES=16:0:4:4 --out "$OUT/${TAG}_rollout_tiles44.json"

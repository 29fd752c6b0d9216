# Call 4 (after call 3; carry .whl): the NVFP4 MoE model (session 38, CPU-verified; on CUDA the per-expert FP8 path,
# an eager engine) through `check` on CUDA, then the bf16 tree's rollout cost at S = 8 against stock vLLM in ONE run
# (session 38 ran them in two engine starts: S = 8 about 0.78 of stock, S = 1 0.963); the timed passes now leave out a
# pass that compiled kernels.
source benchmarks/device_calls/engine_tests.sh
engine_call check_nvfp4_moe 200 megatron-consistent check --device cuda --block-size 16 \
  --hf-config megatron_consistent/configs/models/tiny-qwen2moe-top8-shared --quantization nvfp4 --mode consistent \
  --num-prompts 16 --max-tokens 32 --json "$OUT/${TAG}_check_nvfp4_moe.json"
engine_call rollout_s8 380 python benchmarks/bench_rollout_gpu.py --shapes b --layers 8 --engines consistent stock \
  --out "$OUT/${TAG}_rollout_s8.json"

# Issue #19's calls on two GPUs (kind nvidia-h200-x2 or nvidia-h100-x2), docs/parallel.md "Two GPUs": one call a step,
# back to back within 30 s, each from the repo root: `TAG=s35 bash benchmarks/device_calls/x2.sh STEP`.
#   1  carry .gw/part1        stash part 1 (with .whl the carry passes 64 MiB)
#   2  carry .gw/part2        stash part 2
#   3  carry .gw/part3 .gw/install.sh .whl   install vLLM 0.26 and Megatron-Core 0.19.2; check, dense, trainer TP 2 /
#                             engine TP 2
#   4  carry .whl             the NCCL trainer tests (tests/test_gpu_parallel.py: TP / PP / SP layouts, the experts
#                             over EP 2)
#   5  carry .whl             check: MoE at (2, 2); engine TP 2 against the one-GPU trainer, dense and MoE; the hybrid
#                             (tiny-nemotronh) at (2, 2) and (1, 2)
#   6  carry .whl             rollout at engine TP 2, consistent vs stock (1B and 8B Llama widths), then the 8B and
#                             Qwen3-30B-A3B widths' check at (2, 2)
#   7  carry .whl             check: the trainer's experts over EP 2 (DP 2; TP 2 + SP) against engine TP 2
#   8  carry .whl             check in block-FP8 at trainer / engine TP (2, 2): dense (tiny-llama-fp8tp) and MoE
#                             (tiny-qwen2moe-fp8tp, whole experts a rank); then the trainer's context parallelism
#                             (CP 2 over NCCL, dense and MoE) against the one-GPU engine
# NVLink multicast stays off (gpu_setup.sh exports NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# NVSHMEM_DISABLE_NVLS=1; the NCCL ranks of the trainer set them too).
TAG=${TAG:-next}
STEP=${1:?step 1-8}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/stash
case "$STEP" in
1)
  cp -r .gw/part1 /tmp/stash/ && echo part1 stashed
  nvidia-smi -L > "$OUT/${TAG}_x2_gpus.txt" 2>&1; cat "$OUT/${TAG}_x2_gpus.txt" ;;
2)
  cp -r .gw/part2 /tmp/stash/ && echo part2 stashed && ls /tmp/stash ;;
3)
  cp -r .gw/part3 /tmp/stash/ && cp .gw/install.sh /tmp/stash/
  SITE=/tmp/vsite bash /tmp/stash/install.sh > "$OUT/${TAG}_x2_install.log" 2>&1; echo "install rc $?"
  source benchmarks/gpu_setup.sh >> "$OUT/${TAG}_x2_install.log" 2>&1 || echo "gpu_setup failed"
  timeout 420 megatron-consistent check --device cuda --mode consistent --trainer-tp 2 --engine-tp 2 --block-size 16 \
    --num-prompts 64 --max-tokens 64 --out-dir /tmp/x2/llama-t2-e2 > "$OUT/${TAG}_x2_llama_t2_e2.log" 2>&1
  echo "dense (2, 2) rc $?"; tail -4 "$OUT/${TAG}_x2_llama_t2_e2.log" ;;
4)
  source benchmarks/gpu_setup.sh > /dev/null 2>&1 || echo "gpu_setup failed"
  timeout 500 python -m pytest -q -s -rs tests/test_gpu_parallel.py > "$OUT/${TAG}_x2_nccl_tests.log" 2>&1
  echo "NCCL trainer tests rc $?"; tail -3 "$OUT/${TAG}_x2_nccl_tests.log" ;;
5)
  source benchmarks/gpu_setup.sh > /dev/null 2>&1 || echo "gpu_setup failed"
  for run in "moe-t2-e2 2 tiny-qwen3moe-top1" "llama-t1-e2 1 tiny-llama" "moe-t1-e2 1 tiny-qwen3moe-top1" \
             "hybrid-t2-e2 2 tiny-nemotronh" "hybrid-t1-e2 1 tiny-nemotronh"; do
    set -- $run
    timeout 110 megatron-consistent check --device cuda --mode consistent --trainer-tp "$2" --engine-tp 2 --block-size 16 \
      --num-prompts 64 --max-tokens 64 --hf-config "megatron_consistent/configs/models/$3" --out-dir "/tmp/x2/$1" "${@:4}" \
      > "$OUT/${TAG}_x2_$1.log" 2>&1
    echo "$1 rc $?"; tail -3 "$OUT/${TAG}_x2_$1.log"
  done ;;
6)
  source benchmarks/gpu_setup.sh > /dev/null 2>&1 || echo "gpu_setup failed"
  timeout 330 python benchmarks/bench_rollout_gpu.py --shapes a b --engines consistent stock --tensor-parallel-size 2 \
    --out "$OUT/${TAG}_x2_rollout_tp2.json" > "$OUT/${TAG}_x2_rollout_tp2.log" 2>&1
  echo "rollout TP 2 rc $?"; grep -E "^\[(a|b)\]|ratio|failed" "$OUT/${TAG}_x2_rollout_tp2.log" | cut -c1-300
  timeout 250 python benchmarks/check_shapes_gpu.py --shapes b d --layers 4 --engine-tp 2 --trainer-tp 2 \
    --out "$OUT/${TAG}_x2_check_shapes.json" > "$OUT/${TAG}_x2_check_shapes.log" 2>&1
  echo "check shapes (2, 2) rc $?"; tail -6 "$OUT/${TAG}_x2_check_shapes.log" ;;
7)
  # the trainer's experts over EP 2: two NCCL replicas (DP 2, their batches differ), then the TP group with sequence
  # parallelism (each rank its chunk); all_to_all_single on NCCL
  source benchmarks/gpu_setup.sh > /dev/null 2>&1 || echo "gpu_setup failed"
  for run in "moe-dp2ep2-e2 1 --trainer-dp 2 --trainer-ep 2" "moe-t2sp-ep2-e2 2 --trainer-sp --trainer-ep 2"; do
    set -- $run
    timeout 250 megatron-consistent check --device cuda --mode consistent --trainer-tp "$2" --engine-tp 2 --block-size 16 \
      --num-prompts 64 --max-tokens 64 --hf-config megatron_consistent/configs/models/tiny-qwen2moe-top8-shared \
      --out-dir "/tmp/x2/$1" "${@:3}" > "$OUT/${TAG}_x2_$1.log" 2>&1
    echo "$1 rc $?"; tail -3 "$OUT/${TAG}_x2_$1.log"
  done ;;
8)
  source benchmarks/gpu_setup.sh > /dev/null 2>&1 || echo "gpu_setup failed"
  for run in "fp8-t2-e2 tiny-llama-fp8tp --quantization fp8 --trainer-tp 2 --engine-tp 2" \
             "fp8moe-t2-e2 tiny-qwen2moe-fp8tp --quantization fp8 --trainer-tp 2 --engine-tp 2" \
             "cp2 tiny-llama --trainer-cp 2" "moe-cp2 tiny-qwen3moe-top1 --trainer-cp 2"; do
    set -- $run
    timeout 130 megatron-consistent check --device cuda --mode consistent --block-size 16 --num-prompts 64 \
      --max-tokens 64 --hf-config "megatron_consistent/configs/models/$2" --out-dir "/tmp/x2/$1" "${@:3}" \
      > "$OUT/${TAG}_x2_$1.log" 2>&1
    echo "$1 rc $?"; tail -3 "$OUT/${TAG}_x2_$1.log"
  done ;;
*) echo "step $STEP: expected 1-8"; exit 2 ;;
esac

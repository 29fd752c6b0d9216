# Call 5: carry .whl. Where call 3's d8 check was zero with MC_GLUON=1: the Gluon kernels in a rollout at b8; else the
# hybrid's profile (what its 0.58 of stock is spent on).
TAG=${TAG:-next}
source benchmarks/gpu_setup.sh > "$OUT/${TAG}_setup5.log" 2>&1 || echo "gpu_setup failed"
date +%T
if python -c "import json,sys; d=json.load(open('/tmp/stash/check_d8_gluon.json')); sys.exit(0 if all(s.get('zero_mismatch') for s in d['shapes']) else 1)"; then
  echo "d8 zero with MC_GLUON=1: the Gluon rollout at b8"
  timeout 420 python benchmarks/bench_rollout_gpu.py --shapes b8 --layers 8 --engines consistent --variant gluon:MC_GLUON=1 \
    --prompts 64 --min-seconds 10 --engine-timeout 300 --out "$OUT/${TAG}_rollout_b8_gluon.json" > "$OUT/${TAG}_rollout_b8_gluon.log" 2>&1
  echo "rollout b8 gluon rc $?"; grep -E "^\[b8\]|failed|ratio" "$OUT/${TAG}_rollout_b8_gluon.log" | cut -c1-300
else
  echo "d8 not zero with MC_GLUON=1 (or no report): the hybrid's profile instead"
  timeout 420 python benchmarks/bench_rollout_gpu.py --shapes h --layers 13 --engines consistent --prompts 64 --min-seconds 5 \
    --engine-timeout 300 --profile --profile-prompts 16 --profile-tokens 32 --out "$OUT/${TAG}_rollout_h13_profile.json" \
    > "$OUT/${TAG}_rollout_h13_profile.log" 2>&1
  echo "profile rc $?"; tail -5 "$OUT/${TAG}_rollout_h13_profile.log" | cut -c1-300
fi
date +%T

# Call 3: carry .gw/part3 .gw/install.sh .whl. Installs vLLM 0.26 from the three parts, then the mixer's CUDA tests
# (vLLM's Mamba-2 mixer beside ours), and the MC_GLUON=1 check at d8 ALONE on the GPU (session 28's ran beside another
# engine's start and failed: vLLM's memory profiling asserts that no other process changes its GPU memory meanwhile).
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part3 /tmp/stash/ && cp .gw/install.sh /tmp/stash/ && date +%T
SITE=/tmp/vsite bash /tmp/stash/install.sh > "$OUT/${TAG}_install.log" 2>&1; echo "install rc $?"; tail -2 "$OUT/${TAG}_install.log"
source benchmarks/gpu_setup.sh >> "$OUT/${TAG}_install.log" 2>&1 || echo "gpu_setup failed"
date +%T
timeout 120 python -m pytest -q tests/test_vllm_hybrid.py -k cuda > "$OUT/${TAG}_mixer_tests.log" 2>&1
echo "mixer tests rc $?"; tail -2 "$OUT/${TAG}_mixer_tests.log"; date +%T
MC_GLUON=1 timeout 290 python benchmarks/check_shapes_gpu.py --shapes d8 --layers 4 --num-prompts 16 --max-prompt-len 256 \
  --max-tokens 32 --work /tmp/w_d8 --out "$OUT/${TAG}_check_d8_gluon.json" > "$OUT/${TAG}_check_d8_gluon.log" 2>&1
echo "check d8 gluon rc $?"; tail -8 "$OUT/${TAG}_check_d8_gluon.log"; cp "$OUT/${TAG}_check_d8_gluon.json" /tmp/stash/check_d8_gluon.json 2>/dev/null
date +%T

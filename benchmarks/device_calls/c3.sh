# Call 3: carry .gw/part3 .gw/install.sh .whl. Installs vLLM 0.26 from the three parts, then the hybrid's check at the
# SSD defaults of session 28 (session 31: no result within 250 s -- the engine's first start compiles the SSD
# kernels' unrolled trees -- so 480 s now; the compiled kernels stay in Triton's cache for call 4).
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part3 /tmp/stash/ && cp .gw/install.sh /tmp/stash/ && date +%T
SITE=/tmp/vsite bash /tmp/stash/install.sh > "$OUT/${TAG}_install.log" 2>&1; echo "install rc $?"; tail -2 "$OUT/${TAG}_install.log"
source benchmarks/gpu_setup.sh >> "$OUT/${TAG}_install.log" 2>&1 || echo "gpu_setup failed"
date +%T
timeout 480 python benchmarks/check_shapes_gpu.py --shapes h --layers 4 --num-prompts 16 --max-prompt-len 256 --max-tokens 32 \
  --work /tmp/w_h --out "$OUT/${TAG}_check_h.json" > "$OUT/${TAG}_check_h.log" 2>&1
echo "check h rc $?"; tail -6 "$OUT/${TAG}_check_h.log"; date +%T

# Call 3: carry .gw/part3 .gw/install.sh .whl. Installs vLLM 0.26 from the three parts into /tmp/vsite (what calls 4-10
# need) and this package (benchmarks/gpu_setup.sh), then one GRPO test (below).
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part3 /tmp/stash/ && cp .gw/install.sh /tmp/stash/ && date +%T
SITE=/tmp/vsite bash /tmp/stash/install.sh > "$OUT/${TAG}_install.log" 2>&1; echo "install rc $?"; tail -2 "$OUT/${TAG}_install.log"
source benchmarks/gpu_setup.sh >> "$OUT/${TAG}_install.log" 2>&1 || echo "gpu_setup failed"
python -c "import vllm, megatron.core; print('vllm', vllm.__version__, 'megatron-core', megatron.core.__version__)"
date +%T
# then the NVFP4 GRPO lifecycle on CUDA (session 40 ran the block-FP8 one: passed): quantized pushes in place into a
# compiled NVFP4 engine, save and restore
timeout 300 python -m pytest -q -p no:cacheprovider tests/test_gpu_lifecycle.py -k "grpo_tiny_cuda_save_restore and nvfp4" \
  > "$OUT/${TAG}_grpo_nvfp4.log" 2>&1
echo "grpo nvfp4 rc $?"; tail -2 "$OUT/${TAG}_grpo_nvfp4.log"; date +%T

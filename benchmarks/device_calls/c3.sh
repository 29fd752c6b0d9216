# Call 3: carry .gw/part3 .gw/install.sh .whl. Installs vLLM 0.26 from the three parts into /tmp/vsite (what calls
# 4-7 need) and this package (benchmarks/gpu_setup.sh); then bench_gpu_attention.py --quick with vLLM's FA3 beside
# (prefill against FA3, issue #15's 0.90: 0.67-0.80 with the Gluon kernels in session 25).
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part3 /tmp/stash/ && cp .gw/install.sh /tmp/stash/ && date +%T
SITE=/tmp/vsite bash /tmp/stash/install.sh > "$OUT/${TAG}_install.log" 2>&1; echo "install rc $?"; tail -2 "$OUT/${TAG}_install.log"
source benchmarks/gpu_setup.sh >> "$OUT/${TAG}_install.log" 2>&1 || echo "gpu_setup failed"
python -c "import vllm, megatron.core; print('vllm', vllm.__version__, 'megatron-core', megatron.core.__version__)"
date +%T
timeout 300 python benchmarks/bench_gpu_attention.py --quick --out "$OUT/${TAG}_attention.json" > "$OUT/${TAG}_attention.log" 2>&1
echo "attention bench rc $?"; grep -E "^decode|^prefill" "$OUT/${TAG}_attention.log" | cut -c1-200 | head -20; date +%T

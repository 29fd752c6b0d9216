# Call 3: carry .gw/part3 .gw/install.sh .whl. Installs vLLM 0.26 from the three parts into /tmp/vsite (what calls
# 4-7 need) and this package (benchmarks/gpu_setup.sh); then bench_gpu_attention.py --gluon: prefill only (T = 4k /
# 16k; GQA 32/8, MHA, D 64; dense and paged), every Gluon schedule against the committed kernel (bits, time), SDPA and
# vLLM's FA3 (issue #15's 0.90: 0.67-0.80 in session 25; 107 s there).
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part3 /tmp/stash/ && cp .gw/install.sh /tmp/stash/ && date +%T
SITE=/tmp/vsite bash /tmp/stash/install.sh > "$OUT/${TAG}_install.log" 2>&1; echo "install rc $?"; tail -2 "$OUT/${TAG}_install.log"
source benchmarks/gpu_setup.sh >> "$OUT/${TAG}_install.log" 2>&1 || echo "gpu_setup failed"
python -c "import vllm, megatron.core; print('vllm', vllm.__version__, 'megatron-core', megatron.core.__version__)"
date +%T
timeout 300 python benchmarks/bench_gpu_attention.py --gluon --out "$OUT/${TAG}_attention_prefill.json" \
  > "$OUT/${TAG}_attention_prefill.log" 2>&1
echo "prefill bench rc $?"; grep -E "prefill" "$OUT/${TAG}_attention_prefill.log" | cut -c1-220 | head -30; date +%T

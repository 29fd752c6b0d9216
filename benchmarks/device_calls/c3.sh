# Call 3: carry .gw/part3 .gw/install.sh .whl. Installs vLLM 0.26 from the three parts into /tmp/vsite (what calls 4-10
# need) and this package (benchmarks/gpu_setup.sh); nothing else, so a session short of device time reaches call 4.
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part3 /tmp/stash/ && cp .gw/install.sh /tmp/stash/ && date +%T
SITE=/tmp/vsite bash /tmp/stash/install.sh > "$OUT/${TAG}_install.log" 2>&1; echo "install rc $?"; tail -2 "$OUT/${TAG}_install.log"
source benchmarks/gpu_setup.sh >> "$OUT/${TAG}_install.log" 2>&1 || echo "gpu_setup failed"
python -c "import vllm, megatron.core; print('vllm', vllm.__version__, 'megatron-core', megatron.core.__version__)"
date +%T

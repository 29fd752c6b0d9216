# Source on the H200 (device tool) from the repo root, after the vLLM 0.26 bundle was installed into /tmp/vsite
# (../shared/gpu-vllm/README.md); carry `.whl` (megatron-core 0.19.2, omegaconf 2.3.0, antlr4-python3-runtime 4.9.3).
# Installs this package editable (its vLLM plugin is found through the `vllm.general_plugins` entry point) and sets
# the environment every GPU run here uses.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
export PYTHONPATH=/tmp/vsite:/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# the bundle's vLLM lacks DeepGEMM's JIT headers (third_party/deep_gemm/include): its block-FP8 engine failed to start
# with DeepGEMM on (session 19); vLLM's CUTLASS / Triton block-FP8 kernels run instead
export VLLM_USE_DEEP_GEMM=0 VLLM_MOE_USE_DEEP_GEMM=0

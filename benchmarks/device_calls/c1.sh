# Call 1 (no vLLM): carry .gw/part1. Stashes the bundle's part 1, then issue #18's figure with the Gluon default:
# the row-parallel tree as the model runs it against the pre-tree GEMM and cuBLAS (`default/gemm`), bits checked.
# bash benchmarks/device_calls/c1.sh   (repo root, on the GPU; $OUT from the device tool; TAG names the outputs)
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part1 /tmp/stash/ && echo part1 stashed
source benchmarks/device_calls/row_parallel.sh

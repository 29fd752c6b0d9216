# Call 1 (no vLLM): carry .gw/part1. Stashes the bundle's part 1, then the kernel suites with the Gluon default
# (kernel_suites.sh), never run in full with them on.
# bash benchmarks/device_calls/c1.sh   (repo root, on the GPU; $OUT from the device tool; TAG names the outputs)
TAG=${TAG:-next}
mkdir -p /tmp/stash && cp -r .gw/part1 /tmp/stash/ && echo part1 stashed
SUITES_TIMEOUT=360 source benchmarks/device_calls/kernel_suites.sh

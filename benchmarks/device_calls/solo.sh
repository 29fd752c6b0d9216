# One call, no vLLM (a session with little device time or no machine for a second call): the kernel suites with the
# Gluon default (call 1's, without stashing the bundle), then session 32's kernel work (pdl_and_owned_experts.sh).
# carry: nothing.  TAG=s32 bash benchmarks/device_calls/solo.sh
TAG=${TAG:-next}
SUITES_TIMEOUT=280 source benchmarks/device_calls/kernel_suites.sh
source benchmarks/device_calls/pdl_and_owned_experts.sh

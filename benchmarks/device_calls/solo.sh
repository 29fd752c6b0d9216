# One call, nothing carried, no vLLM (a session with little device time): the kernel suites with the Gluon default
# (all passed in session 33 on an H100; an H200 has not run them with the Gluon default).
# TAG=s35 bash benchmarks/device_calls/solo.sh
TAG=${TAG:-next}
SUITES_TIMEOUT=540 source benchmarks/device_calls/kernel_suites.sh

# One call, no vLLM (a session with little device time or no machine for a second call): issue #18's row-parallel
# figure (row_parallel.sh), then the kernel suites with the Gluon default once more for what is left of the call
# (all passed in session 33 on an H100; an H200 has not run them with the Gluon default).
# carry: nothing.  TAG=s34 bash benchmarks/device_calls/solo.sh
TAG=${TAG:-next}
source benchmarks/device_calls/row_parallel.sh
SUITES_TIMEOUT=400 source benchmarks/device_calls/kernel_suites.sh

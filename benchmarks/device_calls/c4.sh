# Call 4: carry .whl. The MoE trainer on CUDA: Megatron's MoELayer with both dispatchers == ConsistentMoELayer (session
# 34's rewritten experts passed on an H100, 4 in 47 s) and the trainer's gradients / row-alone tests
# (tests/test_gpu_megatron.py); then session 34's MoE eager-vs-graphs failure (request 12's first sampled token): the probe -- the same
# engines sampled from the global generator, with a generator per request (the test since), and greedy; numerics
# (log-probs differ) or the sampler's draw (tokens differ, log-probs equal).  Session 35: the global generator only
# (two engines; call 5's test samples with a generator per request).
source benchmarks/device_calls/engine_tests.sh
engine_call trainer_tests 200 python -m pytest -q -p no:cacheprovider tests/test_gpu_moe_dispatch.py tests/test_gpu_megatron.py
engine_call probe_moe_graphs 300 python benchmarks/device_calls/probe_moe_graphs.py "global generator"

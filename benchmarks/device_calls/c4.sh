# Call 4: carry .whl. Session 34's MoE eager-vs-graphs failure (request 12's first sampled token): the probe -- the same
# engines sampled from the global generator, with a generator per request (the test since), and greedy; numerics
# (log-probs differ) or the sampler's draw (tokens differ, log-probs equal).  Six engines.
source benchmarks/device_calls/engine_tests.sh
engine_call probe_moe_graphs 560 python benchmarks/device_calls/probe_moe_graphs.py

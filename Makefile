# Two commands on a fresh machine with python3 and make:
#   make workbook   set up .venv and run the whole workbook headless
#   make test       set up .venv and run the tests
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.fastattn-installed
ARGS   ?=

.PHONY: all setup workbook test lab doctor bench clean-venv
all: test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Reinstall when a pin or the package metadata changes.
$(STAMP): $(BIN)/python requirements.txt requirements-voxcpm.txt pyproject.toml
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -r requirements-voxcpm.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	$(BIN)/python -c "import fastattn, voxcpm; print('fastattn', fastattn.__version__, '| voxcpm import ok')"
	touch $(STAMP)

setup: $(STAMP)

workbook: $(STAMP)
	$(BIN)/python -m fastattn workbook $(ARGS)

test: $(STAMP)
	$(BIN)/ruff check fastattn tests data/upstream-tests
	$(BIN)/python -m pytest -q $(ARGS)

# GPU boxes often run containers as root: JupyterLab refuses root without --allow-root.
lab: $(STAMP)
	$(BIN)/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root,) $(ARGS)

doctor: $(STAMP)
	$(BIN)/python -m fastattn doctor

bench: $(STAMP)
	$(BIN)/python -m fastattn bench $(ARGS)

clean-venv:
	rm -rf $(VENV)

# `make test` and `make train` each set themselves up: .venv is created and filled on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-fast train bench clean

$(STAMP): requirements.txt requirements-nodeps.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps -r requirements-nodeps.txt
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

# the suite without the torch.compile test (CI runs the full `make test`)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not compile"

bench: $(STAMP)
	$(BIN)/python bench.py

clean:
	rm -rf $(VENV) .pytest_cache

# `make train` and `make test` each set themselves up: .venv is created and filled on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.installed

# make train: the quick start (prepare Shakespeare, train delta on the cpu preset, sample, report); each
# `make train` starts $(RUN) afresh, its checkpoints and report included
RUN ?= runs/quickstart
DATA_ARGS ?=
TRAIN_ARGS ?=

.PHONY: install test test-fast check-pages exercises exercise exercise-a exercise-b exercise-c exercise-d \
	exercise-e train bench gpu-check clean

$(STAMP): requirements.txt requirements-nodeps.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps -r requirements-nodeps.txt
	touch $(STAMP)

install: $(STAMP)

# the whole suite, on two processes (pytest-xdist) of one thread each: two threads each oversubscribe two cores
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadgroup

# the suite without the torch.compile and multi-process tests (CI runs the full `make test`)
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not compile and not slow"

# the pages' links and every study table they quote (README's results too) against its study's results file
# (seconds), then the pages' commands rerun in a fresh clone, every quoted output checked (more than an hour on
# two idle cores; `$(PY) tests/check_pages.py --runs DIR` reuses finished runs, such as exercise 8's 35 minutes)
check-pages: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:xdist tests/test_pages.py
	$(PY) tests/check_pages.py

# the checks of the exercises a student writes in exercises/ (docs/exercises.md, "Write the router yourself"):
# seconds, one thread; the suite (make test) never reads the student's files, solved or not
exercises: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest exercises -q -p no:xdist

# one exercise's checks: make exercise-a (the router's read) ... make exercise-e (the router's backward)
exercise-a exercise-b exercise-c exercise-d exercise-e: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest exercises/$(EXERCISE_$(subst exercise-,,$@)).py -q -p no:xdist
EXERCISE_a := router_read
EXERCISE_b := multi_head
EXERCISE_c := sources
EXERCISE_d := zero_init
EXERCISE_e := router_backward

exercise:
	@echo "make exercise-a (router_read), -b (multi_head), -c (sources), -d (zero_init) or -e (router_backward)"; exit 2

train: $(STAMP)
	$(PY) cli.py prepare $(DATA_ARGS)
	$(PY) cli.py train --residual delta --preset cpu --out-dir $(RUN) --overwrite $(DATA_ARGS) $(TRAIN_ARGS)
	$(PY) cli.py sample --ckpt $(RUN)/last.pt --num-samples 2 --max-new-tokens 300
	$(PY) cli.py report --ckpt $(RUN)/last.pt --force
	@echo "Next: source .venv/bin/activate   (the README's python commands assume this environment)"

bench: $(STAMP)
	$(PY) -m workbench.bench

# make gpu-check: on a CUDA machine, with its own python3 and PyTorch (no venv): the CUDA tests, the CUDA
# benchmark and 500 steps of every mode, in at most 8 minutes; needs data/shakespeare_char prepared (docs/gpus.md)
GPU_PYTHON ?= python3
GPU_ARGS ?=
gpu-check:
	$(GPU_PYTHON) -m workbench.gpu_check $(GPU_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache

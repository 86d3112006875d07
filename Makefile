# `make test` and `make run` are all a newcomer needs. PYTHON=... uses that interpreter instead of .venv.
ifeq ($(origin PYTHON), undefined)
PYTHON := .venv/bin/python
VENV := .venv/installed
endif
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
DATA := data/MNIST/raw/train-images-idx3-ubyte
STAGES := 01_single_gpu 02_dataparallel 03_ddp_single_node 04_ddp_multi_node

.PHONY: install test test-all test-slurm data run diff profile lint clean bench plot

install: .venv/installed
.venv/installed: requirements.txt pyproject.toml
	python3 -m venv .venv
	.venv/bin/pip install -r requirements.txt
	.venv/bin/pip install --no-deps -e .  # makes `common` importable from a copied stage folder
	touch $@

DATASET ?= mnist
data: | $(VENV)  ## MNIST from the vendored files; DATASET=fashion-mnist|cifar10|cifar100 downloads (login node)
	$(PYTHON) -m common.data data $(DATASET)
$(DATA): | $(VENV)
	$(PYTHON) -m common.data data mnist

test: $(VENV) $(DATA)  ## everyday: CPU only, no root, a few minutes
	$(PYTHON) -m pytest -m "not slow and not slurm"

test-all: $(VENV) $(DATA)  ## everything, the real Slurm cluster included (root)
	$(PYTHON) -m pytest

test-slurm: $(VENV) $(DATA)  ## the job scripts under a real local Slurm (root)
	$(PYTHON) -m pytest -m slurm

run: $(VENV) $(DATA)  ## stage 01, one epoch on real MNIST, on this machine's GPU or CPU
	$(PYTHON) 01_single_gpu/train.py --epochs 1

diff:  ## what each stage adds to the previous one
	@set -e; prev=; for s in $(STAGES); do \
	  if [ -n "$$prev" ]; then for f in train.py job.slurm; do diff -u $$prev/$$f $$s/$$f || true; done; fi; prev=$$s; \
	done; diff -u 04_ddp_multi_node/job.slurm 04_ddp_multi_node/job_torchrun.slurm || true

# pytorch/examples' pipeline by default (one worker, a PIL image per sample); PROFILE= for this repository's
PROFILE ?= --loader classic --num-workers 1
profile: $(VENV) $(DATA)  ## time per line of stage 01's train(), one epoch
	rm -rf runs/profile
	$(PYTHON) -m kernprof -l -v -o runs/profile.lprof 01_single_gpu/train.py --epochs 1 --output-dir runs/profile $(PROFILE)

lint: $(VENV)
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	for f in */*.slurm tests/slurm/*.sh; do bash -n $$f; done
	shellcheck */*.slurm tests/slurm/*.sh

clean:
	rm -rf runs .pytest_cache */__pycache__ */*.out */*.gpu.csv plot.png data/MNIST/raw/*-ubyte

bench: $(VENV) $(DATA)  ## the stages on this machine's GPUs: bench-results/bench.{csv,md,png}
	$(PYTHON) bench/bench.py $(if $(ARGS),-- $(ARGS))

plot: $(VENV)  ## losses, accuracy and time per epoch of the run folders in RUNS, to plot.png
	$(PYTHON) tools/plot.py -o plot.png $(RUNS)

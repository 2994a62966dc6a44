#!/usr/bin/env bash
# The check for a lent GPU machine (one H200, torch and transformers preinstalled, no vLLM, no Ray, no
# network): the parts of the system that run there, the learner and the data plane, in well under
# 10 minutes, figures in one JSON.
#
#   make device-wheels                          # here: .whl/ gets the packages that machine lacks (cp312)
#   scripts/device_check.sh "$OUT"              # there, from the repository root, with .whl and
#                                               # artifacts/tiny-model carried
#   scripts/device_check.sh --dry-run DIR       # here, on the CPU: every stage, small, without CUDA (CI runs it)
#
# Stages, each with its exit status and duration in DIR/device_check.json:
#   learner_cuda_tests  tests/learner/test_learner_cuda.py (a StarPO-S step on CUDA equals the CPU step;
#                       chunked log-probs keep peak memory bounded); skipped without CUDA
#   learner_bench       ragen-async bench learner: a Qwen2.5-0.5B-shaped model (random weights), one
#                       rank's share of a paper step in float32 and in bfloat16 (fp32 masters, bf16 compute),
#                       activation checkpointing off and on: tokens/s, peak memory, MFU against 790 TFLOP/s,
#                       and whether the mixed-precision learner learns: its first update at lr 1e-6 must move
#                       > 99 % of the master weights and lie within 0.35 of float32's (relative norm); the
#                       summary's "mixed_precision" says so (dry run: the tiny model on the CPU, one step)
#   transport_bench     ragen-async bench transport --pin: each end on its own half of the cores
#   weights_bench       ragen-async bench weights: the gloo weight sync, tiny model and 0.5B shapes
# Output in DIR: device_check.json (stages, learner rows, the machine), device_check.log (every stage's
# output), benchmarks.md (the benchmarks' tables, to copy into docs/benchmarks.md).
set -uo pipefail

dry=0
if [[ ${1:-} == --dry-run ]]; then dry=1; shift; fi
out=${1:-${OUT:-device-check}}
mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 2
py=${PYTHON:-python3}
log=$out/device_check.log
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

cli=("$py" -m ragen_async.cli bench)
if ((dry)); then
    stage learner_cuda_tests "$py" -m pytest -q -rs -p no:cacheprovider tests/learner/test_learner_cuda.py
    stage learner_bench "${cli[@]}" learner --shape tiny --device cpu --steps 1 --warmup 0 --checkpointing off \
        --dtype float32 --dtype bfloat16 --json "$out/learner.json" --out "$out/benchmarks.md"
    stage transport_bench "${cli[@]}" transport --pin --groups 20 --repeats 1 --out "$out/benchmarks.md"
    stage weights_bench "${cli[@]}" weights --no-large --repeats 1 --out "$out/benchmarks.md"
else
    nvidia-smi >> "$log" 2>&1
    stage learner_cuda_tests "$py" -m pytest -q -s -rs -m gpu -p no:cacheprovider tests/learner/test_learner_cuda.py
    stage learner_bench "${cli[@]}" learner --shape qwen0.5b --device cuda --steps 5 --warmup 2 \
        --dtype float32 --dtype bfloat16 --json "$out/learner.json" --out "$out/benchmarks.md"
    stage transport_bench "${cli[@]}" transport --pin --groups 2000 --repeats 3 --out "$out/benchmarks.md"
    stage weights_bench "${cli[@]}" weights --repeats 5 --out "$out/benchmarks.md"
fi

# One JSON: the stages, the learner's rows and what the machine was.
joined=$(IFS=,; echo "${stages[*]}")
"$py" - "$out" "$dry" "[$joined]" <<'PY'
import json, os, platform, sys
out, dry, stages = sys.argv[1], sys.argv[2] == "1", json.loads(sys.argv[3])
learner = os.path.join(out, "learner.json")
machine = {"cpus": os.cpu_count(), "python": platform.python_version()}
try:
    import torch
    machine["torch"] = torch.__version__
    machine["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
except ImportError:
    pass
rows = json.load(open(learner)) if os.path.exists(learner) else None
# The mixed-precision learner learns: its first update at lr 1e-6 moves nearly every master weight, as fp32's does.
mixed = [r for r in rows or [] if r["dtype"] == "bfloat16"]
mp_ok = bool(mixed) and all(r["moved_frac"] > 0.99 and r["update_vs_fp32"] is not None and r["update_vs_fp32"] <= 0.35
                            for r in mixed)
stages.append({"stage": "mixed_precision", "exit": 0 if mp_ok else 1, "seconds": 0})
summary = {"dry_run": dry, "machine": machine, "stages": stages, "learner": rows}
json.dump(summary, open(os.path.join(out, "device_check.json"), "w"), indent=1)
if os.path.exists(learner):
    os.remove(learner)  # (in device_check.json now: the device hands back at most 8 files)
failed = [s["stage"] for s in stages if s["exit"] != 0]
print(f"[device-check] {'failed: ' + ', '.join(failed) if failed else 'every stage passed'}; {out}/device_check.json")
sys.exit(1 if failed else 0)
PY

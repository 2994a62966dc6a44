#!/usr/bin/env bash
# Submit a training run (or a sweep) to a running Ray cluster through its Jobs API.
#
#   launchers/ray_job.sh [options] CONFIG [key.sub=value ...]
#   launchers/ray_job.sh [options] sweep SPEC [key.sub=value ...]
#
# This directory is uploaded as the job's working directory (without .venv, artifacts, runs,
# wandb, .git) and `python -u -m ragen_async.cli train CONFIG runtime=ray ...` runs on the head
# node; its actors spread over the cluster. CONFIG must lie inside this repository.
#
# The cluster needs, on EVERY node: the project's Python dependencies (the same venv/image as
# the nodes' `ray start`), and the model at `model.path`, as an absolute path on shared storage
# or copied to each node; artifacts/ is not uploaded. Run directories are written on the head
# node: give --run-root a shared path, or they stay in the job's temporary working directory.
#
# Options:
#   --address URL        the cluster's Jobs API (default: $RAY_API_SERVER_ADDRESS, else
#                        http://127.0.0.1:8265)
#   --run-root DIR       where run (or sweep) directories go, on storage you can read later
#                        (default: $RAGEN_RUN_ROOT)
#   --no-wait            submit and return; print how to follow, query and stop the job
#   --forward-wandb-key  pass $WANDB_API_KEY to the job (anyone who can read the job's runtime
#                        env on the dashboard can read it; a `wandb login` on the head is safer)
#   -h, --help           this text
#
# Environment: RAY_AUTH_MODE (default `disabled`; set `token` plus RAY_AUTH_TOKEN for a cluster
# with token auth), RAY (the ray CLI, default `ray`), WANDB_PROJECT / WANDB_ENTITY (forwarded).
set -euo pipefail

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
}

die() {
    echo "ray_job.sh: $*" >&2
    exit 2
}

json_string() {  # a bash string as a JSON string literal
    local s=${1//\\/\\\\}
    s=${s//\"/\\\"}
    s=${s//$'\n'/\\n}
    s=${s//$'\t'/\\t}
    printf '"%s"' "$s"
}

address=${RAY_API_SERVER_ADDRESS:-http://127.0.0.1:8265}
run_root=${RAGEN_RUN_ROOT:-}
wait_for_job=1
forward_key=0
while [[ $# -gt 0 ]]; do
    case $1 in
        --address) [[ $# -ge 2 ]] || die "--address needs a URL"; address=$2; shift 2 ;;
        --address=*) address=${1#*=}; shift ;;
        --run-root) [[ $# -ge 2 ]] || die "--run-root needs a directory"; run_root=$2; shift 2 ;;
        --run-root=*) run_root=${1#*=}; shift ;;
        --no-wait) wait_for_job=0; shift ;;
        --forward-wandb-key) forward_key=1; shift ;;
        -h | --help) usage; exit 0 ;;
        --) shift; break ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) break ;;
    esac
done

command=train
if [[ ${1:-} == sweep || ${1:-} == train ]]; then
    command=$1
    shift
fi
[[ $# -ge 1 ]] || { usage >&2; exit 2; }
config=$1
shift
overrides=("$@")

# The job runs in an uploaded copy of this repository, so the config must be inside it.
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[[ -f $config ]] || die "config file not found: $config"
config_abs=$(cd "$(dirname "$config")" && pwd)/$(basename "$config")
[[ $config_abs == "$repo"/* ]] || die "$config is outside $repo, so it would not be uploaded; copy it into configs/"
config_rel=${config_abs#"$repo"/}

# Validate the config here, before uploading anything, when this machine has the project.
python=${PYTHON:-$repo/.venv/bin/python}
if [[ -x $python ]] && (cd "$repo" && "$python" -c 'import ragen_async.config' 2>/dev/null); then
    if [[ $command == train ]]; then
        model_path=$(cd "$repo" && "$python" - "$config_rel" runtime=ray "${overrides[@]}" <<'PY'
import sys
from ragen_async.config import ConfigError, load_config
try:
    print(load_config(sys.argv[1], sys.argv[2:]).model.path)
except ConfigError as e:
    sys.exit(f"ray_job.sh: {e}")
PY
        ) || exit 2
    else
        (cd "$repo" && "$python" -m ragen_async.cli sweep "$config_rel" runtime=ray "${overrides[@]}" --dry-run \
            >/dev/null) || die "the sweep does not validate (run it with --dry-run to see the plan)"
        model_path=
    fi
    if [[ -n $model_path && $model_path != /* ]]; then
        echo "ray_job.sh: note: model.path=$model_path is relative to the job's working directory on the head" \
             "node, where artifacts/ is not uploaded; use an absolute path that exists on every node" >&2
    fi
fi

entrypoint=(python -u -m ragen_async.cli "$command" "$config_rel")
has_runtime=0
for item in "${overrides[@]}"; do
    if [[ $item == runtime=* ]]; then has_runtime=1; fi
done
if [[ $has_runtime == 0 ]]; then entrypoint+=(runtime=ray); fi
entrypoint+=("${overrides[@]}")
stamp=$(date +%Y%m%d-%H%M%S)
name=$(basename "$config_rel" .yaml)
if [[ -n $run_root ]]; then
    [[ $run_root == /* ]] || die "--run-root must be an absolute path (the job does not run where you are)"
    if [[ $command == train ]]; then
        entrypoint+=("run_root=$run_root")
    else
        entrypoint+=(--out "$run_root/sweeps/$name-$stamp")
    fi
else
    echo "ray_job.sh: note: no --run-root; run directories stay in the job's temporary working directory" \
         "on the head node" >&2
fi

# Only variables the trainer does not set itself: Ray refuses to merge a job's env_vars with the
# driver's ray.init(runtime_env=...) when both name the same variable (so no WANDB_MODE here; use
# the logging.wandb_mode override).
env_json=$(json_string PYTHONUNBUFFERED):$(json_string 1)
for var in WANDB_PROJECT WANDB_ENTITY RAGEN_LOG_LEVEL; do
    if [[ -n ${!var:-} ]]; then env_json+=,$(json_string "$var"):$(json_string "${!var}"); fi
done
if [[ $forward_key == 1 ]]; then
    [[ -n ${WANDB_API_KEY:-} ]] || die "--forward-wandb-key: WANDB_API_KEY is not set"
    env_json+=,$(json_string WANDB_API_KEY):$(json_string "$WANDB_API_KEY")
fi
excludes='"/.venv/", "/artifacts/", "/runs/", "/wandb/", "/.git/", "__pycache__/", "*.egg-info/"'
runtime_env="{\"env_vars\": {$env_json}, \"excludes\": [$excludes]}"

export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
ray_cli=${RAY:-ray}
submission_id=ragen-$name-$stamp-$RANDOM
submit=("$ray_cli" job submit --address "$address" --submission-id "$submission_id" --working-dir "$repo"
        --runtime-env-json "$runtime_env")
[[ $wait_for_job == 1 ]] || submit+=(--no-wait)
submit+=(-- "${entrypoint[@]}")

echo "submitting $submission_id to $address: ${entrypoint[*]}" >&2
"${submit[@]}"
if [[ $wait_for_job == 0 ]]; then
    cat >&2 <<EOF

Submitted $submission_id. Follow it with:
  ray job logs   --address $address --follow $submission_id
  ray job status --address $address $submission_id
  ray job stop   --address $address $submission_id
EOF
fi

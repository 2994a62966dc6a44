#!/usr/bin/env bash
# Submit a training run (or a sweep) to a running Ray cluster through its Jobs API.
#
#   launchers/ray_job.sh [options] [train] CONFIG [key.sub=value ...]
#   launchers/ray_job.sh [options] train --resume RUN_DIR
#   launchers/ray_job.sh [options] sweep SPEC [key.sub=value ...]
#   launchers/ray_job.sh [options] sweep --resume SWEEP_DIR
#
# This directory is uploaded as the job's working directory (without .venv, artifacts, runs, wandb, .git,
# __pycache__, *.egg-info and the studies' run directories) and `python -u -m ragen_async.cli train CONFIG runtime=ray ...` runs on the head
# node; its actors spread over the cluster. CONFIG must lie inside this repository. --resume
# continues a run (or sweep) directory with its saved config, so it takes no overrides; give it
# as an absolute path on the cluster's shared storage.
#
# The cluster needs, on EVERY node: the project's Python dependencies (the same venv/image as
# the nodes' `ray start`), and the model at `model.path`, as an absolute path on shared storage
# or copied to each node; artifacts/ is not uploaded. The job runs `python` from the PATH of the
# head's `ray start`: start it with the venv activated, or pass --job-python. Run directories
# are written where the job runs (the head node): give --run-root a shared path, or they stay in
# the job's temporary working directory.
#
# Options:
#   --address URL        the cluster's Jobs API, e.g. http://head-node:8265. Default, as in
#                        `ray job`: $RAY_API_SERVER_ADDRESS, else $RAY_ADDRESS, else
#                        http://127.0.0.1:8265. A `ray://host:10001` (Ray Client) or `host:6379`
#                        (GCS) address also works: Ray looks the dashboard's URL up through it,
#                        which needs that port reachable from here.
#   --run-root DIR       where run (or sweep) directories go, on storage you can read later
#                        (default: $RAGEN_RUN_ROOT; not with --resume)
#   --no-wait            submit and return; print how to follow, query and stop the job
#   --wandb-group NAME   W&B run group (default: $WANDB_RUN_GROUP)
#   --wandb-tags A,B     W&B run tags, comma-separated (default: $WANDB_TAGS)
#   --forward-wandb-key  pass $WANDB_API_KEY to the job (anyone who can read the job's runtime
#                        env on the dashboard can read it; a `wandb login` on the head is safer)
#   --entrypoint-num-cpus N
#                        reserve N CPUs for the driver (default: none, and the driver runs on
#                        the head node; with N, Ray runs it on any node with N CPUs free)
#   --job-python CMD     the Python that runs the driver on the cluster (default: `python`)
#   -h, --help           this text
#
# Without --no-wait it streams the job's logs until the job ends and exits 0 if it SUCCEEDED,
# 1 if it FAILED or was STOPPED (Ctrl-C stops following, not the job; exit 130).
#
# Every job carries the commit of this checkout: in its metadata (`ray job list`, the dashboard:
# git_commit, git_dirty), in its submission id (ragen-NAME-TIME-COMMIT-N), and as
# WANDB_GIT_COMMIT, which W&B records as the run's commit (.git is not uploaded).
#
# Environment: RAY_AUTH_MODE (default `disabled`; set `token` plus RAY_AUTH_TOKEN for a cluster
# with token auth), RAY (the ray CLI, default `ray`), PYTHON (validates the config here, default
# .venv/bin/python), RAGEN_LOG_LEVEL (forwarded), WANDB_PROJECT / WANDB_ENTITY (passed to new
# runs as logging.wandb_project / logging.wandb_entity unless the overrides set them).
set -euo pipefail

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
}

die() {
    echo "ray_job.sh: $*" >&2
    exit 2
}

note() {
    echo "ray_job.sh: note: $*" >&2
}

json_string() {  # a bash string as a JSON string literal
    local s=${1//\\/\\\\}
    s=${s//\"/\\\"}
    s=${s//$'\n'/\\n}
    s=${s//$'\t'/\\t}
    printf '"%s"' "$s"
}

json_object() {  # json_object KEY VALUE ...: a JSON object of string values
    local out=
    while [[ $# -ge 2 ]]; do
        out+=${out:+, }$(json_string "$1"):$(json_string "$2")
        shift 2
    done
    printf '{%s}' "$out"
}

# Ray's own order for `ray job`: RAY_API_SERVER_ADDRESS, then RAY_ADDRESS (see --help).
address=
address_from=default
if [[ -n ${RAY_API_SERVER_ADDRESS:-} ]]; then
    address=$RAY_API_SERVER_ADDRESS
    address_from=RAY_API_SERVER_ADDRESS
elif [[ -n ${RAY_ADDRESS:-} ]]; then
    address=$RAY_ADDRESS
    address_from=RAY_ADDRESS
fi
run_root=${RAGEN_RUN_ROOT:-}
wait_for_job=1
forward_key=0
wandb_group=${WANDB_RUN_GROUP:-}
wandb_tags=${WANDB_TAGS:-}
entrypoint_cpus=
job_python=python
while [[ $# -gt 0 ]]; do
    case $1 in
        --address) [[ $# -ge 2 ]] || die "--address needs a URL"; address=$2; address_from=--address; shift 2 ;;
        --address=*) address=${1#*=}; address_from=--address; shift ;;
        --run-root) [[ $# -ge 2 ]] || die "--run-root needs a directory"; run_root=$2; shift 2 ;;
        --run-root=*) run_root=${1#*=}; shift ;;
        --no-wait) wait_for_job=0; shift ;;
        --wandb-group) [[ $# -ge 2 ]] || die "--wandb-group needs a name"; wandb_group=$2; shift 2 ;;
        --wandb-group=*) wandb_group=${1#*=}; shift ;;
        --wandb-tags) [[ $# -ge 2 ]] || die "--wandb-tags needs a comma-separated list"; wandb_tags=$2; shift 2 ;;
        --wandb-tags=*) wandb_tags=${1#*=}; shift ;;
        --forward-wandb-key) forward_key=1; shift ;;
        --entrypoint-num-cpus) [[ $# -ge 2 ]] || die "--entrypoint-num-cpus needs a number"
                               entrypoint_cpus=$2; shift 2 ;;
        --entrypoint-num-cpus=*) entrypoint_cpus=${1#*=}; shift ;;
        --job-python) [[ $# -ge 2 ]] || die "--job-python needs a command"; job_python=$2; shift 2 ;;
        --job-python=*) job_python=${1#*=}; shift ;;
        -h | --help) usage; exit 0 ;;
        --) shift; break ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) break ;;
    esac
done
if [[ -n $entrypoint_cpus && ! $entrypoint_cpus =~ ^([0-9]+([.][0-9]*)?|[.][0-9]+)$ ]]; then
    die "--entrypoint-num-cpus must be a number (got $entrypoint_cpus)"
fi
[[ -n $address ]] || address=http://127.0.0.1:8265
case $address in
    http://* | https://*) ;;
    ray://*) note "$address_from=$address is a Ray Client address; Ray finds the Jobs API through it" ;;
    *://*) die "$address_from=$address: expected http(s)://HOST:PORT (the dashboard), ray://HOST:PORT or HOST:PORT" ;;
    *) note "$address_from=$address has no http://, so Ray takes it for the cluster's GCS address and asks" \
            "the GCS for the dashboard's URL (for the dashboard itself, write http://$address)" ;;
esac

command=train
if [[ ${1:-} == sweep || ${1:-} == train ]]; then
    command=$1
    shift
fi
resume=
if [[ ${1:-} == --resume || ${1:-} == --resume=* ]]; then
    if [[ $1 == --resume=* ]]; then
        resume=${1#*=}
        shift
    else
        [[ $# -ge 2 ]] || die "--resume needs a directory"
        resume=$2
        shift 2
    fi
    [[ $# -eq 0 ]] || die "--resume continues with the saved config; do not pass a config or overrides ($*)"
    [[ -z $run_root ]] || die "--resume writes into the directory it continues; drop --run-root"
    [[ $resume == /* ]] || die "--resume needs an absolute path (the job does not run where you are)"
    resume=${resume%/}
fi
[[ -n $resume || $# -ge 1 ]] || { usage >&2; exit 2; }
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$repo/.venv/bin/python}
have_project=0
if [[ -x $python ]] && (cd "$repo" && "$python" -c 'import ragen_async.config' 2>/dev/null); then
    have_project=1
fi

if [[ -n $resume ]]; then
    saved=$resume/config.yaml
    [[ $command == sweep ]] && saved=$resume/sweep.json
    if [[ -d $resume ]]; then
        [[ -f $saved ]] || die "$resume has no $(basename "$saved"): not a ${command/train/run} directory"
    else
        note "$resume is not on this machine; the job checks it on the cluster"
    fi
    name=resume-$(basename "$resume")
    entrypoint=("$job_python" -u -m ragen_async.cli "$command" --resume "$resume")
    overrides=()
else
    config=$1
    shift
    overrides=("$@")
    # The job runs in an uploaded copy of this repository, so the config must be inside it.
    [[ -f $config ]] || die "config file not found: $config"
    config_abs=$(cd "$(dirname "$config")" && pwd)/$(basename "$config")
    [[ $config_abs == "$repo"/* ]] || die "$config is outside $repo, so it would not be uploaded; copy it into configs/"
    config_rel=${config_abs#"$repo"/}
    name=$(basename "$config_rel" .yaml)
    entrypoint=("$job_python" -u -m ragen_async.cli "$command" "$config_rel")
    has_runtime=0 has_project=0 has_entity=0
    for item in "${overrides[@]}"; do
        case $item in
            runtime=*) has_runtime=1 ;;
            logging.wandb_project=*) has_project=1 ;;
            logging.wandb_entity=*) has_entity=1 ;;
        esac
    done
    if [[ $has_runtime == 0 ]]; then entrypoint+=(runtime=ray); fi
    entrypoint+=("${overrides[@]}")
    # wandb.init gets the project and entity from the config, which wins over WANDB_PROJECT/ENTITY.
    if [[ -n ${WANDB_PROJECT:-} && $has_project == 0 ]]; then entrypoint+=("logging.wandb_project=$WANDB_PROJECT"); fi
    if [[ -n ${WANDB_ENTITY:-} && $has_entity == 0 ]]; then entrypoint+=("logging.wandb_entity=$WANDB_ENTITY"); fi
fi
stamp=$(date +%Y%m%d-%H%M%S)
if [[ -z $resume ]]; then
    if [[ -n $run_root ]]; then
        [[ $run_root == /* ]] || die "--run-root must be an absolute path (the job does not run where you are)"
        if [[ $command == train ]]; then
            entrypoint+=("run_root=$run_root")
        else
            entrypoint+=(--out "$run_root/sweeps/$name-$stamp")
        fi
    else
        note "no --run-root; run directories stay in the job's temporary working directory on the head node"
    fi
fi

# Validate here, before uploading anything, when this machine has the project: the same arguments
# the job will get (past the interpreter).
if [[ $have_project == 1 ]]; then
    if [[ -n $resume ]]; then
        if [[ -d $resume && $command == train ]]; then
            (cd "$repo" && "$python" - "$resume/config.yaml" <<'PY'
import sys
from ragen_async.config import ConfigError, load_config
try:
    load_config(sys.argv[1])
except ConfigError as e:
    sys.exit(f"ray_job.sh: {e}")
PY
            ) || exit 2
        fi
    elif [[ $command == train ]]; then
        model_path=$(cd "$repo" && "$python" - "${entrypoint[@]:5}" <<'PY'
import sys
from ragen_async.config import ConfigError, load_config
try:
    print(load_config(sys.argv[1], sys.argv[2:]).model.path)
except ConfigError as e:
    sys.exit(f"ray_job.sh: {e}")
PY
        ) || exit 2
        if [[ $model_path != /* ]]; then
            note "model.path=$model_path is relative to the job's working directory on the head node," \
                 "where artifacts/ is not uploaded; use an absolute path that exists on every node"
        fi
    else
        (cd "$repo" && "$python" -m ragen_async.cli "${entrypoint[@]:4}" --dry-run >/dev/null) \
            || die "the sweep does not validate (run it with --dry-run to see the plan)"
    fi
fi

# The commit this checkout is at: .git is not uploaded, so the job cannot find it itself.
git_commit=unknown
git_dirty=unknown
if git -C "$repo" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git_commit=$(git -C "$repo" rev-parse HEAD 2>/dev/null || echo unknown)
    if [[ -n $(git -C "$repo" status --porcelain 2>/dev/null) ]]; then git_dirty=true; else git_dirty=false; fi
fi
if [[ $git_dirty == true ]]; then
    note "this checkout has uncommitted changes; they are uploaded, but git_commit=$git_commit does not have them"
fi

# Environment of the driver and of every actor it starts (the trainer's ray.init joins the job and
# adds no runtime env of its own there).
env_vars=(PYTHONUNBUFFERED 1 TOKENIZERS_PARALLELISM false)
if [[ $git_commit != unknown ]]; then env_vars+=(WANDB_GIT_COMMIT "$git_commit"); fi
if [[ -n $wandb_group ]]; then env_vars+=(WANDB_RUN_GROUP "$wandb_group"); fi
if [[ -n $wandb_tags ]]; then env_vars+=(WANDB_TAGS "$wandb_tags"); fi
if [[ -n ${RAGEN_LOG_LEVEL:-} ]]; then env_vars+=(RAGEN_LOG_LEVEL "$RAGEN_LOG_LEVEL"); fi
if [[ $forward_key == 1 ]]; then
    [[ -n ${WANDB_API_KEY:-} ]] || die "--forward-wandb-key: WANDB_API_KEY is not set"
    env_vars+=(WANDB_API_KEY "$WANDB_API_KEY")
fi
# The studies' run directories (all under studies/**/runs/) stay home; their pinned warm starts travel.
excludes='"/.venv/", "/artifacts/", "/runs/", "/wandb/", "/.git/", "__pycache__/", "*.egg-info/", "/studies/**/runs/"'
runtime_env="{\"env_vars\": $(json_object "${env_vars[@]}"), \"excludes\": [$excludes]}"

metadata=(ragen_command "$command${resume:+ --resume}" ragen_target "${resume:-${config_rel:-}}"
          git_commit "$git_commit" git_dirty "$git_dirty")
if [[ -n $run_root ]]; then metadata+=(run_root "$run_root"); fi
if [[ -n $wandb_group ]]; then metadata+=(wandb_group "$wandb_group"); fi
if [[ -n $wandb_tags ]]; then metadata+=(wandb_tags "$wandb_tags"); fi

export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
ray_cli=${RAY:-ray}
safe_name=$(printf '%s' "$name" | tr -c 'A-Za-z0-9_.-' '-')
submission_id=ragen-$safe_name-$stamp-${git_commit:0:8}-$RANDOM
[[ $git_commit != unknown ]] || submission_id=ragen-$safe_name-$stamp-$RANDOM
submit=("$ray_cli" job submit --address "$address" --submission-id "$submission_id" --working-dir "$repo"
        --runtime-env-json "$runtime_env" --metadata-json "$(json_object "${metadata[@]}")" --no-wait)
if [[ -n $entrypoint_cpus ]]; then submit+=(--entrypoint-num-cpus "$entrypoint_cpus"); fi
submit+=(-- "${entrypoint[@]}")

echo "submitting $submission_id to $address ($address_from), commit $git_commit: ${entrypoint[*]}" >&2
"${submit[@]}"
follow_help="  ray job logs   --address $address --follow $submission_id
  ray job status --address $address $submission_id
  ray job stop   --address $address $submission_id"
if [[ $wait_for_job == 0 ]]; then
    printf '\nSubmitted %s. Follow it with:\n%s\n' "$submission_id" "$follow_help" >&2
    exit 0
fi

trap 'printf "\nray_job.sh: stopped following; the job goes on:\n%s\n" "$follow_help" >&2; exit 130' INT
# Returns when the job ends (or the connection drops: the status loop below then keeps waiting).
"$ray_cli" job logs --address "$address" --follow "$submission_id" || true

job_status() {  # the job's status word, from `ray job status` (its messages, colours removed)
    local out
    out=$("$ray_cli" job status --address "$address" "$submission_id" 2>&1 | sed "s/$(printf '\033')\\[[0-9;]*m//g") || {
        echo "$out" >&2
        return 1
    }
    case $out in
        *"Job '$submission_id' succeeded"*) echo SUCCEEDED ;;
        *"Job '$submission_id' failed"*) echo FAILED ;;
        *"Job '$submission_id' was stopped"*) echo STOPPED ;;
        *"Status for job '$submission_id': "*)
            out=${out##*"Status for job '$submission_id': "}
            echo "${out%%[[:space:]]*}" ;;
        *) echo "$out" >&2; return 1 ;;
    esac
}

while true; do
    status=$(job_status) || { echo "ray_job.sh: could not read the status of $submission_id" >&2; exit 1; }
    case $status in
        SUCCEEDED) echo "ray_job.sh: $submission_id SUCCEEDED" >&2; exit 0 ;;
        FAILED | STOPPED)
            echo "ray_job.sh: $submission_id $status (logs: ray job logs --address $address $submission_id)" >&2
            exit 1 ;;
        *) sleep 5 ;;  # the log stream ended early; wait for the end
    esac
done

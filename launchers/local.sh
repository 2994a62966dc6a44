#!/usr/bin/env bash
# Train on this machine: `ragen-async train CONFIG [key.sub=value ...]` with a private local Ray.
#
#   launchers/local.sh configs/tiny/starpo_s_bandit.yaml
#   launchers/local.sh configs/tiny/starpo_s_bandit.yaml runtime=ray staleness.max_staleness=2 total_steps=20
#
# With `runtime: ray` the trainer starts (and stops) its own Ray on this host, sized to the
# configured actors; with `runtime: local` everything runs in this one process. Run it from the
# repository root: relative paths in configs (model.path, run_root) are relative to where you are.
#
# Environment (all optional):
#   RAGEN_ASYNC     the command to run (default: the repository's .venv/bin/ragen-async, else
#                   `ragen-async` on PATH, else `python -m ragen_async.cli`)
#   RAY_AUTH_MODE   default `disabled`. Ray 2.60 turns token auth on when ~/.ray/auth_token exists
#                   and the mode is unset, so it is always set explicitly here.
#   WANDB_MODE      online / offline / disabled; unset = online when a W&B key is configured.
set -euo pipefail

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
}

if [[ $# -lt 1 ]]; then
    usage >&2
    exit 2
elif [[ $1 == -h || $1 == --help ]]; then
    usage
    exit 0
fi
config=$1
shift
if [[ ! -f $config ]]; then
    echo "local.sh: config file not found: $config" >&2
    exit 2
fi

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -n ${RAGEN_ASYNC:-} ]]; then
    read -r -a cmd <<<"$RAGEN_ASYNC"
elif [[ -x $repo/.venv/bin/ragen-async ]]; then
    cmd=("$repo/.venv/bin/ragen-async")
elif command -v ragen-async >/dev/null 2>&1; then
    cmd=(ragen-async)
elif [[ -x $repo/.venv/bin/python ]]; then
    cmd=("$repo/.venv/bin/python" -m ragen_async.cli)
else
    cmd=(python3 -m ragen_async.cli)
fi

# A private Ray for this run: never attach to a cluster someone pointed RAY_ADDRESS at.
unset RAY_ADDRESS RAY_API_SERVER_ADDRESS
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
export RAY_USAGE_STATS_ENABLED=${RAY_USAGE_STATS_ENABLED:-0}
export RAY_DEDUP_LOGS=${RAY_DEDUP_LOGS:-1}
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
export PYTHONUNBUFFERED=1

echo "+ ${cmd[*]} train $config $*" >&2
exec "${cmd[@]}" train "$config" "$@"

#!/usr/bin/env bash
# Multi-node continued pretraining: a thin wrapper around DeepSpeed's launcher (`deepspeed --hostfile`).
#
# usage: scripts/launch_multinode.sh HOSTFILE --config configs/train/NAME.yaml [key=value ...]
#
# HOSTFILE lists one node per line in DeepSpeed's format, "hostname slots=GPUS":
#     node-0 slots=8
#     node-1 slots=8
# Every argument after HOSTFILE goes to train/pretrain.py unchanged (see train/pretrain.py --help).
#
# Requirements (DeepSpeed's, not ours):
#   - passwordless ssh from this node to every host (the pdsh launcher runs the command there);
#   - the same repository path and Python environment on every node (pdsh cds into this working directory);
#   - output_dir on a filesystem every node shares: each rank writes its checkpoint shards there, and
#     resume=auto reads them back;
#   - environment variables every rank needs (NCCL_*, HF_HOME, WANDB_*) listed as NAME=VALUE lines in
#     ./.deepspeed_env or ~/.deepspeed_env, which DeepSpeed forwards to the remote nodes.
#
# Optional environment:
#   MASTER_ADDR       address of the rendezvous node (default: the first host in HOSTFILE)
#   MASTER_PORT       rendezvous port (default: 29500)
#   NUM_NODES         use only the first N hosts (default: all)
#   GPUS_PER_NODE     ranks per node (default: each host's slots)
#   LAUNCHER          pdsh (default), openmpi, mvapich, slurm, mpich, impi (deepspeed --launcher)
#   DS_LAUNCHER_ARGS  more launcher options, e.g. "--no_ssh_check" or "--launcher_args=..."
#
# Example: MASTER_PORT=29611 scripts/launch_multinode.sh hostfile --config configs/train/qwen3_1p7b_r2lm.yaml
set -euo pipefail

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit $(( $# < 1 ? 2 : 0 ))
fi

HOSTFILE=$1
shift
if [[ ! -f "$HOSTFILE" ]]; then
    echo "error: hostfile $HOSTFILE does not exist" >&2
    exit 2
fi
# the first "host slots=N" line, ignoring comments and blank lines
FIRST_HOST=$(awk '!/^[[:space:]]*(#|$)/ && /slots=[0-9]+/ {print $1; exit}' "$HOSTFILE")
if [[ -z "$FIRST_HOST" ]]; then
    echo "error: hostfile $HOSTFILE has no 'hostname slots=N' line" >&2
    exit 2
fi

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
args=(--hostfile "$HOSTFILE" --master_addr "${MASTER_ADDR:-$FIRST_HOST}" --master_port "${MASTER_PORT:-29500}"
      --launcher "${LAUNCHER:-pdsh}")
[[ -n "${NUM_NODES:-}" ]] && args+=(--num_nodes "$NUM_NODES")
[[ -n "${GPUS_PER_NODE:-}" ]] && args+=(--num_gpus "$GPUS_PER_NODE")
# shellcheck disable=SC2206  # DS_LAUNCHER_ARGS is a list of words on purpose
[[ -n "${DS_LAUNCHER_ARGS:-}" ]] && args+=($DS_LAUNCHER_ARGS)

set -x
exec deepspeed "${args[@]}" "$REPO/train/pretrain.py" "$@"

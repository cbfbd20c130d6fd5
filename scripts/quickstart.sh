#!/usr/bin/env bash
# The main job on a small embedded default, start to finish on CPU (a few minutes on 2 cores):
#   1. real text: Python's own documentation (pydoc topics), split into train / held-out
#   2. a tiny random transformers Qwen3 with a BPE tokenizer trained on that text (the "pretrained" base)
#   3. python -m convert from-hf: an R2LM checkpoint (reverse Mamba sidecars on layers 1 and 3, closed gates, <|mask|>)
#   4. continued pretraining with the block-diffusion objective through the deepspeed launcher, 2 CPU ranks, ZeRO-2
#   5. generation from the exported checkpoint with cached parallel decoding
#
#   bash scripts/quickstart.sh [DIR]       or       QUICKSTART_DIR=DIR bash scripts/quickstart.sh
#
# Everything lands in DIR (default runs/quickstart), rebuilt on every run. The run holds a lock on DIR
# (DIR/run.lock, util-linux flock) while it lasts: a second quickstart into the same DIR, or one into a DIR that
# a training run inside it holds (DIR/*/run.lock, train/lock.py), stops with an error naming the holder instead
# of deleting the folder under it. Two quickstarts at once need two folders. QUICKSTART_PORT sets the deepspeed
# rendezvous port (default: a free one).
set -euo pipefail
RUN="${1:-${QUICKSTART_DIR:-}}"
[ -n "$RUN" ] && RUN="$(realpath -m -- "$RUN")"  # relative to where the script is called from
cd "$(dirname "$0")/.."
RUN="${RUN:-runs/quickstart}"

in_use() {  # $1: a lock file held by someone else
  echo "error: $RUN is in use by another run: $(cat "$1") (lock file $1); wait for it to end, or choose another folder:" \
    "bash scripts/quickstart.sh DIR" >&2
  exit 1
}
mkdir -p "$RUN"
exec 9>>"$RUN/run.lock"  # held until this script and its children end, however they end
flock -n 9 || in_use "$RUN/run.lock"
printf '{"pid": %d, "host": "%s", "started": "%s"}\n' $$ "${HOSTNAME:-$(uname -n)}" "$(date '+%Y-%m-%d %H:%M:%S %z')" >"$RUN/run.lock"
trap ': >"$RUN/run.lock"' EXIT  # the record goes with the lock (as train/lock.py's does)
while IFS= read -r -d '' lock; do  # training runs inside RUN (train/lock.py takes the same flock)
  flock -n "$lock" true || in_use "$lock"
done < <(find "$RUN" -mindepth 2 -name run.lock -print0)
find "$RUN" -mindepth 1 -maxdepth 1 ! -name run.lock -exec rm -rf {} +

source scripts/env.sh
step() { printf '\n=== %s\n' "$*"; }

step "1/5 corpus: Python's pydoc topics"
python scripts/make_corpus.py "$RUN/corpus"

step "2/5 base model: tiny transformers Qwen3 + BPE tokenizer"
python scripts/make_tiny_base.py "$RUN/base" --text "$RUN/corpus/train.txt"

step "3/5 convert to R2LM"
python -m convert from-hf "$RUN/base" "$RUN/r2lm" --sidecar-layers 1,3 --headdim 32 --expand 1 --block-size 16
python - "$RUN/base" "$RUN/r2lm" <<'PY'
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from r2lm import R2LMForDiffusionLM
base = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
r2lm = R2LMForDiffusionLM.from_pretrained(sys.argv[2]).eval()
ids = AutoTokenizer.from_pretrained(sys.argv[2])("The for statement is used to iterate", return_tensors="pt").input_ids
with torch.no_grad():
    gap = (base(ids).logits - r2lm(ids).logits[..., : base.config.vocab_size]).abs().max().item()
extra = sum(p.numel() for n, p in r2lm.named_parameters() if ".sidecar." in n)
print(f"R2LM: {r2lm.num_parameters() / 1e6:.2f}M parameters ({100 * extra / (r2lm.num_parameters() - extra):.1f}% in sidecars), "
      f"mask id {r2lm.config.mask_token_id}; closed gates, so it computes what the Qwen3 base does: max |logit gap| {gap:.1e}")
PY

step "4/5 continued pretraining: deepspeed, 2 ranks, ZeRO-2, block diffusion"
PORT="${QUICKSTART_PORT:-$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
deepspeed --num_gpus 2 --master_port "$PORT" train/pretrain.py --config configs/train/tiny_cpu.yaml \
  model="$RUN/r2lm" output_dir="$RUN/tiny_cpu" data.train="$RUN/corpus/train.txt" data.heldout="$RUN/corpus/heldout.txt"

step "5/5 generate from the trained model (a 1M-parameter model after a minute of training: expect babble)"
# r2lm-generate, run through python -m so that an r2lm installed before it had the command works too.
# Sampled: greedy decoding of a model this young mostly repeats its most frequent token (a newline)
python -m r2lm.cli.generate "$RUN/tiny_cpu/final" --prompt "The for statement" --max-new-tokens 48 --threshold 0.7 \
  --temperature 0.9 --seed 0
# greedy, a batch of two left-padded prompts
python -m r2lm.cli.generate "$RUN/tiny_cpu/final" --prompt "A class definition" --prompt "The" --max-new-tokens 32 --threshold 0.7

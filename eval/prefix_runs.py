"""The prefix-cache benchmark's workloads through PrefixCache (`python -m eval.prefix_bench`): replayed, the
cache's bookkeeping alone (hit rates at any capacity, in no time), and through r2lm.generate under each policy
(hit rates, time to first token, and first-token logits against no cache's)."""

from __future__ import annotations

import math
import statistics
import time

import torch
from tqdm import tqdm

from eval.prefix_workloads import Workload, head
from r2lm import generate
from r2lm.prefix import PrefixCache

POLICIES = ("none", "lru", "arc")


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


def capacity_sweep(config, workloads: list[Workload], working_set: int, factors: list[float], block_tokens: int) -> dict:
    """Per workload, LRU's and ARC's hit rates and evictions replayed at each capacity: factor x the working set,
    rounded up to whole blocks (one block at least)."""
    bt, sweep = block_tokens, {}
    for w in workloads:
        rows = []
        for f in factors:
            cap = max(bt, math.ceil(f * working_set / bt) * bt)
            lru, arc = (replay(config, w, cap, p, bt) for p in ("lru", "arc"))
            rows.append({"factor": f, "capacity_tokens": cap, "lru": lru["token_hit_rate"], "arc": arc["token_hit_rate"],
                         "lru_request": lru["request_hit_rate"], "arc_request": arc["request_hit_rate"],
                         "lru_evictions": lru["evictions"], "arc_evictions": arc["evictions"], "arc_state": arc["arc"]})
        sweep[w.name] = rows
    return sweep

"""Checkpoint placement, studied without a model (`python -m eval.prefix_bench`; its --help states the question
and the issue's target): the recompute that r2lm.prefix.place_checkpoints (the DP) saves against block spacing,
uniform-M and last-only, on an overlap-depth distribution."""

from __future__ import annotations

import math

from tqdm import tqdm

from r2lm.prefix import block_spacing, expected_recompute, last_only, place_checkpoints, uniform


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


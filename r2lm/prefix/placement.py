"""Where to keep exact recurrent-state checkpoints along a cached sequence (sparse prefix caching).

Model (docs/notes/prefix_caching.md section 2). A cached sequence has tokens 1..N; a future request shares its first
d tokens, d ~ P(d). With checkpoints K = {k_1 < ... < k_m} the request resumes from the deepest k_j <= d (or
from the free origin 0) and recomputes the tokens in between, which costs C(d) - C(k_j) for a cumulative cost
C with C(0) = 0 (C(t) = t for a pure SSM; alpha t + beta t(t+1)/2 for a hybrid whose attention grows with
position). Minimising the expected recompute is maximising the gain, which telescopes into

    G(K) = sum_j (C(k_j) - C(k_{j-1})) S(k_j),    k_0 = 0,  S(x) = P(d >= x):

the segment (k_{j-1}, k_j] is saved exactly when the request gets as deep as k_j.

place_checkpoints solves max G(K) over |K| <= M exactly in O(N M) with a monotone convex-hull trick;
place_checkpoints_quadratic is the O(M N^2) form of the same recurrence, kept as the tests' reference.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from itertools import pairwise
from typing import NamedTuple

Fn = Callable | Mapping | Sequence  # a function of a position: called, or indexed by the position
NEG = float("-inf")


class Placement(NamedTuple):
    gain: object  # G(K), in the arithmetic of the inputs (floats, or Fractions for exact tests); None if not asked
    positions: tuple  # the sorted checkpoint positions K


def _at(f: Fn, x):
    return f(x) if callable(f) else f[x]


def _prepare(candidates, cost: Fn, survival: Fn, budget: int):
    """Validated [0] + candidates, C and S on them, and the effective budget."""
    pos = [0] + list(candidates)
    if any(b <= a for a, b in pairwise(pos)):
        raise ValueError(f"candidates must be strictly increasing positive positions, got {list(candidates)}")
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or budget < 0:
        raise ValueError(f"budget must be an integer >= 0, got {budget!r}")
    C = [_at(cost, x) for x in pos]
    if C[0] != 0 or any(b < a for a, b in pairwise(C)):
        raise ValueError("cost must be a cumulative recompute cost: C(0) = 0 and non-decreasing")
    S = [None] + [_at(survival, x) for x in pos[1:]]  # S(0) is never used: the origin is free
    if any(s < 0 for s in S[1:]) or any(b > a for a, b in pairwise(S[1:])):
        raise ValueError("survival must be S(x) = P(depth >= x): non-negative and non-increasing")
    return pos, C, S, min(int(budget), len(pos) - 1)


def _backtrack(pos, back, best) -> Placement:
    gain, m, i = best
    ks = []
    while m > 0:
        ks.append(pos[i])
        i = back[m - 1][i]
        m -= 1
    return Placement(gain, tuple(reversed(ks)))


def place_checkpoints_quadratic(candidates, cost: Fn, survival: Fn, budget: int) -> Placement:
    """Same contract as place_checkpoints, by the plain O(M N^2) recurrence (the reference for the tests)."""
    pos, C, S, M = _prepare(candidates, cost, survival, budget)
    prev = [C[0]] + [NEG] * (len(pos) - 1)  # F_0: only the origin, with gain 0
    best, back = (C[0], 0, 0), []
    for m in range(1, M + 1):
        cur, arg = [NEG] * len(pos), [-1] * len(pos)
        for i in range(m, len(pos)):
            for j in range(m - 1, i):
                if prev[j] == NEG:
                    continue
                v = prev[j] + (C[i] - C[j]) * S[i]
                if v > cur[i]:  # strict: the smallest j wins a tie
                    cur[i], arg[i] = v, j
            if cur[i] > best[0]:  # strict: the fewest checkpoints, then the shallowest last one, win a tie
                best = (cur[i], m, i)
        back.append(arg)
        prev = cur
    return _backtrack(pos, back, best)


def place_checkpoints(candidates, cost: Fn, survival: Fn, budget: int) -> Placement:
    """The checkpoint set K of at most `budget` positions that maximises G(K), exactly, in O(N M).

    candidates: positions where a state can be captured (e.g. chunk ends), strictly increasing, all >= 1.
    cost: C(t), the cumulative cost of recomputing tokens 1..t; a callable or anything indexed by position
        (dict, list, array); non-decreasing with C(0) = 0.
    survival: S(x) = P(depth >= x) for the overlap depth of a future request; callable or indexed;
        non-negative and non-increasing over the candidates.
    budget: M >= 0, the most checkpoints to keep.
    Returns Placement(gain=G(K), positions=K). Ties go the same way as in place_checkpoints_quadratic.

    F_m(i), the best gain with exactly m checkpoints the last at pos[i], is
        F_m(i) = C(i) S(i) + max_j [F_{m-1}(j) - C(j) S(i)],
    the upper envelope of lines y = F_{m-1}(j) - C(j) x at x = S(i). Lines arrive with slopes -C(j) non-
    increasing (pushed on a stack, popping the ones they make useless) and the queries S(i) are non-increasing,
    so the best line only moves forward: O(1) amortised per candidate. Lines are compared at a query with the
    quadratic form's own expression, and the pop test is a cross-multiplication, so with exact inputs (ints,
    Fractions) both forms return identical results; with floats the gains agree to rounding.
    """
    pos, C, S, M = _prepare(candidates, cost, survival, budget)
    prev = [C[0]] + [NEG] * (len(pos) - 1)
    best, back = (C[0], 0, 0), []
    for m in range(1, M + 1):
        cur, arg = [NEG] * len(pos), [-1] * len(pos)
        hull, ptr = [], 0  # indices j of the lines on the upper envelope, by increasing C(j)
        for i in range(m, len(pos)):
            if prev[i - 1] != NEG:
                _push(hull, i - 1, C, prev)
                ptr = min(ptr, len(hull) - 1)
            x = S[i]
            while ptr + 1 < len(hull) and _value(hull[ptr + 1], i, C, x, prev) > _value(hull[ptr], i, C, x, prev):
                ptr += 1  # strict, like the quadratic scan: the earliest of tied lines stays the answer
            cur[i], arg[i] = _value(hull[ptr], i, C, x, prev), hull[ptr]
            if cur[i] > best[0]:
                best = (cur[i], m, i)
        back.append(arg)
        prev = cur
    return _backtrack(pos, back, best)


def _value(j, i, C, x, F):
    return F[j] + (C[i] - C[j]) * x


def _push(hull, j, C, F) -> None:
    """Append line j (y = F[j] - C[j] x) to the envelope, dropping lines that can no longer be strictly best."""
    while hull:
        k = hull[-1]
        if C[k] == C[j]:  # parallel: only the higher one matters; on a tie keep the earlier (smaller j)
            if F[j] <= F[k]:
                return
            hull.pop()
            continue
        if len(hull) >= 2:
            a = hull[-2]  # k is useless iff x(a,k) <= x(k,j): it is never above both neighbours
            if (F[k] - F[a]) * (C[j] - C[k]) <= (F[j] - F[k]) * (C[k] - C[a]):
                hull.pop()
                continue
        break
    hull.append(j)


def expected_gain(positions, cost: Fn, survival: Fn):
    """G(K) = sum_j (C(k_j) - C(k_{j-1})) S(k_j) for a sorted checkpoint set K."""
    ks = [0] + sorted(positions)
    return sum((_at(cost, b) - _at(cost, a)) * _at(survival, b) for a, b in pairwise(ks))


def expected_recompute(positions, cost: Fn, depth_pmf) -> float:
    """R(K) = sum_d P(d) [C(d) - C(c(d))], c(d) the deepest checkpoint <= d (or 0): the objective in recompute
    terms, for benchmarks. depth_pmf is a mapping depth -> probability or a sequence indexed by depth; cost
    must be defined at every depth with positive probability."""
    ks = [0] + sorted(positions)
    items = depth_pmf.items() if isinstance(depth_pmf, Mapping) else enumerate(depth_pmf)
    total = 0.0
    for d, p in items:
        if p:
            resume = ks[_bisect_right(ks, d) - 1]
            total += p * (_at(cost, d) - _at(cost, resume))
    return total


def _bisect_right(xs, v) -> int:
    lo, hi = 0, len(xs)
    while lo < hi:
        mid = (lo + hi) // 2
        if v < xs[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo


# ------------------------------------------------------------------ baselines (notes section 2.4)
# They ignore the depth distribution; pass cost and survival to have their gain filled in for comparison.


def _baseline(positions, cost, survival) -> Placement:
    positions = tuple(sorted(set(positions)))
    gain = expected_gain(positions, cost, survival) if cost is not None and survival is not None else None
    return Placement(gain, positions)


def block_spacing(candidates, every: int, cost: Fn | None = None, survival: Fn | None = None) -> Placement:
    """Block caching: a checkpoint at every multiple of `every` (each snapped down to the last candidate <= it)."""
    if every < 1:
        raise ValueError(f"block spacing needs every >= 1, got {every}")
    cands = sorted(candidates)
    if not cands:
        return _baseline((), cost, survival)
    out = []
    for q in range(every, cands[-1] + 1, every):
        i = _bisect_right(cands, q)
        if i:
            out.append(cands[i - 1])
    return _baseline(out, cost, survival)


def last_only(candidates, cost: Fn | None = None, survival: Fn | None = None) -> Placement:
    """One checkpoint at the end of the entry (Marconi's leaf state, vLLM's chunk-end state)."""
    return _baseline(sorted(candidates)[-1:], cost, survival)


def uniform(candidates, budget: int, cost: Fn | None = None, survival: Fn | None = None) -> Placement:
    """k_j = round(j N / (M + 1)) for j = 1..M, N the last candidate, each snapped to the nearest candidate
    (the shallower one on a tie); duplicates collapse, so fewer than M may come back."""
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    cands = sorted(candidates)
    if not cands:
        return _baseline((), cost, survival)
    n, out = cands[-1], []
    for j in range(1, budget + 1):
        target = (2 * j * n + budget + 1) // (2 * (budget + 1))  # round half up, in integers
        i = _bisect_right(cands, target)
        below, above = (cands[i - 1] if i else None), (cands[i] if i < len(cands) else None)
        if below is None or (above is not None and above - target < target - below):
            out.append(above)
        else:
            out.append(below)
    return _baseline(out, cost, survival)


# ------------------------------------------------------------------ estimating P(d) online


class DepthHistogram:
    """Online estimate of the overlap-depth distribution P(d), d = 0..max_depth, from observed match lengths.

    Each observation decays the old ones by `decay` (effective memory about 1 / (1 - decay) observations), so
    the estimate follows a drifting workload. A Dirichlet prior of `prior` pseudo-observations, spread evenly
    over all depths, keeps unseen depths possible; with no data the estimate is uniform, for which the optimal
    placement under a linear cost is equal spacing, i.e. block caching. Depths beyond max_depth are clipped
    to it (a request cannot match more than the entry holds). Decay is applied lazily: new observations get a
    growing weight instead of rescaling every bin, so observe() is O(1).
    """

    def __init__(self, max_depth: int, decay: float = 0.99, prior: float = 1.0):
        if max_depth < 0:
            raise ValueError(f"max_depth must be >= 0, got {max_depth}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if prior <= 0.0:
            raise ValueError(f"prior must be > 0 so no depth gets probability 0, got {prior}")
        self.max_depth, self.decay, self.prior = max_depth, decay, prior
        self._counts = [0.0] * (max_depth + 1)
        self._mass = 0.0  # sum of _counts
        self._weight = 1.0  # the weight of the next observation, relative to the stored counts
        self._suffix = None  # cached survival table, rebuilt after an observation

    def observe(self, depth: int) -> None:
        if depth < 0:
            raise ValueError(f"an overlap depth is >= 0, got {depth}")
        self._weight /= self.decay
        self._counts[min(int(depth), self.max_depth)] += self._weight
        self._mass += self._weight
        if self._weight > 1e100:  # renormalise before the lazy weights overflow
            self._counts = [c / self._weight for c in self._counts]
            self._mass /= self._weight
            self._weight = 1.0
        self._suffix = None

    @property
    def total(self) -> float:
        """The decayed number of observations."""
        return self._mass / self._weight

    def pmf(self) -> list:
        """P(d) for d = 0..max_depth."""
        bins = self.max_depth + 1
        norm = self._mass / self._weight + self.prior
        return [(c / self._weight + self.prior / bins) / norm for c in self._counts]

    def survival(self, x) -> float:
        """S(x) = P(d >= x); usable directly as place_checkpoints(..., survival=hist.survival, ...)."""
        if self._suffix is None:
            suffix, acc = [0.0] * (self.max_depth + 2), 0.0
            for d, p in reversed(list(enumerate(self.pmf()))):
                acc += p  # accumulating non-negatives keeps S exactly non-increasing in floating point
                suffix[d] = acc
            self._suffix = suffix
        x = max(0, math.ceil(x))
        return self._suffix[min(x, self.max_depth + 1)]

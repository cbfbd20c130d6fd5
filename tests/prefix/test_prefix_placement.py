"""Checkpoint placement: the O(NM) hull DP against the O(MN^2) DP and brute force, the closed-form cases,
the baselines, and the online depth histogram."""

import itertools
import math
import random
from fractions import Fraction

import pytest

from r2lm.prefix import (
    DepthHistogram,
    block_spacing,
    expected_gain,
    expected_recompute,
    last_only,
    place_checkpoints,
    place_checkpoints_quadratic,
    uniform,
)


def suffix_sums(pmf):
    """S(x) = P(d >= x) for x = 0..len(pmf), accumulated from the deep end so it is exactly non-increasing."""
    out, acc = [0] * (len(pmf) + 1), 0
    for d in range(len(pmf) - 1, -1, -1):
        acc += pmf[d]
        out[d] = acc
    return out


def random_cost(rng, length):
    kind = rng.choice(["linear", "hybrid", "steps", "random"])
    if kind == "linear":
        return [t for t in range(length + 1)]
    if kind == "hybrid":  # dense attention KV plus a state: alpha t + beta t(t+1)/2
        a, b = rng.random(), rng.random()
        return [a * t + b * t * (t + 1) / 2 for t in range(length + 1)]
    steps = [0.0] + [rng.choice([0.0, 0.0, rng.random(), 3 * rng.random()]) for _ in range(length)]  # flat runs
    if kind == "random":
        steps = [0.0] + [rng.random() for _ in range(length)]
    return list(itertools.accumulate(steps))


def random_pmf(rng, length):
    kind = rng.choice(["dense", "sparse", "point", "uniform"])
    if kind == "point":
        pmf = [0.0] * (length + 1)
        pmf[rng.randint(0, length)] = 1.0
        return pmf
    if kind == "uniform":
        return [1.0 / (length + 1)] * (length + 1)
    w = [rng.random() ** 3 for _ in range(length + 1)]
    if kind == "sparse":
        w = [x if rng.random() < 0.4 else 0.0 for x in w]
        w[rng.randint(0, length)] += 1.0
    return [x / sum(w) for x in w]


def random_instance(rng):
    length = rng.randint(1, 11)
    size = rng.choice([rng.randint(0, length), length, max(0, length - 3)])
    cands = sorted(rng.sample(range(1, length + 1), size))
    return cands, random_cost(rng, length), random_pmf(rng, length), rng.randint(0, len(cands) + 1)


def brute_force(cands, cost, pmf, budget):
    """Every subset of size <= budget, scored by the untelescoped objective E[C(c(d))]."""
    scored = []
    for m in range(min(budget, len(cands)) + 1):
        for ks in itertools.combinations(cands, m):
            g = sum(p * cost[max([0] + [k for k in ks if k <= d])] for d, p in enumerate(pmf))
            scored.append((g, ks))
    return scored


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def test_fast_equals_quadratic_equals_brute_force_on_random_instances():
    rng = random.Random(0)
    unique = 0
    for _ in range(300):
        cands, cost, pmf, budget = random_instance(rng)
        surv = suffix_sums(pmf)
        fast = place_checkpoints(cands, cost, surv, budget)
        quad = place_checkpoints_quadratic(cands, cost, surv, budget)
        scored = brute_force(cands, cost, pmf, budget)
        best = max(g for g, _ in scored)
        assert close(fast.gain, quad.gain) and close(fast.gain, best), (cands, cost, pmf, budget)
        for got in (fast, quad):  # the positions are legal and really achieve the reported gain
            assert len(got.positions) <= budget and set(got.positions) <= set(cands)
            assert list(got.positions) == sorted(got.positions)
            assert close(expected_gain(got.positions, cost, surv), got.gain)
        optima = [ks for g, ks in scored if close(g, best)]
        if len(optima) == 1:
            unique += 1
            assert fast.positions == quad.positions == optima[0]
    assert unique >= 50  # enough instances pin the positions down, not just the gain


def test_fast_equals_quadratic_exactly_with_ties():
    """Integer costs with flat runs and integer depth weights make many exact ties; in exact arithmetic both DPs
    must return the same gain and break every tie the same way."""
    rng = random.Random(1)
    for _ in range(200):
        length = rng.randint(1, 9)
        cands = sorted(rng.sample(range(1, length + 1), rng.randint(0, length)))
        cost = list(itertools.accumulate([0] + [rng.choice([0, 0, 1, 2]) for _ in range(length)]))
        weights = [rng.choice([0, 0, 1, 1, 2]) for _ in range(length + 1)]
        weights[rng.randint(0, length)] += 1
        pmf = [Fraction(w, sum(weights)) for w in weights]
        surv = suffix_sums(pmf)
        budget = rng.randint(0, len(cands) + 1)
        fast = place_checkpoints(cands, cost, surv, budget)
        quad = place_checkpoints_quadratic(cands, cost, surv, budget)
        assert fast == quad
        assert fast.gain == max(g for g, _ in brute_force(cands, cost, pmf, budget))


def test_fast_equals_quadratic_on_larger_instances():
    """Past brute-force sizes: floats agree on the gain, exact arithmetic on gain and positions."""
    rng = random.Random(2)
    for trial in range(60):
        n = rng.randint(20, 120)
        cands = sorted(rng.sample(range(1, n + 1), rng.randint(1, n)))
        cost, pmf, budget = random_cost(rng, n), random_pmf(rng, n), rng.randint(1, 15)
        if trial % 3 == 0:  # exact: integer costs, rational depth probabilities
            cost = list(itertools.accumulate([0] + [rng.choice([0, 1, 3]) for _ in range(n)]))
            weights = [rng.choice([0, 1, 2, 5]) for _ in range(n)] + [1]
            pmf = [Fraction(w, sum(weights)) for w in weights]
        surv = suffix_sums(pmf)
        fast = place_checkpoints(cands, cost, surv, budget)
        quad = place_checkpoints_quadratic(cands, cost, surv, budget)
        if trial % 3 == 0:
            assert fast == quad
        assert close(fast.gain, quad.gain)
        assert close(expected_gain(fast.positions, cost, surv), quad.gain)


@pytest.mark.parametrize("n,budget", [(12, 2), (12, 3), (12, 5), (60, 4), (60, 9), (240, 11)])
def test_uniform_depth_and_linear_cost_give_equal_spacing(n, budget):
    """Depth uniform over its n values 0..n-1 and C(t) = t: the optimum splits [0, n) into M+1 equal gaps."""
    cands = list(range(1, n + 1))
    surv = [(n - x) / n for x in range(n + 1)]
    got = place_checkpoints(cands, lambda t: t, surv, budget)
    assert got.positions == tuple(j * n // (budget + 1) for j in range(1, budget + 1))
    assert got.positions == uniform(cands, budget).positions  # so the uniform baseline is optimal here
    assert got == place_checkpoints_quadratic(cands, lambda t: t, surv, budget)


@pytest.mark.parametrize("d0", [0, 1, 6, 7, 13, 20])
def test_point_mass_gives_one_checkpoint_at_the_deepest_candidate_below_it(d0):
    cands = [2, 5, 7, 11, 12]
    surv = [1.0 if x <= d0 else 0.0 for x in range(21)]
    for budget in (1, 2, 5):
        got = place_checkpoints(cands, lambda t: 2 * t + t * t, surv, budget)
        below = [k for k in cands if k <= d0]
        assert got.positions == tuple(below[-1:])
        assert close(got.gain, 2 * below[-1] + below[-1] ** 2 if below else 0.0)


def test_budget_zero_and_no_candidates_give_nothing():
    surv = [1.0, 0.5, 0.25, 0.0]
    assert place_checkpoints([1, 2, 3], lambda t: t, surv, 0) == (0, ())
    assert place_checkpoints([], lambda t: t, surv, 3) == (0, ())


def test_gain_is_non_decreasing_and_concave_in_the_budget():
    rng = random.Random(3)
    for _ in range(100):
        cands, cost, pmf, _ = random_instance(rng)
        surv = suffix_sums(pmf)
        v = [place_checkpoints(cands, cost, surv, m).gain for m in range(len(cands) + 1)]
        tol = 1e-9 * max(1.0, abs(v[-1]))
        assert all(v[m + 1] >= v[m] - tol for m in range(len(v) - 1))
        assert all(v[m + 1] - v[m] <= v[m] - v[m - 1] + tol for m in range(1, len(v) - 1))


def test_recompute_and_gain_add_up_to_the_full_cost():
    rng = random.Random(4)
    for _ in range(50):
        cands, cost, pmf, budget = random_instance(rng)
        ks = place_checkpoints(cands, cost, suffix_sums(pmf), budget).positions
        full = sum(p * cost[d] for d, p in enumerate(pmf))
        assert close(expected_recompute(ks, cost, pmf) + expected_gain(ks, cost, suffix_sums(pmf)), full)
    assert expected_recompute([4], lambda t: t, {2: 0.5, 6: 0.5}) == 0.5 * 2 + 0.5 * 2


def test_inputs_are_validated():
    surv = [1.0, 0.5, 0.25, 0.0]
    with pytest.raises(ValueError, match="strictly increasing"):
        place_checkpoints([2, 1], lambda t: t, surv, 1)
    with pytest.raises(ValueError, match="strictly increasing"):
        place_checkpoints([0, 1], lambda t: t, surv, 1)
    with pytest.raises(ValueError, match="C\\(0\\) = 0"):
        place_checkpoints([1, 2], lambda t: t + 1, surv, 1)
    with pytest.raises(ValueError, match="C\\(0\\) = 0"):
        place_checkpoints([1, 2], [0, 2, 1], surv, 1)
    with pytest.raises(ValueError, match="non-increasing"):
        place_checkpoints([1, 2], lambda t: t, [1.0, 0.2, 0.4], 1)
    with pytest.raises(ValueError, match="budget"):
        place_checkpoints([1, 2], lambda t: t, surv, -1)


def test_baselines():
    chunks = list(range(64, 1025, 64))
    assert block_spacing(chunks, 256).positions == (256, 512, 768, 1024)
    assert block_spacing([3, 10, 17, 30], 8).positions == (3, 10, 17)  # 8->3, 16->10, 24->17
    assert last_only(chunks).positions == (1024,)
    assert last_only([]).positions == ()
    assert uniform(chunks, 3).positions == (256, 512, 768)
    assert uniform([1, 2, 9, 10], 2).positions == (2, 9)  # targets 3 and 7, snapped to the nearest
    assert uniform(chunks, 0) == (None, ())
    # With cost and survival the gain is filled in, and the DP at the same budget is never worse.
    rng = random.Random(5)
    for _ in range(50):
        cands, cost, pmf, budget = random_instance(rng)
        if not cands:
            continue
        surv = suffix_sums(pmf)
        for base in (
            block_spacing(cands, rng.randint(1, 4), cost, surv),
            last_only(cands, cost, surv),
            uniform(cands, budget, cost, surv),
        ):
            assert close(base.gain, expected_gain(base.positions, cost, surv))
            best = place_checkpoints(cands, cost, surv, len(base.positions)).gain
            assert best >= base.gain - 1e-12


def test_depth_histogram_converges_to_the_empirical_distribution():
    rng = random.Random(6)
    truth = [0.1, 0.0, 0.3, 0.05, 0.0, 0.55]
    hist = DepthHistogram(max_depth=5, decay=1.0, prior=1.0)
    assert hist.pmf() == pytest.approx([1 / 6] * 6)  # no data: uniform
    for _ in range(20000):
        hist.observe(rng.choices(range(6), truth)[0])
    pmf = hist.pmf()
    assert sum(pmf) == pytest.approx(1.0)
    assert pmf == pytest.approx(truth, abs=0.015)
    assert 0.0 < pmf[1] < 1e-4  # unseen, yet not impossible
    assert [hist.survival(x) for x in range(7)] == pytest.approx(suffix_sums(pmf))
    assert hist.survival(-3) == pytest.approx(1.0) and hist.survival(99) == 0.0
    assert hist.total == pytest.approx(20000)
    ks = place_checkpoints([1, 2, 3, 4, 5], lambda t: t, hist.survival, 2).positions
    assert ks == (2, 5)  # the mass sits at 2 and 5


def test_depth_histogram_decay_forgets_old_depths():
    hist = DepthHistogram(max_depth=9, decay=0.9, prior=0.1)
    for _ in range(200):
        hist.observe(3)
    for _ in range(200):
        hist.observe(7)
    pmf = hist.pmf()
    assert pmf[7] > 0.98
    assert pmf[3] == pytest.approx(pmf[5], rel=1e-6)  # depth 3 is back to the prior, like a never-seen depth
    assert hist.total == pytest.approx(1 / (1 - 0.9), rel=1e-6)
    hist.observe(50)  # deeper than the entry: clipped to max_depth
    assert hist.survival(9) > hist.survival(10) == 0.0


def test_depth_histogram_survives_many_observations_with_fast_decay():
    hist = DepthHistogram(max_depth=4, decay=0.5)  # weights double per observation: must renormalise
    for i in range(5000):
        hist.observe(i % 5)
    pmf = hist.pmf()
    assert all(math.isfinite(p) for p in pmf) and sum(pmf) == pytest.approx(1.0)
    assert pmf[4] > pmf[3] > pmf[2]  # the most recent depths weigh most
    with pytest.raises(ValueError):
        DepthHistogram(4, decay=0.0)
    with pytest.raises(ValueError):
        DepthHistogram(4, prior=0.0)
    with pytest.raises(ValueError):
        hist.observe(-1)

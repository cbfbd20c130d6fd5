"""What the adaptive policy (r2lm.generation.policy) reads of the costs: at each row count, the forwards' and
drafting's prices as measured (r2lm.generation.costs) and as the steps' own wall times show them (StepClock), and
how often a source the estimates rule out is probed at those prices."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

PROBE_BUDGET = 0.01  # probing a source the estimates rule out costs at most this share of AR time


@dataclass(frozen=True)
class Prices:
    """The costs a policy reads at one row count R: the forward widths and their seconds C(R, w), an AR step's
    C(R, 1), the per-row part B of an AR step (C(R, 1) = A + B R), drafting's D(R), and `columns`: C(R, c) for
    c = 1 .. the widest forward with siblings (a forward of width w and k siblings reads w + k columns)."""

    widths: np.ndarray
    verify: np.ndarray
    ar: float
    per_row: float
    draft: float
    columns: np.ndarray


class Pricing:
    """The prices an Adaptive policy decides by (a part of it, by purpose: it reads the policy's `costs`, `scripted`,
    `clock`, `widths`, `most_siblings`, its caches `prices` and `clocked`, its `verdicts`, and whether the step
    drafted)."""

    def measured(self, rows: int) -> Prices:
        """The costs at `rows` rows as measured: read from the cost model once per call (they do not change within
        one unless the forwards are measured again)."""
        key = (self.costs, rows)
        if key not in self.prices:
            c = self.costs
            ar = c.verify(rows, 1)
            per_row = min(max((ar - c.verify(1, 1)) / (rows - 1), 0.0), ar / rows) if rows > 1 else 0.0
            self.prices[key] = Prices(np.array(self.widths), np.array([c.verify(rows, w) for w in self.widths]), ar,
                                      per_row, c.draft(rows),
                                      np.array([c.verify(rows, w) for w in range(1, max(self.widths) + self.most_siblings + 1)]))
        return self.prices[key]

    def price(self, rows: int) -> Prices:
        """The costs at `rows` rows, each forward and drafting at what steps show they cost (made again once the
        clock took in a step, where a decision reads them)."""
        key = (self.costs, rows)
        price = self.measured(rows)
        if self.clocked.get(key, (None,))[0] != self.clock.version:
            own = self.clock.factors()
            self.clocked[key] = self.clock.version, replace(
                price, verify=price.verify * own[price.widths], ar=price.ar * own[1], per_row=price.per_row * own[1],
                draft=price.draft * self.clock.drafting, columns=price.columns * own[1:len(price.columns) + 1])
        return self.clocked[key][1]

    def timed(self, seconds: float, columns: int, rows: int) -> None:
        """A step of `columns` columns over `rows` rows took `seconds`: without the drafter's forward it updates the
        forwards' ratios (overall and its column count's), with it the drafting's (what the step took beyond its
        forward, against the drafting price), where the step before drafted too (after AR steps the drafter first
        appends all their columns: a backlog, not what drafting on costs). Steps far from their price (DISAGREE)
        have the forwards measured again."""
        if self.costs is None or self.scripted is not None:  # costs said, not measured: in no unit of time
            return
        price = self.measured(rows)
        columns = min(columns, len(price.columns))
        forward = price.columns[columns - 1]
        if self.drafting:
            if price.draft > 0 and self.drafted:
                self.clock.drafting_step(seconds, forward, columns, price.draft)
        elif (self.clock.forward_step(seconds, forward, columns)
              and self.costs.remeasure(rows, self.clock.forward, self.clock.seconds)):
            self.prices.clear()  # the new table's prices, and what steps showed re-expressed against them
            self.clocked.clear()
            self.verdicts = {}
            new = self.measured(rows)
            self.clock.rescale(price.columns / new.columns, price.draft / new.draft if new.draft > 0 else 1.0)

    def probe_interval(self, rows: int) -> int:
        """Every n-th step a source the estimates rule out is tried, n such that trying it costs at most
        PROBE_BUDGET of the AR time in between."""
        price = self.price(rows)
        extra = max(price.columns[-1] + price.draft - price.ar, 0.0)
        return math.ceil(extra / (PROBE_BUDGET * price.ar))

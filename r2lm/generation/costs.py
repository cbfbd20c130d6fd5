"""What one step of verified decoding costs on this machine: the seconds of a verification forward by its rows and
width, and of drafting (a drafter's forward and append) by its rows (r2lm.generation.policy weighs them against
expected acceptance).

No machine's constants: `MeasuredCosts` times the forwards themselves, the first time a model decodes with a draft
source at a batch size (a few forwards of each measured width at the call's rows and at one row, on a scratch cache
of the call's prompt length, interleaved, the median of each), and keeps the table for the process, as a
r2lm.ops.linear tuner keeps its decisions. Widths and row counts between the measured ones are interpolated linearly:
a forward's cost is close to affine in its columns and its rows. The measurement never touches the call's cache,
so it changes no output: what verified decoding commits is the target's greedy text whatever the costs are.

`ScriptedCosts` says the costs instead (tests; a user who measured them elsewhere).
"""

from __future__ import annotations

import statistics
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from r2lm.ops.linear import tuner_of

TRIALS = 3  # timed forwards per measured shape, after untimed ones (allocation, kernel choice, product orders)
SETTLE = 40  # at most this many untimed forwards per shape: a model's tuner times its orders in a class's first uses


class StepCosts(ABC):
    """Seconds of the forwards a verification step runs."""

    @abstractmethod
    def verify(self, rows: int, width: int) -> float:
        """A verification forward over `rows` rows that verifies width - 1 draft tokens (width 1: an AR step)."""

    @abstractmethod
    def draft(self, rows: int) -> float:
        """What drafting adds to a step over `rows` rows: the drafter's forward and the append of the step's
        committed column to its context (0 for a source that drafts without a forward of its own)."""


class ScriptedCosts(StepCosts):
    def __init__(self, verify: Callable[[int, int], float], draft: Callable[[int], float] = lambda rows: 0.0):
        self._verify, self._draft = verify, draft

    def verify(self, rows: int, width: int) -> float:
        return float(self._verify(rows, width))

    def draft(self, rows: int) -> float:
        return float(self._draft(rows))


def interpolate(table: dict[int, float], x: int) -> float:
    """The value at x of the piecewise-linear function through `table`'s points (constant slope beyond them)."""
    if x in table:
        return table[x]
    keys = sorted(table)
    if len(keys) == 1:
        return table[keys[0]]
    lo = max([k for k in keys if k < x], default=keys[0])
    hi = min([k for k in keys if k > x], default=keys[-1])
    if lo == hi:  # beyond the points: the slope of the nearest two
        lo, hi = (keys[0], keys[1]) if x < keys[0] else (keys[-2], keys[-1])
    return table[lo] + (table[hi] - table[lo]) * (x - lo) / (hi - lo)


def measured_widths(widest: int) -> list[int]:
    """1, 2, 4, ... and the widest: the widths whose forwards are timed."""
    out, w = [], 1
    while w < widest:
        out.append(w)
        w *= 2
    return [*out, widest]


def timed(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


class MeasuredCosts(StepCosts):
    """The costs of one draft source's forwards for one model, measured here (the module docstring).

    `forward(rows, width)` returns a callable that runs one such forward on a scratch state, `drafting(rows)` one
    that runs the drafter's (None: no drafter): r2lm.generation.drafts builds them with the same code its steps
    run. `models`: the modules those forwards run (the target, its drafter), whose r2lm.ops.linear tuners, if
    installed, must have decided their product orders before a forward is timed."""

    def __init__(self, forward: Callable[[int, int], Callable[[], object]], widths: list[int],
                 drafting: Callable[[int], Callable[[], object]] | None, device: torch.device, models=()):
        self.forward, self.widths, self.drafting, self.device = forward, widths, drafting, device
        self.tuners = {id(t): t for t in map(tuner_of, models) if t is not None}.values()
        self.verify_table: dict[int, dict[int, float]] = {}  # rows -> width -> seconds
        self.draft_table: dict[int, float] = {}  # rows -> seconds

    def measure(self, rows: int) -> None:
        """Time the forwards at `rows` rows (and at one row), unless done before."""
        for r in sorted({1, rows}):
            if r in self.verify_table:
                continue
            runs = {w: self.forward(r, w) for w in self.widths}
            drafting = None if self.drafting is None else self.drafting(r)
            if drafting is not None:
                runs["draft"] = drafting
            for fn in runs.values():  # untimed: until the tuners have decided every product order it uses, which
                for _ in range(SETTLE):  # a forward that times no product shows (classes it never uses do not count)
                    before = self.timings()
                    fn()
                    if self.timings() == before:
                        break
            times: dict = {k: [] for k in runs}
            for _ in range(TRIALS):  # interleaved: a load that comes and goes hits every width alike
                for key, fn in runs.items():
                    times[key].append(timed(fn, self.device))
            self.verify_table[r] = {w: statistics.median(times[w]) for w in self.widths}
            self.draft_table[r] = statistics.median(times["draft"]) if "draft" in times else 0.0

    def timings(self) -> int:
        """Products the models' tuners have timed so far (r2lm.ops.linear.Tuner.timings)."""
        return sum(t.timings() for t in self.tuners)

    def verify(self, rows: int, width: int) -> float:
        by_rows = {r: interpolate(widths, width) for r, widths in self.verify_table.items()}
        return max(interpolate(by_rows, rows), 1e-9)

    def draft(self, rows: int) -> float:
        return max(interpolate(self.draft_table, rows), 0.0)

    def table(self) -> dict:
        """What was measured (for a benchmark's JSON): seconds by rows and width, and of drafting by rows."""
        return {"verify": {str(r): {str(w): s for w, s in t.items()} for r, t in self.verify_table.items()},
                "draft": {str(r): s for r, s in self.draft_table.items()}}


# the tables measured in this process: per model, per (draft source, its shape, threads)
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def kept_costs(model, key: tuple, make: Callable[[], MeasuredCosts]) -> MeasuredCosts:
    """The MeasuredCosts kept for `model` under `key` (with the thread count and dtype), made on first use."""
    tables = _KEPT.setdefault(model, {})
    full = (*key, torch.get_num_threads(), str(model.dtype), str(model.device))
    if full not in tables:
        tables[full] = make()
    return tables[full]


def measured_tables(model) -> dict:
    """Every cost table kept for `model` in this process, by key (the draft source's key, then the thread count,
    dtype and device; for benchmarks' JSON)."""
    return {key: costs.table() for key, costs in _KEPT.get(model, {}).items()}

"""What one step of verified decoding costs on this machine: the seconds of a verification forward by its rows and
width, and of drafting (a drafter's forward and append) by its rows (r2lm.generation.policy weighs them against
expected acceptance).

No machine's constants: `MeasuredCosts` times the forwards themselves, the first time a model decodes with a draft
source at a batch size (a few forwards of every width a step may take, at the call's rows and at one row, on a scratch
cache of the call's prompt length, interleaved, the median of each), and keeps the table for the process, as a
r2lm.ops.linear tuner keeps its decisions; `save` / `load` keep the tables across processes (a file made on another
machine, torch or kernel build is refused), so that a new process does not pay the measurement again in its first
verified call (docs/results.md, "A first call, kept across processes"). Every width, not a few to interpolate between:
a width's cost need not lie on its neighbours' line (its products' orders are its own: docs/results.md, "A forward
width's own cost"), and timing it settles those orders before a step would (a tuner times a new shape class inside the
first forwards that use it). Row counts between the measured ones (the call's and one) are interpolated linearly: a
forward's cost is close to affine in its rows. The measurement never touches the call's cache, so it changes no
output: what verified decoding commits is the target's greedy text whatever the costs are.

A measurement can meet a passing load (another process's seconds on a shared core): kept for the process, it would
misprice every step after it. So a table whose wider forwards came out cheaper than narrower ones (more columns
never cost less, beyond noise) is measured again at once, and the policy asks for a new measurement when the steps
themselves disagree with their prices (`StepClock`, `remeasure`), while re-measuring stays a small share of what the
steps took (REMEASURE_BUDGET: under a load that lasts, a measurement is slowed too, and it runs inside a call).

A step is also more than the forwards timed on a scratch cache (the drafter's context caught up, the step's host
work), and a forward width can cost more than its measured neighbours suggest (its products in orders of its own):
`StepClock` keeps what steps took against their prices, per width, and the policy prices each width at that.

`ScriptedCosts` says the costs instead (tests; a user who measured them elsewhere).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from r2lm.ops.linear import machine, tuner_of
from r2lm.prefix.identity import forward_config

TRIALS = 3  # timed forwards per measured shape, after untimed ones (allocation, kernel choice, product orders)
SETTLE = 40  # at most this many untimed forwards per shape: a model's tuner times its orders in a class's first uses
SLACK = 0.8  # a wider forward timed below this share of a narrower one's cost: the timing met a load, measure again
RETRIES = 2  # at most this many immediate re-measurements of an implausible table
REMEASURES = 3  # at most this many re-measurements a policy may ask of a table
# re-measuring takes at most this share of the time steps took: a measurement is many forwards, and steps that ask for
# one because a load slows them would have it slowed as much, inside a user's call
REMEASURE_BUDGET = 0.05
CLOCK_DECAY = 0.8  # per step: the running ratios of a step's wall time to its price
CLOCK_RANGE = (0.5, 4.0)  # what those ratios may reach (one slow step, a page fault, must not decide alone)
DISAGREE = 2.0  # steps this many times slower or faster than their price: the forwards are measured again


class StepCosts(ABC):
    """Seconds of the forwards a verification step runs."""

    @abstractmethod
    def verify(self, rows: int, width: int) -> float:
        """A verification forward over `rows` rows that verifies width - 1 draft tokens (width 1: an AR step)."""

    @abstractmethod
    def draft(self, rows: int) -> float:
        """What drafting adds to a step over `rows` rows: the drafter's forward and the append of the step's
        committed column to its context (0 for a source that drafts without a forward of its own)."""

    def remeasure(self, rows: int, disagreement: float, decoded: float) -> bool:
        """Time the forwards at `rows` rows again, where steps took `disagreement` times their price and `decoded`
        seconds in all; whether it did (costs that are said, not measured, are never measured again)."""
        return False

    def timings(self) -> int:
        """Products the models' r2lm.ops.linear tuners have timed so far (0: none installed, or costs said): a step
        in which it grew ran the tuner's timing of a product class new to it, not only its forwards."""
        return 0


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


def plausible(widths: dict[int, float]) -> bool:
    """Whether no wider forward was timed well below a narrower one (`widths`: width -> seconds)."""
    costs = [widths[w] for w in sorted(widths)]
    return all(later >= SLACK * max(costs[: i + 1]) for i, later in enumerate(costs))


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
                 drafting: Callable[[int], Callable[[], object]] | None, device: torch.device, models=(),
                 name: str = ""):
        self.forward, self.widths, self.drafting, self.device = forward, widths, drafting, device
        self.name = name  # what `save` writes it under (`kept_costs`): the same forwards in another process
        self.tuners = {id(t): t for t in map(tuner_of, models) if t is not None}.values()
        self.verify_table: dict[int, dict[int, float]] = {}  # rows -> width -> seconds
        self.draft_table: dict[int, float] = {}  # rows -> seconds
        self.remeasures, self.settled = 0, False
        self.spent = 0.0  # seconds its measurements took in this process
        self.remeasuring = 0.0  # of which re-measurements

    def measure(self, rows: int) -> None:
        """Time the forwards at `rows` rows (and at one row), unless done before."""
        start = time.perf_counter()
        for r in sorted({1, rows}):
            if r in self.verify_table:
                continue
            for _ in range(RETRIES + 1):
                self.verify_table[r], self.draft_table[r] = self.time_forwards(r)
                if plausible(self.verify_table[r]):
                    break
        self.spent += time.perf_counter() - start

    def time_forwards(self, rows: int) -> tuple[dict[int, float], float]:
        """The median seconds of each width's forward and of drafting at `rows` rows."""
        runs = {w: self.forward(rows, w) for w in self.widths}
        drafting = None if self.drafting is None else self.drafting(rows)
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
        return ({w: statistics.median(times[w]) for w in self.widths},
                statistics.median(times["draft"]) if "draft" in times else 0.0)

    def remeasure(self, rows: int, disagreement: float, decoded: float) -> bool:
        """Time `rows`' forwards (and one row's) again: steps took `disagreement` (more than DISAGREE, or less than
        its inverse) times their price, as after a measurement that met a passing load. At most REMEASURES times,
        never again once a new measurement moved less than half the way the steps pointed (steps that really differ
        from their forwards, a fixed host cost beside a fast device or a tiny model, are not a measurement's error:
        measuring on would not change it), and only while re-measuring, this one included, stays within
        REMEASURE_BUDGET of the `decoded` seconds steps took: this one is expected to take its forwards' prices, as
        slowed as the steps are."""
        if self.settled or self.remeasures >= REMEASURES:
            return False
        sizes = {1, rows}
        forwards = sum(sum(self.verify(r, w) for w in self.widths) + self.draft(r) for r in sizes)
        if self.remeasuring + (1 + TRIALS) * forwards * max(disagreement, 1.0) > REMEASURE_BUDGET * decoded:
            return False
        before = self.verify(rows, 1)
        for r in sizes:
            self.verify_table.pop(r, None)
            self.draft_table.pop(r, None)
        spent = self.spent
        self.measure(rows)
        self.remeasuring += self.spent - spent
        self.remeasures += 1
        self.settled = math.log(self.verify(rows, 1) / before) / math.log(disagreement) < 0.5
        return True

    def timings(self) -> int:
        """Products the models' tuners have timed so far (r2lm.ops.linear.Tuner.timings)."""
        return sum(t.timings() for t in self.tuners)

    def verify(self, rows: int, width: int) -> float:
        by_rows = {r: interpolate(widths, width) for r, widths in self.verify_table.items()}
        return max(interpolate(by_rows, rows), 1e-9)

    def draft(self, rows: int) -> float:
        return max(interpolate(self.draft_table, rows), 0.0)

    def table(self) -> dict:
        """What was measured (for a benchmark's JSON, and what `save` writes): seconds by rows and width, and of
        drafting by rows; how often steps had it measured again, and whether they will no more."""
        return {"verify": {str(r): {str(w): s for w, s in t.items()} for r, t in self.verify_table.items()},
                "draft": {str(r): s for r, s in self.draft_table.items()},
                "remeasured": self.remeasures, "final": self.settled or self.remeasures >= REMEASURES}

    def adopt(self, table: dict) -> None:
        """Take a `table()` (one `load` read) as if measured here: rows it holds are not measured again, unless steps
        disagree with them (`remeasure`), and not at all where steps had it measured as often as that helps
        ("final": a process's steps that differ from its forwards for a real reason, a fixed host cost, differ in the
        next process too)."""
        self.verify_table, self.draft_table = seconds_of(table)
        self.settled = bool(table["final"])


def seconds_of(table: dict) -> tuple[dict[int, dict[int, float]], dict[int, float]]:
    """A `table()`'s seconds: (verification forwards' by rows and width, drafting's by rows)."""
    return ({int(r): {int(w): float(s) for w, s in t.items()} for r, t in table["verify"].items()},
            {int(r): float(s) for r, s in table["draft"].items()})


class StepClock:
    """What steps show the measured prices to be: running ratios of a step's wall time (from one host sync to the
    next) to its price, for the forwards of each column count c (`columns[c]`, NaN until a step of c columns is
    timed; what prices that width), for all forwards together (`forward`: whether the measurement is in doubt),
    and for drafting (what steps with the drafter's forward took beyond their forward, against its price)."""

    def __init__(self, columns: int):
        self.forward = self.drafting = 1.0
        self.columns = np.full(columns + 1, np.nan)
        self.version = 0  # steps taken into account (what prices read from it are cached by)
        self.seconds = 0.0  # what those steps took
        self.made = (-1, None)  # (version, factors at it): read several times a step
        # how far its ratios have moved, summed over every move (|log| of each): prices read at travel t are within
        # a factor e^(travel - t) of today's (`within`: a policy keeps what it decided without reading them)
        self.travel = 0.0

    def fit(self, columns: int) -> None:
        """Room for forwards of up to `columns` columns (a call verifying more siblings than those before)."""
        if len(self.columns) <= columns:
            self.columns = np.concatenate([self.columns, np.full(columns + 1 - len(self.columns), np.nan)])
            self.version += 1

    def factors(self) -> np.ndarray:
        """[c]: what a forward of c columns takes against its price: its steps' own ratio, or until one is timed AR
        steps' (the measurement taken at its word against an AR step, which is what the policy weighs: AR steps
        that take f times their price while an untried width stayed at its own would make that width look f times
        cheaper than measured); 1 before any. Not the ratio of all forwards: made of the widths chosen, it
        would price an untried cheaper width with them."""
        if self.made[0] != self.version:
            self.made = self.version, np.nan_to_num(self.columns, nan=self.factor(1))
        return self.made[1]

    def prices(self) -> np.ndarray:
        """[c + 1]: every factor a price is multiplied by: `factors()`, then drafting's."""
        return np.append(self.factors(), self.drafting)

    def mark(self) -> tuple[float, np.ndarray]:
        """Where the prices are now, for `within`: (travel, prices())."""
        return self.travel, self.prices()

    def within(self, mark: tuple[float, np.ndarray], band: float) -> tuple[float, np.ndarray] | None:
        """Whether every price moved by less than a factor e^band since `mark`: the mark again (its travel moved up
        to what is known of the prices now), None where one moved that far. The travel since bounds the moves
        without reading the prices (most steps); past the bound they are read."""
        travel, prices = mark
        if self.travel - travel < band:
            return mark
        moved = float(np.abs(np.log(self.prices() / prices)).max())
        return None if moved >= band else (self.travel - moved, prices)

    def factor(self, columns: int) -> float:
        """`factors()[columns]`, without making them all (a step reads one)."""
        own = float(self.columns[columns])
        if own == own:  # (not NaN: a step of that many columns was timed)
            return own
        ar = float(self.columns[1]) if len(self.columns) > 1 else math.nan
        return ar if ar == ar else 1.0

    def forward_step(self, seconds: float, price: float, columns: int) -> bool:
        """A step without drafting, of `columns` columns priced `price`, took `seconds`; whether steps now disagree
        with their prices (DISAGREE)."""
        before = self.factor(columns)  # (for one column, also what each untimed width's factor was)
        self.columns[columns] = after = running(before, seconds / price)
        self.travel += abs(math.log(after / before))
        self.forward = running(self.forward, seconds / price)
        self.version += 1
        self.seconds += seconds
        return not 1 / DISAGREE < self.forward < DISAGREE

    def drafting_step(self, seconds: float, price: float, columns: int, drafting: float) -> None:
        """A step with the drafter's forward, its forward of `columns` columns priced `price` and drafting
        `drafting`, took `seconds`."""
        before = self.drafting
        self.drafting = running(before, (seconds - price * self.factor(columns)) / drafting)
        self.travel += abs(math.log(self.drafting / before))
        self.version += 1
        self.seconds += seconds

    def rescale(self, columns: np.ndarray, drafting: float) -> None:
        """New prices (the forwards measured again): each ratio re-expressed against them (`columns` [c] for 1 ..
        c columns and `drafting`: old price / new), so that what steps showed a width or drafting to take stays what
        they took (drafting's ratio holds the host work beside the drafter's forward: no measurement's error); the
        ratio of all forwards starts again (whether the new measurement is in doubt)."""
        before = self.prices()
        n = min(len(columns), len(self.columns) - 1)
        self.columns[1 : n + 1] = np.clip(self.columns[1 : n + 1] * columns[:n], *CLOCK_RANGE)
        self.drafting = min(max(self.drafting * drafting, CLOCK_RANGE[0]), CLOCK_RANGE[1])
        self.forward = 1.0
        self.version += 1
        self.travel += float(np.abs(np.log(self.prices() / before)).max())


def running(ratio: float, observed: float) -> float:
    """A running ratio of steps' time to their price after one more step (within CLOCK_RANGE)."""
    return min(max(CLOCK_DECAY * ratio + (1 - CLOCK_DECAY) * float(observed), CLOCK_RANGE[0]), CLOCK_RANGE[1])


# the tables measured in this process: per model, per (draft source, its shape, threads)
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOADED: dict[str, dict] = {}  # name -> table(), read by `load`: taken by the first MeasuredCosts of that name
SAVED = ("verify", "draft", "final")  # what a file keeps of a table()


def where(model) -> tuple:
    """What a table holds for beside its forwards: torch's thread count, the model's dtype and device (a GPU by its
    name: `machine` names the CPU)."""
    device = model.device
    named = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    return torch.get_num_threads(), str(model.dtype), named


def cost_name(model, drafter, **forwards) -> str:
    """A MeasuredCosts' name, the same in every process for the same forwards: the architectures of `model` and
    `drafter` (every config field that can change a forward: not the weights, which cost the same whatever they
    hold), what `forwards` says of their shapes, and `where`."""
    def architecture(m):
        return None if m is None else hashlib.blake2b(json.dumps(forward_config(m.config), sort_keys=True).encode(),
                                                      digest_size=8).hexdigest()

    return json.dumps({"model": architecture(model), "drafter": architecture(drafter), **forwards,
                       "where": where(model)}, sort_keys=True)


def kept_costs(model, key: tuple, make: Callable[[], MeasuredCosts]) -> MeasuredCosts:
    """The MeasuredCosts kept for `model` under `key` (with `where`), made on first use, with the table `load` read
    for its name if there is one."""
    tables = _KEPT.setdefault(model, {})
    full = (*key, *where(model))
    if full not in tables:
        costs = tables[full] = make()
        if costs.name in _LOADED:
            costs.adopt(_LOADED[costs.name])
    return tables[full]


def kept_tables() -> dict[str, dict]:
    """Every table this process measured or loaded, by name (what `save` writes)."""
    tables = dict(_LOADED)
    for kept in list(_KEPT.values()):
        for costs in kept.values():
            if costs.name and costs.verify_table:
                table = costs.table()
                tables[costs.name] = {part: table[part] for part in SAVED}
    return tables


def spent() -> float:
    """Seconds this process spent measuring costs (what `save` / `load` spare the next one)."""
    return sum(costs.spent for kept in list(_KEPT.values()) for costs in kept.values())


def save(path: str | Path) -> None:
    """Write every table this process measured or loaded (JSON, replaced whole: a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tables = [{"name": json.loads(name), **table} for name, table in sorted(kept_tables().items())]
    scratch.write_text(json.dumps({"machine": machine(), "tables": tables}, indent=1) + "\n")
    scratch.replace(path)


def load(path: str | Path) -> None:
    """Take the tables `save` wrote in `path`: a model that verifies with the same forwards measures nothing (rows
    a table lacks are measured as usual). A file made on another machine, torch or kernel build is refused."""
    try:
        saved = json.loads(Path(path).read_text())
        made_on = saved["machine"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a file of r2lm verification costs: {e}") from e
    if made_on != machine():
        raise ValueError(f"{path} holds verification costs measured on another machine, torch or kernel build "
                         f"({made_on}; this one is {machine()}): measure them here instead")
    try:
        tables = {json.dumps(t["name"], sort_keys=True): {part: t[part] for part in SAVED} for t in saved["tables"]}
        for table in tables.values():  # numbers where numbers are due, before any is taken
            seconds_of(table)
            if not isinstance(table["final"], bool):
                raise ValueError(f"'final' is {table['final']!r}, not true or false")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a file of r2lm verification costs: {e}") from e
    _LOADED.update(tables)


def measured_tables(model) -> dict:
    """Every cost table kept for `model` in this process, by key (the draft source's key, then the thread count,
    dtype and device; for benchmarks' JSON)."""
    return {key: costs.table() for key, costs in _KEPT.get(model, {}).items()}

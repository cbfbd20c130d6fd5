"""Whether verified decoding makes drafts on the host at all: what they spare against what making them takes.

Making and weighing drafts on the host (lookup's and the n-gram table's drafts, the choice between them and the
drafter, the policy's width) is a cost of its own: small beside a forward, but paid every step, and where every step
ends up an AR step (a batch of 8 on a CPU, where wider forwards cost most) it alone puts verified decoding under AR.
So the adaptive policy (r2lm.generation.policy) weighs it: over the steps at the batch's row count that made drafts
on the host (the latest HORIZON or so, kept across calls like the acceptance estimates), what their choices were
expected to spare (the chosen width's spared seconds beyond its price, less the drafter's price where it ran)
against the seconds making and weighing them took. Where that falls short, it rests: REST steps make no draft at
all (AR steps, without drafting's host work) between two that weigh drafts again, until drafting pays for its host
work again. Where gains come in bursts (a text starts repeating), a rest may see the first of a burst up to REST
steps late.
"""

from __future__ import annotations

import numpy as np

WEIGHED = 32  # steps that made drafts on the host before what they spared and took may decide to rest
HORIZON = 256  # ... weighed over about this many of the latest (gains come in bursts: a text starts repeating)
REST = 4  # steps that make no draft between two that weigh drafts, while drafting spares less than its host work


class HostWork:
    """Per row count, what the steps that made drafts on the host were expected to spare and what making them took
    (seconds, sums fading over HORIZON steps), and how many steps; `hosted` and `weigh` bring a step's, `rests` says
    whether the next step makes drafts."""

    def __init__(self):
        self.sums: dict[int, np.ndarray] = {}  # rows -> [seconds spared, seconds of host work]
        self.steps: dict[int, int] = {}
        self.start()

    def start(self) -> None:
        """A new call: nothing made yet, no rest under way."""
        self.making: tuple[float, bool] | None = None  # the host seconds of the drafts weighed next, the drafter's in them
        self.host = 0.0  # the host seconds of the latest drafts made without the drafter's forward
        self.rested = 0  # steps since drafts were last made, while resting

    def hosted(self, seconds: float, drafter: bool) -> None:
        """Making the next drafts took `seconds` (`drafter`: its forward among them, which the drafter's price counts:
        the host work is then the latest drafts' made without it)."""
        if not drafter:
            self.host = seconds
        self.making = (self.host, drafter)

    def weigh(self, rows: int, spared: float, drafting: float, seconds: float) -> None:
        """The drafts `hosted` told of were chosen at a width expected to spare `spared` seconds beyond its price,
        after `seconds` of choosing; `drafting`: the drafter's price."""
        host, drafter = self.making
        self.making = None
        sums = self.sums.get(rows, np.zeros(2))
        self.sums[rows] = sums * (1 - 1 / HORIZON) + (spared - (drafting if drafter else 0.0), host + seconds)
        self.steps[rows] = self.steps.get(rows, 0) + 1

    def rests(self, rows: int) -> bool:
        """Whether the next step at `rows` rows makes no drafts: where the steps that made them (at least WEIGHED)
        were expected to spare less than making them took, REST steps of every REST + 1."""
        if self.steps.get(rows, 0) < WEIGHED:
            return False
        spared, host = self.sums[rows]
        if spared >= host:
            return False
        self.rested = (self.rested + 1) % (REST + 1)
        return self.rested != 0

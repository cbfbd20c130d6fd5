"""What verified decoding has learnt of a draft source: the share of its tokens verification accepted, by the
source's confidence and the token's place in the draft (r2lm.generation.policy weighs it against measured costs)."""

from __future__ import annotations

import numpy as np

BUCKETS = 10  # confidence buckets of a source's acceptance estimate
POSITIONS = 4  # positions in the draft it tells apart (the first, second, third, any later one)
PRIOR = (1.0, 2.0)  # (accepted, tried) pseudo-counts of a source never observed: an even chance
CELL_PRIOR = 2.0  # pseudo-tries at the pooled rate of a (confidence, position) cell
SOURCE_DECAY = 0.995  # per observation: a source's estimates follow a drifting text slowly


class Acceptance:
    """A draft source's acceptance estimate, kept for a model across calls: pooled over all its tokens (which learns
    within a few steps whether the source is any good), and by confidence bucket and position in the draft (the
    first token, the second, ... POSITIONS - 1 and later: a copied or well-predicted span, once its first token is
    right, tends to go on), each cell drawn towards the pooled rate until it has its own observations."""

    def __init__(self, prior: tuple[float, float] = PRIOR):
        self.prior = np.array(prior)  # (accepted, tried) pseudo-counts before any observation
        self.pooled = self.prior.copy()
        self.accepted = np.zeros((BUCKETS, POSITIONS))
        self.tried = np.zeros((BUCKETS, POSITIONS))
        self.made: np.ndarray | None = None  # `cells()`, made again after each update
        # steps since a costly source last drafted, counted across calls like the estimates: calls shorter than
        # the probe interval still probe it now and then
        self.idle = 0

    @staticmethod
    def cell(confidence: np.ndarray, position: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        bucket = np.minimum((np.clip(confidence, 0, 1) * BUCKETS).astype(np.int64), BUCKETS - 1)
        return bucket, np.minimum(position, POSITIONS - 1)

    def rate(self) -> float:
        """The pooled rate: accepted / tried over every observation, with the prior's pseudo-counts."""
        return float(self.pooled[0] / self.pooled[1])

    def cells(self) -> np.ndarray:
        """[BUCKETS, POSITIONS]: each cell's estimate, drawn towards the pooled rate (a token's: the cell of its
        confidence and position, `cell`)."""
        if self.made is None:
            self.made = (self.accepted + CELL_PRIOR * self.rate()) / (self.tried + CELL_PRIOR)
        return self.made

    def update(self, confidence: np.ndarray, position: np.ndarray, accepted: np.ndarray) -> None:
        decay = SOURCE_DECAY ** max(len(accepted), 1)
        self.pooled = (self.pooled - self.prior) * decay + self.prior + np.array([accepted.sum(), len(accepted)])
        self.accepted *= SOURCE_DECAY
        self.tried *= SOURCE_DECAY
        bucket, position = self.cell(confidence, position)
        flat = bucket * POSITIONS + position  # (np.add.at's per-element loop costs more than its arithmetic here)
        self.accepted += np.bincount(flat, accepted, BUCKETS * POSITIONS).reshape(BUCKETS, POSITIONS)
        self.tried += np.bincount(flat, None, BUCKETS * POSITIONS).reshape(BUCKETS, POSITIONS)
        self.made = None

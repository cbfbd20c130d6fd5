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

    def q(self, confidence: np.ndarray) -> np.ndarray:
        """[R, b] estimates for drafts' tokens (confidence [R, b], positions 0 .. b - 1)."""
        position = np.broadcast_to(np.arange(confidence.shape[1]), confidence.shape)
        index = self.cell(confidence, position)
        return (self.accepted[index] + CELL_PRIOR * self.rate()) / (self.tried[index] + CELL_PRIOR)

    def update(self, confidence: np.ndarray, position: np.ndarray, accepted: np.ndarray) -> None:
        decay = SOURCE_DECAY ** max(len(accepted), 1)
        self.pooled = (self.pooled - self.prior) * decay + self.prior + np.array([accepted.sum(), len(accepted)])
        self.accepted *= SOURCE_DECAY
        self.tried *= SOURCE_DECAY
        index = self.cell(confidence, position)
        np.add.at(self.accepted, index, accepted.astype(np.float64))
        np.add.at(self.tried, index, 1.0)

"""The divergence guard of a training run: which checkpoint is good to restart from.

A checkpoint saved after step N holds the weights after N updates, and the first measure of those weights is step
N + 1's loss. So a checkpoint counts as good only once the step after it ran with a finite loss, finite gradients
and a loss that is not exploding (above EXPLODED times the run's first loss), and only while no step of the run has
exploded before. Until a newer checkpoint is confirmed, the previous good one stays the one the run names when it
stops on a NaN, and it is kept on disk whatever keep_checkpoints says (so the only good checkpoint is never pruned).
Before: the newest checkpoint was named, which a too-large learning rate had already filled with exploded (finite)
weights.

The guard's state travels in every checkpoint's trainer_state.json, so a resumed run still knows the good one.
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# A loss this many times the run's first (or 1, if that is larger) is exploding, not noise: cross-entropy a tenfold
# worse than a model's start is far beyond uniform guessing, while real loss spikes stay within a few times.
EXPLODED = 10.0


class NonFiniteLossError(RuntimeError):
    """The loss (or the gradient norm) became NaN or infinite: the run stops without writing a checkpoint."""


class DivergenceGuard:
    """Tracks the newest good checkpoint (`good`) and the newest one not yet confirmed (`pending`); collective
    state: every rank sees the same (all-reduced) losses, so every rank reaches the same verdicts."""

    def __init__(self, model_dir: Path, good: Path | None = None, pending: Path | None = None,
                 first_loss: float | None = None, exploded_at: int | None = None, speaks: bool = True):
        self.model_dir, self.good, self.pending = model_dir, good, pending
        self.first_loss, self.exploded_at = first_loss, exploded_at
        self.speaks = speaks  # whether this rank logs the verdicts (rank 0: one warning, not one per rank)

    @classmethod
    def resumed(cls, model_dir: Path, checkpoint: Path, state: dict, speaks: bool = True) -> DivergenceGuard:
        """The guard of a run continuing `checkpoint` (trainer state `state`): the checkpoint itself awaits its
        confirmation by the next step; the good one it recorded is still good if it is still on disk."""
        from r2lm.checkpoints import read_state

        guard = state.get("guard") or {}  # checkpoints of an older r2lm recorded none
        good = None
        if guard.get("good"):
            good = Path(checkpoint).parent / guard["good"]
            try:
                read_state(good)
            except ValueError:  # pruned by hand, or damaged: no good checkpoint is known any more
                good = None
        return cls(model_dir, good, Path(checkpoint), guard.get("first_loss"), guard.get("exploded_at"), speaks)

    def state(self) -> dict:
        """What a checkpoint records of the guard (the good checkpoint by its tag: the run folder may move)."""
        return {"good": self.good.name if self.good else None, "first_loss": self.first_loss,
                "exploded_at": self.exploded_at}

    def step_done(self, step: int, loss: float) -> None:
        """Step `step` ended with finite gradients and the finite mean loss `loss`: it confirms the pending
        checkpoint, unless it (or an earlier step) exploded."""
        if self.first_loss is None:
            self.first_loss = loss
        limit = EXPLODED * max(self.first_loss, 1.0)
        if loss > limit and self.exploded_at is None:
            self.exploded_at = step
            if self.speaks:
                logger.warning("loss %.4g at step %d is over %g times the run's first loss %.4g: the run is diverging "
                               "(lower the lr); no checkpoint from now on counts as good, the last good one is %s",
                               loss, step, EXPLODED, self.first_loss, self.good or "none")
        if self.exploded_at is None and self.pending is not None:
            self.good, self.pending = self.pending, None

    def saved(self, checkpoint: Path) -> None:
        self.pending = Path(checkpoint)

    def error(self, problem: str) -> NonFiniteLossError:
        """The error that stops the run on a non-finite loss or gradient, naming the checkpoint to restart from."""
        newer = ""
        if self.pending is not None:
            since = f", the loss exploding since step {self.exploded_at}" if self.exploded_at is not None else ""
            newer = f"{self.pending.name} was saved as the run diverged{since}"
        if self.good is None:
            why = newer or "no checkpoint was written"
            return NonFiniteLossError(f"{problem}: stopping without saving; the last good checkpoint is none ({why}): "
                                      f"start again from the model {self.model_dir} with a lower lr")
        newer = f"the newer {newer}; " if newer else ""
        return NonFiniteLossError(
            f"{problem}: stopping without saving; the last good checkpoint is {self.good} ({newer}a run with another lr "
            f"needs a new output_dir: start it from python -m convert deepspeed-to-hf {self.good} DST)"
        )

    def summary(self) -> None:
        """At the end of a run that exploded without a NaN: say which checkpoint predates it."""
        if self.exploded_at is not None and self.speaks:
            logger.warning("the loss exploded at step %d; later checkpoints and the export hold diverged weights; the "
                           "last good checkpoint is %s", self.exploded_at, self.good or "none")


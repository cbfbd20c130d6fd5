"""The next drafts of the rows still decoding, as verified decoding's draft sources (r2lm.generation.drafts) make
them and its policy (r2lm.generation.policy) reads them: on the device, or on the host."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Proposal:
    """The next draft of every row still decoding: draft [R, b] token ids ([MASK] where none), confidence [R, b]
    (the source's own, in [0, 1]), source [R] (index into the call's `sources` names), and `siblings` [R, K] with
    their confidence: the source's next likeliest tokens for the draft's first one, likeliest first ([MASK] where
    none; K = 0 for a source without them), which a forward may verify beside the draft (r2lm.generation.verify).
    On the device as torch tensors; what the policy reads, on the host as numpy arrays (`host`): the policy's
    arithmetic never waits for the device."""

    draft: torch.Tensor | np.ndarray
    confidence: torch.Tensor | np.ndarray
    source: torch.Tensor | np.ndarray
    siblings: torch.Tensor | np.ndarray | None = None
    sibling_confidence: torch.Tensor | np.ndarray | None = None

    def __post_init__(self):
        if self.siblings is None:  # none: K = 0
            empty = self.draft[:, :0]
            self.siblings, self.sibling_confidence = empty, self.confidence[:, :0]

    def fields(self):
        return self.draft, self.confidence, self.source, self.siblings, self.sibling_confidence

    @classmethod
    def typed(cls, *fields: np.ndarray) -> Proposal:
        """On the host, each field in its dtype (ids int64, confidences float64)."""
        dtypes = (np.int64, np.float64, np.int64, np.int64, np.float64)
        return cls(*(np.asarray(x, dtype=d) for x, d in zip(fields, dtypes, strict=True)))

    def host(self) -> Proposal:
        return Proposal.typed(*(np.asarray(x.tolist()).reshape(tuple(x.shape)) for x in self.fields()))

    def to(self, device) -> Proposal:
        return Proposal(*(torch.as_tensor(x, device=device) for x in self.fields()))

    def rows(self, keep) -> Proposal:
        return Proposal(*(x[keep] for x in self.fields()))

    def where(self, take: np.ndarray, other: Proposal) -> Proposal:
        """Per row (host), `other`'s draft where `take` [R], else this one's."""
        return Proposal(*(np.where(take.reshape(-1, *[1] * (x.ndim - 1)), y, x)
                          for x, y in zip(self.fields(), other.fields(), strict=True)))

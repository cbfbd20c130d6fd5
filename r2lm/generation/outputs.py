"""What generate() returns and what a step callback sees."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput


@dataclass
class GenerateOutput(ModelOutput):
    sequences: torch.LongTensor | None = None  # [batch, prompt + new]: like transformers' generate, padded after a stop
    nfe: int | None = None  # model forwards, prefill included
    steps: int | None = None  # denoising steps (forwards that unmasked tokens)
    new_tokens: int | None = None  # tokens decoded, summed over rows, up to each row's stop

    @property
    def tokens_per_step(self) -> float:
        """Tokens a row accepts per denoising step, averaged over rows."""
        return self.new_tokens / max(self.steps * self.sequences.shape[0], 1)

    @property
    def tokens_per_forward(self) -> float:
        """Tokens a row gains per model forward (prefill included), averaged over rows."""
        return self.new_tokens / max(self.nfe * self.sequences.shape[0], 1)


@dataclass
class StepInfo:
    """What a step callback sees of one denoising step: the block's generated positions [start, start + L)."""

    step: int  # index of the step in the call
    start: int
    masked: torch.Tensor  # [B, L] positions masked before the step
    proposals: torch.Tensor  # [B, L] the token each position would take
    confidence: torch.Tensor  # [B, L]
    accepted: torch.Tensor  # [B, L] positions unmasked by this step
    logits: torch.Tensor  # [B, L, V]

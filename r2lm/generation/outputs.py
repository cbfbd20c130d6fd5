"""What generate() returns and what a step callback sees."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput


@dataclass
class GenerateOutput(ModelOutput):
    sequences: torch.LongTensor | None = None  # [batch, prompt + new]: like transformers' generate, padded after a stop
    nfe: int | None = None  # model forwards, the prompt's included (its own, or shared with the first step)
    steps: int | None = None  # denoising steps (forwards that unmasked tokens)
    new_tokens: int | None = None  # tokens decoded, summed over rows, up to each row's stop
    row_steps: int | None = None  # denoising steps summed over the rows still decoding at each (a stopped row waits)

    @property
    def tokens_per_step(self) -> float:
        """Tokens a row accepts per denoising step it takes part in, averaged over rows (rows that stopped early
        while others decode do not dilute it)."""
        return self.new_tokens / max(self._row_steps, 1)

    @property
    def tokens_per_forward(self) -> float:
        """Tokens a row gains per model forward it takes part in (its denoising steps, plus the forwards every row
        shares: the prefill and any commit that is not fused into a step), averaged over rows."""
        shared = (self.nfe - self.steps) * self.sequences.shape[0]
        return self.new_tokens / max(self._row_steps + shared, 1)

    @property
    def _row_steps(self) -> int:
        return self.row_steps if self.row_steps is not None else self.steps * self.sequences.shape[0]

@dataclass
class StepInfo:
    """What a step callback sees of one denoising step: row b's generated positions [start[b], start[b] + L).

    decode: the block's positions, the same start for every row; verify=True: each row's draft, after the tokens
    it has committed (rows commit their own lengths), `proposals` the draft and `accepted` its tokens that
    verification accepted. A row that has finished shows nothing masked and nothing accepted."""

    step: int  # index of the step in the call
    start: torch.Tensor  # [B] long: each row's first generated position of the step's columns
    masked: torch.Tensor  # [B, L] positions masked before the step (verify=True: the draft's, of rows decoding)
    proposals: torch.Tensor  # [B, L] the token each position would take
    confidence: torch.Tensor  # [B, L]
    accepted: torch.Tensor  # [B, L] positions unmasked by this step (their proposal is committed)
    logits: torch.Tensor  # [B, L, V]


def spread(x: torch.Tensor, rows: torch.Tensor | None, batch: int, fill) -> torch.Tensor:
    """Per-row values of the rows still decoding (`rows`: their indices in the batch; None: every row) as a whole
    batch, `fill` for the rows that left: what a step callback sees once finished rows have left the forwards."""
    if rows is None or x.shape[0] == batch:
        return x
    return x.new_full((batch, *x.shape[1:]), fill).index_copy_(0, rows, x)

"""Prompt-lookup drafts for verified decoding (`generate(..., verify=True, verify_draft="lookup")`).

A row's next tokens are guessed by finding its last few tokens earlier in its own text (prompt and committed
tokens) and copying what followed them there (prompt lookup decoding, Saxena 2023; transformers'
`prompt_lookup_num_tokens`). Text that repeats itself -- code, quoted prompts, a small model's greedy loops --
is drafted for the cost of a few comparisons, with no drafting columns in the forward: a verification forward
reads only the draft's clean columns, about an AR step's cost on a CPU.

Vectorised over the batch (no host synchronisation): each row's text ends at its own length.
"""

from __future__ import annotations

import torch

MAX_NGRAM = 2  # longest suffix matched (transformers' default); shorter ones are tried when it has no match


def lookup_draft(text: torch.Tensor, end: torch.Tensor, size: int, fill: int, max_ngram: int = MAX_NGRAM) -> torch.Tensor:
    """[B, size] drafts: for each row, the `size` tokens that followed the latest earlier occurrence of its last
    n tokens (n = max_ngram, then shorter), cut at the row's end and filled with `fill` after it; all `fill`
    where no suffix recurs.

    text [B, L]: each row's tokens in text[b, :end[b]], negative ids where a column holds no token (left
    padding), whatever after end[b]; end [B] long."""
    batch, length = text.shape
    starts = torch.arange(length, device=text.device)
    found = torch.zeros(batch, dtype=torch.bool, device=text.device)
    source = torch.zeros(batch, dtype=torch.long, device=text.device)  # where each row's continuation starts
    for n in range(min(max_ngram, length - 1), 0, -1):
        suffix = text.gather(1, (end[:, None] - n + torch.arange(n, device=text.device)).clamp(min=0))
        windows = text.unfold(1, n, 1)  # [B, L - n + 1, n]: windows[b, s] = text[b, s : s + n]
        # an earlier occurrence: of real tokens, followed by at least one token of the row's text
        hits = (windows == suffix[:, None]).all(-1) & (suffix >= 0).all(-1, keepdim=True)
        hits &= starts[: length - n + 1] + n < end[:, None]
        latest = torch.where(hits, starts[: length - n + 1], -1).amax(1)
        new = ~found & (latest >= 0)
        source = torch.where(new, latest + n, source)
        found |= new
    at = source[:, None] + torch.arange(size, device=text.device)
    draft = text.gather(1, at.clamp(max=length - 1))
    return torch.where(found[:, None] & (at < end[:, None]), draft, fill)

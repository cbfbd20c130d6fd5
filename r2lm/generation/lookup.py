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
from torch.nn import functional as F

MAX_NGRAM = 2  # longest suffix matched (transformers' default); shorter ones are tried when it has no match


def lookup_draft(text: torch.Tensor, end: torch.Tensor, size: int, fill: int, max_ngram: int = MAX_NGRAM) -> torch.Tensor:
    """[B, size] drafts: for each row, the `size` tokens that followed the latest earlier occurrence of its last
    n tokens (n = max_ngram, then shorter), cut at the row's end and filled with `fill` after it; all `fill`
    where no suffix recurs.

    text [B, L]: each row's tokens in text[b, :end[b]], negative ids where a column holds no token (left
    padding), whatever after end[b]; end [B] long."""
    batch, length = text.shape
    longest = min(max_ngram, length - 1)
    if longest < 1:  # a text of one column: nothing before its last token
        return text.new_full((batch, size), fill)
    positions = torch.arange(length, device=text.device)
    back = torch.arange(longest, device=text.device)
    suffix = text.gather(1, (end[:, None] - 1 - back).clamp(min=0))  # [B, n]: the row's last token, the one before, ..
    same = text[:, None, :] == suffix[:, :, None]  # [B, n, L]
    # an occurrence of the row's last n tokens ending at column p: text[p - i] is the (i+1)-th last token for i < n,
    # of real tokens, and followed by at least one token of the row's text (p + 1 < end): grown one token at a time
    match = positions + 1 < end[:, None]
    latest = []  # [B] per n: the last column p where the last n tokens end earlier, -1 where they do not recur
    for i in range(longest):
        match = match & F.pad(same[:, i, : length - i], (i, 0)) & (suffix[:, i : i + 1] >= 0)
        latest.append(torch.where(match, positions, -1).amax(1))
    latest = torch.stack(latest, 1)  # [B, n]
    n = ((latest >= 0) * (back + 1)).amax(1)  # the longest suffix that recurs (0: none)
    source = latest.gather(1, (n - 1).clamp(min=0)[:, None]) + 1  # where each row's continuation starts
    at = source + torch.arange(size, device=text.device)
    draft = text.gather(1, at.clamp(max=length - 1))
    return torch.where((n > 0)[:, None] & (at < end[:, None]), draft, fill)

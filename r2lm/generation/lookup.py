"""Prompt-lookup drafts for verified decoding (`generate(..., verify=True, verify_draft="lookup")`), and the rows'
text on the host that they (and an n-gram table's drafts, r2lm.ngram) are made from.

A row's next tokens are guessed by finding its last few tokens earlier in its own text (prompt and committed
tokens) and copying what followed them there (prompt lookup decoding, Saxena 2023; transformers'
`prompt_lookup_num_tokens`). Text that repeats itself -- code, quoted prompts, a small model's greedy loops --
is drafted for the cost of a few comparisons, with no drafting columns in the forward: a verification forward
reads only the draft's clean columns, about an AR step's cost on a CPU.

On the host: the loop's one host read per step brings each row's committed tokens anyway (r2lm.generation.verify),
and an index of where each of a row's last 1 .. MAX_NGRAM tokens last occurred, grown with every committed token,
answers in a few dictionary reads what a vectorised search over the whole text on the device answers in dozens of
tensor operations, each a dispatch that costs more than its arithmetic.
"""

from __future__ import annotations

import numpy as np

MAX_NGRAM = 2  # longest suffix matched (transformers' default); shorter ones are tried when it has no match


class RowTexts:
    """Each row's text on the host: its tokens (the prompt's, without padding, then the committed ones) and, for
    the lookup, where each run of 1 .. `max_ngram` tokens last ended with a token of the row's text after it."""

    def __init__(self, rows: list[list[int]], max_ngram: int = MAX_NGRAM):
        self.max_ngram = max_ngram
        self.tokens: list[list[int]] = [[] for _ in rows]
        self.latest: list[dict[tuple[int, ...], int]] = [{} for _ in rows]
        self.extend(rows)

    def extend(self, rows: list[list[int]]) -> None:
        """Append each row's new tokens (rows[r] to row r)."""
        for tokens, latest, new in zip(self.tokens, self.latest, rows, strict=True):
            # a run ending at p is followed by a token of the text once the text is longer than p + 1
            start = len(tokens) - 1
            tokens.extend(new)
            for p in range(max(start, 0), len(tokens) - 1):
                for n in range(1, min(self.max_ngram, p + 1) + 1):
                    latest[tuple(tokens[p - n + 1 : p + 1])] = p

    def keep(self, stay) -> None:
        """Rows that finished leave (`stay` [R] bools)."""
        self.tokens = [t for t, s in zip(self.tokens, stay, strict=True) if s]
        self.latest = [d for d, s in zip(self.latest, stay, strict=True) if s]

    def lookup(self, size: int, fill: int) -> tuple[np.ndarray, np.ndarray]:
        """([R, size] drafts, [R] the length n of the suffix each matched): for each row, the `size` tokens that
        followed the latest earlier occurrence of its last n tokens (n = max_ngram, then shorter), cut at the row's
        end and filled with `fill` after it; all `fill` (n = 0) where no suffix recurs."""
        out = np.full((len(self.tokens), size), fill, dtype=np.int64)
        matched = np.zeros(len(self.tokens), dtype=np.int64)
        for row, (tokens, latest) in enumerate(zip(self.tokens, self.latest, strict=True)):
            for n in range(min(self.max_ngram, len(tokens) - 1), 0, -1):
                at = latest.get(tuple(tokens[-n:]))
                if at is not None:
                    follow = tokens[at + 1 : at + 1 + size]
                    out[row, : len(follow)] = follow
                    matched[row] = n
                    break
        return out, matched

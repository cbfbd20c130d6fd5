"""Prompt-lookup drafts (r2lm.generation.lookup) against a brute-force search written from their description."""

import torch

from r2lm.generation.lookup import lookup_draft

FILL = 99


def brute_force(tokens: list[int], size: int, max_ngram: int) -> list[int]:
    """The tokens after the latest earlier occurrence of the last n tokens (n = max_ngram down to 1), at most
    `size`, padded with FILL; a row of padding (-1) never matches."""
    for n in range(max_ngram, 0, -1):
        if len(tokens) <= n or min(tokens[-n:]) < 0:
            continue
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                follow = tokens[start + n : start + n + size]
                return follow + [FILL] * (size - len(follow))
    return [FILL] * size


def test_lookup_is_the_brute_force_search():
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        batch, width = 4, int(torch.randint(1, 20, (1,), generator=g))
        text = torch.randint(0, 4, (batch, width), generator=g)  # a small vocabulary: many repeats
        end = torch.randint(1, width + 1, (batch,), generator=g)
        pads = torch.randint(0, width, (batch,), generator=g)
        for row in range(batch):
            text[row, : min(int(pads[row]), int(end[row]) - 1)] = -1  # left padding, at least one token left
            text[row, int(end[row]) :] = torch.randint(0, 4, (width - int(end[row]),), generator=g)  # not the text's
        size, max_ngram = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        got = lookup_draft(text, end, size, FILL, max_ngram)
        for row in range(batch):
            tokens = text[row, : int(end[row])].tolist()
            assert got[row].tolist() == brute_force(tokens, size, max_ngram), (trial, row, tokens)


def test_the_longest_suffix_wins_and_the_latest_occurrence():
    text = torch.tensor([[1, 2, 5, 3, 2, 6, 1, 2, 7, 8, 1, 2]])  # "1 2" recurs at 0 and 6, "2" at 1, 4 and 7
    assert lookup_draft(text, torch.tensor([12]), 3, FILL).tolist() == [[7, 8, 1]]
    assert lookup_draft(text, torch.tensor([12]), 3, FILL, max_ngram=1).tolist() == [[7, 8, 1]]
    assert lookup_draft(text, torch.tensor([5]), 3, FILL).tolist() == [[5, 3, 2]]  # no "3 2" before; "2" at 1
    # "1 2" at 0: its continuation is cut at the row's end (the 9 after it is not the row's text)
    assert lookup_draft(torch.tensor([[1, 2, 1, 2, 9]]), torch.tensor([4]), 3, FILL).tolist() == [[1, 2, FILL]]
    assert lookup_draft(torch.tensor([[4, 5, 6]]), torch.tensor([3]), 2, FILL).tolist() == [[FILL, FILL]]

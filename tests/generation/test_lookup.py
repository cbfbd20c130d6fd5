"""Prompt-lookup drafts (r2lm.generation.lookup) against a brute-force search written from their description."""

import torch

from r2lm.generation.lookup import RowTexts

FILL = 99


def brute_force(tokens: list[int], size: int, max_ngram: int) -> tuple[list[int], int]:
    """(the tokens after the latest earlier occurrence of the last n tokens (n = max_ngram down to 1), at most
    `size`, padded with FILL; that n, 0 where none recurs)."""
    for n in range(max_ngram, 0, -1):
        if len(tokens) <= n:
            continue
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                follow = tokens[start + n : start + n + size]
                return follow + [FILL] * (size - len(follow)), n
    return [FILL] * size, 0


def test_lookup_is_the_brute_force_search_as_the_text_grows():
    """Rows of a small vocabulary (many repeats), their text grown by a few tokens at a time as verification commits
    it, a row leaving now and then: every row's draft after every step is the brute-force search's."""
    g = torch.Generator().manual_seed(0)
    for trial in range(100):
        rows = [torch.randint(0, 4, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g).tolist()
                for _ in range(4)]
        size, max_ngram = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        texts = RowTexts(rows, max_ngram)
        for step in range(6):
            got, matched = texts.lookup(size, FILL)
            assert got.shape == (len(rows), size)
            for row, tokens in enumerate(rows):
                want, n = brute_force(tokens, size, max_ngram)
                assert (got[row].tolist(), int(matched[row])) == (want, n), (trial, step, row, tokens)
            new = [torch.randint(0, 4, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist()
                   for _ in rows]  # 0 .. 3 tokens a step (none: a row that is done)
            texts.extend(new)
            rows = [tokens + more for tokens, more in zip(rows, new, strict=True)]
            if step == 3 and len(rows) > 1:
                stay = [True, False] + [True] * (len(rows) - 2)
                texts.keep(stay)
                rows = [tokens for tokens, kept in zip(rows, stay, strict=True) if kept]
        assert texts.tokens == rows


def test_the_longest_suffix_wins_and_the_latest_occurrence():
    def lookup(tokens, size, max_ngram=2):
        return RowTexts([tokens], max_ngram).lookup(size, FILL)[0].tolist()

    text = [1, 2, 5, 3, 2, 6, 1, 2, 7, 8, 1, 2]  # "1 2" recurs at 0 and 6, "2" at 1, 4 and 7
    assert lookup(text, 3) == [[7, 8, 1]]
    assert lookup(text, 3, max_ngram=1) == [[7, 8, 1]]
    assert lookup(text[:5], 3) == [[5, 3, 2]]  # no "3 2" before; "2" at 1
    # "1 2" at 0: its continuation is cut at the row's end
    assert lookup([1, 2, 1, 2], 3) == [[1, 2, FILL]]
    assert lookup([4, 5, 6], 2) == [[FILL, FILL]]

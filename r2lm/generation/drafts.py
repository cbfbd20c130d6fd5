"""Where verified decoding's drafts come from (`generate(..., verify=True, verify_draft=...)`): one interface,
several drafters. Whatever drafts, what is committed is the target's own greedy AR output (r2lm.generation.verify).

    window          the model's own diffusion window (R2LM self-speculation, for models trained for [MASK]): the
                    verification forward also reads one window per way verification can end and pre-drafts the
                    next draft from it (after TiDAR)
    lookup          prompt lookup: what followed the row's last tokens earlier in its own text (r2lm.generation.lookup)
    drafter         a drafter model (r2lm.drafter) reading the target's context features, after each verification
    lookup+drafter  lookup where the row's text has a draft to copy, the drafter elsewhere

A Drafts object runs the verification forward itself (a drafter decides which columns the forward reads and what it
keeps of it) and makes the next draft:

    first()                              the first draft [B, b] ([MASK] where it has none) and its confidence
    verify(opener, draft, width)         the target's logits [B, width, V] at the clean columns
                                         [opener, draft[:, :width - 1]]: AR's next token after each prefix
    next(length, ar, agreed)             the next draft, once each row accepted `agreed` draft tokens and committed
                                         its `length` first tokens of `ar` (AR's greedy tokens at the columns)
    keep_rows(stay)                      rows that finished leave
    prepare_shapes()                     the forward shapes the loop will run (built before its first step)

`state` (r2lm.generation.verify.Verification) holds the rows' text, their committed lengths and the context.
"""

from __future__ import annotations

import torch

from r2lm.generation.lookup import lookup_draft
from r2lm.generation.sampling import propose
from r2lm.layout import Layout

DRAFTS = ("window", "lookup", "drafter", "lookup+drafter")


def verify_layout(b: int, outcomes: list[int], device=None) -> Layout:
    """The columns of one verification forward, positions relative to the cache's next position: clean column j
    at position j in chunk 2j + 1 (so it sees the clean columns before it), then for each j in `outcomes` window j
    at positions j .. j + b - 1 in chunk 2j (so it sees the clean columns before position j)."""
    one, window = torch.ones(1, 1, device=device), torch.ones(1, b, device=device)
    clean = [Layout.span(one, start=j, chunk=2 * j + 1) for j in range(b)]
    windows = [Layout.span(window, start=j, noisy=True, chunk=2 * j) for j in outcomes]
    return Layout.cat(*clean, *windows)


def drafted_outcomes(b: int, windows: int | None) -> list[int]:
    """The accepted lengths whose next draft a verification forward reads, `windows` of them (default all b + 1).
    Fewer: 0 .. windows - 2 (early rejections) and b - 1 (a draft whose last token is a [MASK] accepted up to it:
    the steady state of a good drafter, committing b tokens); window b only serves a draft of b real tokens, which
    only window b writes."""
    if windows is None or windows > b:
        return list(range(b + 1))
    return [*range(windows - 1), b - 1]


class CleanDrafts:
    """Drafts made between forwards: the verification forward reads the clean columns alone (b of them, or one, an
    AR step, where no row still decoding has a draft token)."""

    capture: tuple[int, ...] = ()

    def __init__(self, state):
        self.state = state
        device = state.device
        self.wide = verify_layout(state.b, [], device)
        self.narrow = verify_layout(1, [], device)

    def prepare_shapes(self) -> None:
        for shape in (self.wide, self.narrow):
            self.state.reader.prepare(shape.length, shape.length, shape)

    def verify(self, opener, draft, width):
        ids = torch.cat([opener, draft[:, : width - 1]], 1)
        out = self.state.context.read_draft(ids, self.wide if width == self.state.b else self.narrow, self.capture)
        if not self.capture:
            return out
        logits, captured, head = out
        self.seen = (captured, head)
        return logits

    def keep_rows(self, stay) -> None:
        pass


class LookupDrafts(CleanDrafts):
    """Prompt lookup: no model runs to draft."""

    def first(self):
        return self.looked_up()

    def next(self, length, ar, agreed):
        return self.looked_up()

    def looked_up(self):
        s = self.state
        draft = lookup_draft(s.text[s.rows], s.prompt_len + s.written[s.rows], s.b, s.mask_id)
        return draft, (draft != s.mask_id).float()


class ModelDrafts(CleanDrafts):
    """A drafter model (r2lm.drafter) reading the target's outputs at its feature layers, captured by every
    verification forward: the committed columns' go into the drafter's context cache (as the target's keys go into
    the target's), then it drafts from the new last committed token. The first forward appends the prompt and
    takes AR's first token (no draft yet: the drafter needs the prompt's features)."""

    def __init__(self, state, drafter, lookup: bool = False):
        super().__init__(state)
        self.drafter, self.lookup = drafter.bind(state.model), lookup
        self.capture = tuple(drafter.config.feature_layers)
        # the drafter's context grows by every column a forward reads (a row's uncommitted ones invalid), at most b
        # per committed token, then a block's scratch
        self.context = drafter.new_context(state.batch, state.prompt_len + (state.n + 2) * state.b)

    def first(self):
        s = self.state
        if self.lookup:  # the prompt may already repeat itself
            draft = lookup_draft(s.text, s.prompt_len + s.written, s.b, s.mask_id)
        else:
            draft = torch.full((s.batch, s.b), s.mask_id, dtype=torch.long, device=s.device)
        return draft, (draft != s.mask_id).float()

    def next(self, length, ar, agreed):
        s = self.state
        captured, head = self.seen
        # every column the forward read, those a row did not commit invalid (no host sync to trim them)
        kept = torch.arange(captured[0].shape[1] - (0 if head is None else head.shape[1]), device=s.device)
        kept = kept < length[:, None]
        self.drafter.append(self.context, captured, kept if head is None else torch.cat([head, kept], 1))
        opener = ar.gather(1, (length - 1).clamp(min=0)[:, None])[:, 0]
        copied = None
        if self.lookup:  # a row whose text repeats itself copies it; the drafter drafts only if some row has no copy
            copied = lookup_draft(s.text[s.rows], s.prompt_len + s.written[s.rows], s.b, s.mask_id)
            if bool((copied[:, 0] != s.mask_id).all()):  # (one more read of the host, in this mode only)
                return copied, torch.ones_like(copied, dtype=torch.float)
        draft = self.drafter.draft(self.context, opener)[:, : s.b]  # (a block_size below the drafter's: cut)
        if draft.shape[1] < s.b:  # (above: [MASK] after the drafter's block)
            draft = torch.cat([draft, draft.new_full((draft.shape[0], s.b - draft.shape[1]), s.mask_id)], 1)
        if copied is not None:
            draft = torch.where((copied[:, :1] != s.mask_id), copied, draft)
        return draft, torch.ones_like(draft, dtype=torch.float)

    def keep_rows(self, stay) -> None:
        self.context.keep_rows(stay)


class WindowDrafts:
    """The model's own window: one forward verifies the draft and, for every way that verification can end, reads
    the window that drafts what follows (r2lm.generation.verify's docstring has the arithmetic)."""

    def __init__(self, state, windows: int | None):
        self.state = state
        b = state.b
        self.outcomes = drafted_outcomes(b, windows)
        self.layout = verify_layout(b, self.outcomes, state.device)
        self.openers = torch.tensor(self.outcomes, dtype=torch.long, device=state.device)
        self.windows = torch.full((state.batch, len(self.outcomes), b), state.mask_id, dtype=torch.long,
                                  device=state.device)  # window j: [t_j, [MASK] * (b - 1)]
        self.cols = torch.arange(b, device=state.device)
        self.h = None

    def prepare_shapes(self) -> None:
        self.state.reader.prepare(self.layout.length, self.state.b, self.layout)

    def first(self):
        s = self.state
        window = torch.cat([s.input_ids[:, -1:], self.windows[:, 0, 1:]], 1)
        return propose(s.context.read(0, window, s.b, clean=False), s.mask_id)

    def verify(self, opener, draft, width):
        s = self.state
        t = torch.cat([opener, draft], 1)
        self.windows[:, :, 0] = t[:, self.openers]
        self.h = s.reader.read(torch.cat([t[:, : s.b], self.windows.flatten(1)], 1), s.b, keep=slice(None),
                               advance=False, layout=self.layout, head=False)
        return s.model.lm_head(self.h[:, : s.b])

    def next(self, length, ar, agreed):
        """The proposals of the latest drafted window opened at or before the row's accepted length k, from the first
        uncommitted position on, [MASK] after them (only the chosen window goes through the LM head)."""
        s, b, h = self.state, self.state.b, self.h
        source = (self.openers <= agreed[:, None]).sum(1) - 1
        chosen = (b * (source + 1))[:, None] + self.cols
        guess, confidence = propose(s.model.lm_head(h.gather(1, chosen[..., None].expand(-1, -1, h.shape[-1]))),
                                    s.mask_id)
        ahead = (length - self.openers[source])[:, None] + self.cols  # window column of each next draft position
        inside = ahead < b  # (a row that is done has length 0: its draft is never read)
        ahead = ahead.clamp(0, b - 1)
        return (torch.where(inside, guess.gather(1, ahead), s.mask_id),
                torch.where(inside, confidence.gather(1, ahead), 0.0))

    def keep_rows(self, stay) -> None:
        self.windows = self.windows[stay]

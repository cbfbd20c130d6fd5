"""Where verified decoding's drafts come from (`generate(..., verify=True, verify_draft=...)`): one interface,
several drafters, one registry (DRAFTS). Whatever drafts, what is committed is the target's own greedy AR output
(r2lm.generation.verify), and how much of a draft each step submits is the policy's (r2lm.generation.policy).

    window          the model's own diffusion window (R2LM self-speculation, for models trained for [MASK]): the
                    verification forward also reads one window per way verification can end and pre-drafts the
                    next draft from it (after TiDAR)
    lookup          prompt lookup: what followed the row's last tokens earlier in its own text (r2lm.generation.lookup)
    ngram           an n-gram table (r2lm.ngram): what most often followed the row's last tokens in a corpus
    lookup+ngram    per row, lookup's draft or the table's, whichever the policy expects to commit more
    drafter         a drafter model (r2lm.drafter) reading the target's context features, after each verification
    lookup+drafter  per row, lookup's draft or the drafter's, whichever the policy expects to commit more
    lookup+ngram+drafter   the three: the drafter runs only where the policy expects it to beat the other two

lookup and ngram cost no forward (FREE): where a kind has both, the policy picks per row between them on the host.

A Drafts object runs the verification forward itself (a drafter decides which columns the forward reads and what it
keeps of it) and proposes the next drafts (a policy.Proposal: tokens, the source's confidence, which source):

    sources, widths                      its draft sources' names; the forward widths it can run (1 = an AR step)
    siblings                             the most siblings a forward may verify beside a draft (0 but a drafter's)
    first()                              the first proposal ([MASK] where it has none)
    width(proposal)                      the next forward's width (the policy's choice)
    siblings_for(proposal, width)        how many siblings it verifies beside the draft (the policy's choice)
    verify(opener, draft, width, sib)    the target's logits [B, width + k, V] at the clean columns
                                         [opener, draft[:, :width - 1]]: AR's next token after each prefix, then
                                         at the k siblings `sib` [B, k], each after the opener alone
    relocate(source, width)              an accepted sibling's column (source [B]) takes the draft's first one's
    next(length, ar, agreed)             the next proposal, once each row accepted `agreed` draft tokens and
                                         committed its `length` first tokens of `ar` (AR's greedy tokens)
    keep_rows(stay)                      rows that finished leave
    prepare_shapes()                     the forward shapes the loop will run (built before its first step)
    costs()                              what its forwards cost here (r2lm.generation.costs), measured once

`state` (r2lm.generation.verify.Verification) holds the rows' text, their committed lengths and the context.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from r2lm.cache import KVCache
from r2lm.generation.costs import MeasuredCosts, kept_costs
from r2lm.generation.lookup import lookup_draft
from r2lm.generation.policy import Policy, Proposal
from r2lm.generation.sampling import propose
from r2lm.generation.window import WindowReader
from r2lm.layout import Layout

FREE = ("lookup", "ngram")  # sources that draft without a forward of their own
COST_CONTEXT = 64  # the shortest context a cost is measured over (a forward's cost barely depends on it here)


def verify_layout(b: int, outcomes: list[int], device=None, siblings: int = 0) -> Layout:
    """The columns of one verification forward, positions relative to the cache's next position: clean column j
    at position j in chunk 2j + 1 (so it sees the clean columns before it), then for each j in `outcomes` window j
    at positions j .. j + b - 1 in chunk 2j (so it sees the clean columns before position j), then `siblings` clean
    columns at position 1 in chunk 2, each on a branch of its own (so each sees the opener and itself, and no
    column sees it but itself: the other candidates for the draft's first token)."""
    one, window = torch.ones(1, 1, device=device), torch.ones(1, b, device=device)
    clean = [Layout.span(one, start=j, chunk=2 * j + 1) for j in range(b)]
    windows = [Layout.span(window, start=j, noisy=True, chunk=2 * j) for j in outcomes]
    if siblings:
        if outcomes or b < 2:
            raise ValueError("siblings stand in for a draft's first token: a clean draft of 2 columns or more")
        clean.append(Layout(positions=torch.ones(1, siblings, dtype=torch.long, device=device),
                            chunks=torch.full((siblings,), 2, device=device),
                            noisy=torch.zeros(siblings, dtype=torch.bool, device=device),
                            window_columns=slice(0, 0), branches=torch.arange(1, siblings + 1, device=device)))
    return Layout.cat(*clean, *windows)


def drafted_outcomes(b: int, windows: int | None) -> list[int]:
    """The accepted lengths whose next draft a verification forward reads, `windows` of them (default all b + 1).
    Fewer: 0 .. windows - 2 (early rejections) and b - 1 (a draft whose last token is a [MASK] accepted up to it:
    the steady state of a good drafter, committing b tokens); window b only serves a draft of b real tokens, which
    only window b writes."""
    if windows is None or windows > b:
        return list(range(b + 1))
    return [*range(windows - 1), b - 1]


def scratch_reader(model, rows: int, context: int, room: int) -> WindowReader:
    """A reader over a cache of `rows` rows holding `context` tokens (for timing forwards: never the call's own)."""
    cache = KVCache(model.config, rows, context + room, model.dtype, model.device)
    reader = WindowReader(model, cache)
    reader.read(torch.zeros(rows, context, dtype=torch.long, device=model.device), context,
                keep=slice(context - 1, context))
    return reader


class Drafts(ABC):
    """The draft sources of one verify=True call and the verification forward they need (the module docstring)."""

    sources: tuple[str, ...]
    capture: tuple[int, ...] = ()  # target layers whose outputs the forward returns too (a drafter's context)
    siblings = 0  # the most siblings a forward may verify beside a draft

    def __init__(self, state, policy: Policy, verifying):
        self.state, self.policy, self.verifying = state, policy, verifying
        self.empty: tuple[int, Proposal] | None = None  # (rows, `nothing`'s proposal for that many rows)

    @staticmethod
    def room(verifying) -> int:
        """Cache columns one verification forward may write past the committed text (its widest shape)."""
        return verifying.block_size + verifying.siblings

    @property
    @abstractmethod
    def widths(self) -> tuple[int, ...]: ...

    @abstractmethod
    def first(self) -> Proposal: ...

    @abstractmethod
    def verify(self, opener: torch.Tensor, draft: torch.Tensor, width: int,
               siblings: torch.Tensor | None = None) -> torch.Tensor: ...

    @abstractmethod
    def next(self, length: torch.Tensor, ar: torch.Tensor, agreed: torch.Tensor) -> Proposal: ...

    @abstractmethod
    def timed_forward(self, reader: WindowReader, width: int):
        """A callable running one verification forward of `width` on a scratch reader (as `verify` does)."""

    def timed_drafting(self, rows: int):
        """A callable running one drafting forward over `rows` rows on scratch state; None without one."""
        return None

    def width(self, proposal: Proposal) -> int:
        return self.policy.width(proposal)

    def siblings_for(self, proposal: Proposal, width: int) -> int:
        """The siblings the next forward verifies (none in the first, which appends the prompt as one chain)."""
        if not self.siblings or width < 2 or self.state.context.head is not None:
            return 0
        return min(self.policy.siblings(proposal, width), self.siblings)

    def relocate(self, source: torch.Tensor, width: int) -> None:
        return  # by default a source keeps nothing of the forward's columns

    def keep_rows(self, stay: torch.Tensor) -> None:
        return  # by default a source keeps nothing per row

    def prepare_shapes(self) -> None:
        return  # by default its shapes are built on first use

    def costs(self) -> MeasuredCosts:
        """What this call's forwards cost on this machine: measured the first time the model verifies with these
        sources at this draft length and batch size, then kept (r2lm.generation.costs)."""
        s = self.state
        context = max(s.prompt_len, COST_CONTEXT)
        room = self.room(self.verifying)

        def forward(rows: int, width: int):
            return self.timed_forward(scratch_reader(s.model, rows, context, room), width)

        widest = max(self.widths) + self.siblings  # a forward of width w and k siblings reads w + k columns
        widths = list(range(1, widest + 1)) if len(self.widths) > 2 else list(self.widths)
        drafter = getattr(self, "drafter", None)
        models = (s.model,) if drafter is None else (s.model, drafter)  # whose product orders must settle first
        costs = kept_costs(s.model, self.key, lambda: MeasuredCosts(forward, widths, self.timed_drafting, s.device,
                                                               models))
        costs.measure(s.batch)
        return costs

    @property
    def key(self) -> tuple:
        """What its costs and its acceptance are kept for, beside the model: the kind of forward, the draft length,
        the drafter and the n-gram table (another drafter or table accepts differently)."""
        return (type(self).__name__, self.state.b, self.capture, tuple(getattr(self, "outcomes", ())),
                id(getattr(self, "drafter", None)), id(self.verifying.ngram))

    def proposal(self, draft: torch.Tensor, confidence: torch.Tensor, source: str, siblings: torch.Tensor | None = None,
                 sibling_confidence: torch.Tensor | None = None) -> Proposal:
        if siblings is None:  # the call's K siblings, none of them real
            siblings = draft.new_full((draft.shape[0], self.siblings), self.state.mask_id)
            sibling_confidence = confidence.new_zeros(draft.shape[0], self.siblings)
        return Proposal(draft, confidence, torch.full((draft.shape[0],), self.sources.index(source), dtype=torch.long,
                                                      device=draft.device), siblings, sibling_confidence)

    def nothing(self) -> Proposal:
        """No draft for any row (the next forward is an AR step unless a source drafts inside it): one per row count,
        made once (never written to), as it is the proposal of every step where drafting does not pay."""
        s = self.state
        rows = len(s.rows)
        if self.empty is None or self.empty[0] != rows:
            draft = torch.full((rows, s.b), s.mask_id, dtype=torch.long, device=s.device)
            self.empty = rows, self.proposal(draft, torch.zeros(draft.shape, device=s.device), self.sources[0])
        return self.empty[1]


class CleanDrafts(Drafts):
    """Drafts made between forwards: the verification forward reads the clean columns alone, as many as the policy
    chose (1, an AR step, when no row's draft is worth verifying)."""

    def __init__(self, state, policy: Policy, verifying):
        super().__init__(state, policy, verifying)
        self.layouts = {(w, k): verify_layout(w, [], state.device, k) for w in self.widths
                        for k in range(self.siblings + 1 if w >= 2 else 1)}

    @property
    def widths(self) -> tuple[int, ...]:
        """Every width; under compile=True only an AR step's and the whole draft's (each shape compiles once)."""
        b = self.state.b
        return (1, b) if self.state.r.caching.compile and b > 1 else tuple(range(1, b + 1))

    def prepare_shapes(self) -> None:
        for layout in self.layouts.values():
            self.state.reader.prepare(layout.length, layout.length, layout)

    def verify(self, opener, draft, width, siblings=None):
        k = 0 if siblings is None else siblings.shape[1]
        ids = torch.cat([opener, draft[:, : width - 1], *([] if siblings is None else [siblings])], 1)
        out = self.state.context.read_draft(ids, self.layouts[width, k], self.capture)
        if not self.capture:
            return out
        logits, captured, head = out
        self.seen = (captured, head)
        return logits

    def relocate(self, source, width):
        """The captured outputs: the accepted sibling's in the draft's first column, the siblings' dropped."""
        if not self.capture:
            return
        captured, head = self.seen
        at = 1 + (0 if head is None else head.shape[1])  # the draft's first column, after the prompt's head
        index = (source + at - 1)[:, None, None]
        moved = [torch.cat([h[:, :at], h.gather(1, index.expand(-1, 1, h.shape[2])), h[:, at + 1 : at - 1 + width]], 1)
                 for h in captured]
        self.seen = (moved, head)

    def timed_forward(self, reader, width):
        ids = torch.zeros(reader.cache.batch_size, width, dtype=torch.long, device=reader.cache.valid.device)
        layout = verify_layout(width, [], ids.device)
        return lambda: reader.read(ids, width, keep=slice(None), advance=False, layout=layout, capture=self.capture)

    def looked_up(self) -> Proposal:
        s = self.state
        draft = lookup_draft(s.text[s.rows], s.prompt_len + s.written[s.rows], s.b, s.mask_id)
        return self.proposal(draft, (draft != s.mask_id).float(), "lookup")

    def tabled(self) -> Proposal:
        s = self.state
        draft, confidence = self.verifying.ngram.draft(s.text[s.rows], s.prompt_len + s.written[s.rows], s.b,
                                                       s.mask_id)
        return self.proposal(draft, confidence, "ngram")

    def free(self) -> Proposal | None:
        """The drafts at hand without a forward: the free sources' (FREE), per row the one the policy expects to
        commit more where there are two (read on the host: a second host read per iteration, in those kinds only);
        None for a kind without any."""
        made = [self.looked_up() if name == "lookup" else self.tabled() for name in self.sources if name in FREE]
        if len(made) < 2:
            return made[0] if made else None
        return self.policy.choose([proposal.host() for proposal in made]).to(self.state.device)


class FreeDrafts(CleanDrafts):
    """Drafts that cost no forward (prompt lookup, an n-gram table): no model runs to draft."""

    def first(self):
        return self.free()

    def next(self, length, ar, agreed):
        return self.free()


class LookupDrafts(FreeDrafts):
    sources = ("lookup",)


class NGramDrafts(FreeDrafts):
    sources = ("ngram",)


class LookupNGramDrafts(FreeDrafts):
    sources = ("lookup", "ngram")


class ModelDrafts(CleanDrafts):
    """A drafter model (r2lm.drafter) reading the target's outputs at its feature layers, captured by every
    verification forward: the committed columns' go into the drafter's context cache (as the target's keys go into
    the target's), then, where the policy finds it worth its forward, it drafts from the new last committed token.
    The first forward appends the prompt and takes AR's first token (the drafter needs the prompt's features).

    The captured columns are appended when the drafter next drafts, all at once (the same keys and values, in the
    same positions): while the policy finds the drafter not worth its forward, the steps cost what AR steps do."""

    sources = ("drafter",)

    def __init__(self, state, policy: Policy, verifying):
        drafter = verifying.drafter
        self.drafter = drafter.bind(state.model)
        self.capture = tuple(drafter.config.feature_layers)
        # (not under compile=True: each count of siblings is a forward shape of its own)
        self.siblings = 0 if state.r.caching.compile else verifying.siblings
        super().__init__(state, policy, verifying)
        # the drafter's context grows by every column a forward reads (a row's uncommitted ones invalid), at most b
        # per committed token, then the scratch of the drafter's own block (which may be longer than the call's b):
        # it starts at what AR steps need and grows as it is appended to (catch_up)
        self.context = drafter.new_context(state.batch, state.prompt_len + state.n + 2 * state.b
                                           + drafter.config.block_size)
        self.pending: list[tuple[list[torch.Tensor], torch.Tensor]] = []  # (captured, valid) not appended yet

    def first(self):
        return self.free() or self.nothing()

    def next(self, length, ar, agreed):
        s = self.state
        captured, head = self.seen
        # every column the forward read, those a row did not commit invalid (no host sync to trim them)
        kept = torch.arange(captured[0].shape[1] - (0 if head is None else head.shape[1]), device=s.device)
        kept = kept < length[:, None]
        self.pending.append((captured, kept if head is None else torch.cat([head, kept], 1)))
        free = self.free()
        # (with lookup, the policy reads its drafts on the host: a second host read per iteration, in this mode only)
        at_hand = None if free is None else free.host()
        if not self.policy.worth("drafter", at_hand, len(s.rows)):
            return free if free is not None else self.nothing()
        self.catch_up()
        opener = ar.gather(1, (length - 1).clamp(min=0)[:, None])[:, 0]
        drafted = self.drafted(opener)
        return drafted if free is None else self.policy.choose([at_hand, drafted.host()]).to(s.device)

    def drafted(self, opener: torch.Tensor) -> Proposal:
        """The drafter's proposal after `opener` [R] (its block and, where the call verifies siblings, theirs)."""
        s = self.state
        draft, confidence, *siblings = self.drafter.draft(self.context, opener, confidence=True, siblings=self.siblings)
        return self.proposal(*fit(draft, confidence, s.b, s.mask_id), "drafter", *siblings)

    def timed_drafting(self, rows: int):
        s, drafter = self.state, self.drafter
        length = max(s.prompt_len, COST_CONTEXT)
        context = drafter.new_context(rows, length + 1 + drafter.config.block_size)
        hidden = drafter.config.target_hidden_size
        captured = [torch.zeros(rows, length, hidden, dtype=s.model.dtype, device=s.device) for _ in self.capture]
        drafter.append(context, captured)
        openers = torch.zeros(rows, dtype=torch.long, device=s.device)
        column = [h[:, :1] for h in captured]

        def run():  # what drafting adds to a step: the new column appended (catch_up), then the draft
            drafter.append(context, column)
            out = drafter.draft(context, openers, confidence=True, siblings=self.siblings)
            context.kv.rewind(length)
            return out

        return run

    def catch_up(self) -> None:
        """Append every column captured since the drafter last drafted."""
        if len(self.pending) == 1:
            captured, valid = self.pending[0]
        else:
            captured = [torch.cat(layer, 1) for layer in zip(*(c for c, _ in self.pending), strict=True)]
            valid = torch.cat([v for _, v in self.pending], 1)
        self.context.kv.reserve(valid.shape[1] + self.drafter.config.block_size)  # the columns and the block's scratch
        self.drafter.append(self.context, captured, valid)
        self.pending = []

    def keep_rows(self, stay) -> None:
        self.context.keep_rows(stay)
        self.pending = [([h[stay] for h in captured], valid[stay]) for captured, valid in self.pending]


class LookupModelDrafts(ModelDrafts):
    """Per row, prompt lookup's draft or the drafter's, whichever the policy expects to commit more; the drafter runs
    only where the policy expects it to pay for its forward."""

    sources = ("lookup", "drafter")


class LookupNGramModelDrafts(ModelDrafts):
    """As LookupModelDrafts, with the n-gram table's drafts beside lookup's."""

    sources = ("lookup", "ngram", "drafter")


def fit(draft: torch.Tensor, confidence: torch.Tensor, b: int, mask_id: int):
    """A drafter's block cut to (or padded with [MASK] up to) the call's draft length b."""
    if draft.shape[1] >= b:
        return draft[:, :b], confidence[:, :b]
    pad = b - draft.shape[1]
    return (torch.cat([draft, draft.new_full((draft.shape[0], pad), mask_id)], 1),
            torch.cat([confidence, confidence.new_zeros(confidence.shape[0], pad)], 1))


class WindowDrafts(Drafts):
    """The model's own window: a wide forward verifies the draft and, for every way that verification can end,
    reads the window that drafts what follows (r2lm.generation.verify's docstring has the arithmetic). Where the
    policy finds the window not worth its wider forward, the step is a plain AR forward and drafts nothing."""

    sources = ("window",)

    def __init__(self, state, policy: Policy, verifying):
        super().__init__(state, policy, verifying)
        b = state.b
        self.outcomes = drafted_outcomes(b, verifying.windows)
        self.layout = verify_layout(b, self.outcomes, state.device)
        self.narrow = verify_layout(1, [], state.device)
        self.openers = torch.tensor(self.outcomes, dtype=torch.long, device=state.device)
        self.cols = torch.arange(b, device=state.device)
        self.h = None
        self.wide = True  # the next forward reads the windows

    @staticmethod
    def room(verifying) -> int:
        """The clean columns and a window per drafted outcome."""
        b = verifying.block_size
        return b * (len(drafted_outcomes(b, verifying.windows)) + 1)

    @property
    def widths(self) -> tuple[int, ...]:
        return (1, self.state.b)

    def prepare_shapes(self) -> None:
        self.state.reader.prepare(self.layout.length, self.state.b, self.layout)
        self.state.reader.prepare(1, 1, self.narrow)

    def first(self):
        """The first window, read by the forward that appends the prompt; where the policy finds windows not worth
        their cost, nothing: the first forward is then the prompt and an AR step."""
        s = self.state
        self.wide = self.policy.worth("window", None, len(s.rows))
        if not self.wide:
            return self.nothing()
        window = torch.cat([s.input_ids[:, -1:], torch.full_like(s.input_ids[:, :1], s.mask_id).expand(-1, s.b - 1)], 1)
        draft, confidence = propose(s.context.read(0, window, s.b, clean=False), s.mask_id)
        return self.proposal(draft, confidence, "window")

    def width(self, proposal):
        return self.state.b if self.wide else 1

    def verify(self, opener, draft, width, siblings=None):
        s = self.state
        if width == 1:
            self.h = None
            return s.context.read_draft(opener, self.narrow)
        t = torch.cat([opener, draft], 1)
        windows = torch.full((len(s.rows), len(self.outcomes), s.b), s.mask_id, dtype=torch.long, device=s.device)
        windows[:, :, 0] = t[:, self.openers]  # window j: [t_j, [MASK] * (b - 1)]
        self.h = s.reader.read(torch.cat([t[:, : s.b], windows.flatten(1)], 1), s.b, keep=slice(None),
                               advance=False, layout=self.layout, head=False)
        return s.model.lm_head(self.h[:, : s.b])

    def timed_forward(self, reader, width):
        model, rows = self.state.model, reader.cache.batch_size
        device = reader.cache.valid.device
        if width == 1:
            ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
            return lambda: reader.read(ids, 1, keep=slice(None), advance=False, layout=self.narrow)
        ids = torch.zeros(rows, self.layout.length, dtype=torch.long, device=device)
        b = self.state.b

        def run():  # the forward, the clean columns' head and one window's (as verify and next apply them)
            h = reader.read(ids, b, keep=slice(None), advance=False, layout=self.layout, head=False)
            return model.lm_head(h[:, : 2 * b])

        return run

    def next(self, length, ar, agreed):
        """The proposals of the latest drafted window opened at or before the row's accepted length k, from the first
        uncommitted position on, [MASK] after them (only the chosen window goes through the LM head); none after an
        AR step."""
        s, b, h = self.state, self.state.b, self.h
        self.wide = self.policy.worth("window", None, len(s.rows))
        if h is None:
            return self.nothing()
        source = (self.openers <= agreed[:, None]).sum(1) - 1
        chosen = (b * (source + 1))[:, None] + self.cols
        guess, confidence = propose(s.model.lm_head(h.gather(1, chosen[..., None].expand(-1, -1, h.shape[-1]))),
                                    s.mask_id)
        ahead = (length - self.openers[source])[:, None] + self.cols  # window column of each next draft position
        inside = ahead < b  # (a row that is done has length 0: its draft is never read)
        ahead = ahead.clamp(0, b - 1)
        return self.proposal(torch.where(inside, guess.gather(1, ahead), s.mask_id),
                             torch.where(inside, confidence.gather(1, ahead), 0.0), "window")


DRAFTS = {"window": WindowDrafts, "lookup": LookupDrafts, "ngram": NGramDrafts, "lookup+ngram": LookupNGramDrafts,
          "drafter": ModelDrafts, "lookup+drafter": LookupModelDrafts, "lookup+ngram+drafter": LookupNGramModelDrafts}

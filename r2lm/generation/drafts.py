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

lookup and ngram cost no forward (FREE) and are made on the host, from each row's text there (RowTexts: the prompt,
then the tokens the loop's one host read per step brings); where a kind has both, the policy picks per row.

A Drafts object runs the verification forward itself (a drafter decides which columns the forward reads and what it
keeps of it) and proposes the next drafts (r2lm.generation.proposal: tokens, the source's confidence, which source):

    sources, widths                      its draft sources' names; the forward widths it can run (1 = an AR step)
    siblings                             the most siblings a forward may verify beside a draft (0 but a drafter's)
    first()                              the first proposal ([MASK] where it has none), on the device and the host
    width(proposal)                      the next forward's width (the policy's choice)
    siblings_for(proposal, width)        how many siblings it verifies beside the draft (the policy's choice)
    verify(opener, draft, width, sib)    the target's logits [B, width + k, V] at the clean columns
                                         [opener, draft[:, :width - 1]]: AR's next token after each prefix, then
                                         at the k siblings `sib` [B, k], each after the opener alone
    relocate(source, width)              an accepted sibling's column (source [B]) takes the draft's first one's
    next(length, ar, agreed)             the next proposal where it is made on the device (None where on the host),
                                         once each row accepted `agreed` draft tokens and committed its `length`
                                         first tokens of `ar` (AR's greedy tokens); read with the step's outcome
    settle(made, seen, ar, length)       the next proposal on the device and on the host, once the outcome is read
    keep_rows(stay, staying)             rows that finished leave (stay on the device, staying on the host)
    costs()                              what its forwards cost here (r2lm.generation.costs), measured once

`state` (r2lm.generation.verify.Verification) holds the rows' text, their committed lengths and the context.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

import numpy as np
import torch

from r2lm.generation.costs import MeasuredCosts, cost_name, kept_costs
from r2lm.generation.lookup import RowTexts
from r2lm.generation.policy import Policy
from r2lm.generation.proposal import Proposal
from r2lm.generation.sampling import propose
from r2lm.generation.window import WindowReader
from r2lm.layout import Layout, verify_layout

FREE = ("lookup", "ngram")  # sources that draft without a forward of their own
COST_CONTEXT = 64  # the shortest context a cost is measured over (a forward's cost barely depends on it here)


def drafted_outcomes(b: int, windows: int | None) -> list[int]:
    """The accepted lengths whose next draft a verification forward reads, `windows` of them (default all b + 1).
    Fewer: 0 .. windows - 2 (early rejections) and b - 1 (a draft whose last token is a [MASK] accepted up to it:
    the steady state of a good drafter, committing b tokens); window b only serves a draft of b real tokens, which
    only window b writes."""
    if windows is None or windows > b:
        return list(range(b + 1))
    return [*range(windows - 1), b - 1]


class Drafts(ABC):
    """The draft sources of one verify=True call and the verification forward they need (the module docstring)."""

    sources: tuple[str, ...]
    capture: tuple[int, ...] = ()  # target layers whose outputs the forward returns too (a drafter's context)
    siblings = 0  # the most siblings a forward may verify beside a draft
    texts: RowTexts | None = None  # each row's text on the host, where a source drafts from it there

    def __init__(self, state, policy: Policy, verifying):
        self.state, self.policy, self.verifying = state, policy, verifying
        self.empty: tuple[int, Proposal, Proposal] | None = None  # (rows, `nothing`'s proposal, on the host)

    @staticmethod
    def room(verifying) -> int:
        """Cache columns one verification forward may write past the committed text (its widest shape)."""
        return verifying.block_size + verifying.siblings

    @property
    @abstractmethod
    def widths(self) -> tuple[int, ...]: ...

    @abstractmethod
    def first(self) -> tuple[Proposal, Proposal]: ...

    @abstractmethod
    def verify(self, opener: torch.Tensor, draft: torch.Tensor, width: int,
               siblings: torch.Tensor | None = None) -> torch.Tensor: ...

    @abstractmethod
    def next(self, length: torch.Tensor, ar: torch.Tensor, agreed: torch.Tensor) -> Proposal | None: ...

    def settle(self, made: Proposal | None, seen: Proposal | None, ar: np.ndarray,
               length: np.ndarray) -> tuple[Proposal, Proposal]:
        """The next proposal on the device and on the host: what `next` made and its host copy `seen`, or, where it
        made none, the host's drafts (`on_host`, timed for the policy: its host work is a cost of drafting; none
        where the policy rests), once each row's committed tokens ar[r, :length[r]] are known."""
        if self.texts is not None:
            self.texts.extend([row[:n] for row, n in zip(ar.tolist(), length.tolist(), strict=True)])
        if made is not None:
            return made, seen
        if self.policy.rests(len(self.state.rows)):  # drafting has not paid for its host work lately
            return self.nothing(), self.empty[2]
        start = time.perf_counter()
        proposal = self.on_host()
        self.policy.hosted(time.perf_counter() - start)
        return proposal.to(self.state.device), proposal

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

    def keep_rows(self, stay: torch.Tensor, staying: np.ndarray) -> None:
        if self.texts is not None:
            self.texts.keep(staying)

    def costs(self) -> MeasuredCosts:
        """What this call's forwards cost on this machine: measured the first time the model verifies with these
        sources at this draft length and batch size, then kept (r2lm.generation.costs)."""
        s = self.state
        context = max(s.prompt_len, COST_CONTEXT)
        room = self.room(self.verifying)

        def forward(rows: int, width: int):
            return self.timed_forward(WindowReader.scratch(s.model, rows, context, room), width)

        widest = max(self.widths) + self.siblings  # a forward of width w and k siblings reads w + k columns
        widths = list(range(1, widest + 1)) if len(self.widths) > 2 else list(self.widths)
        drafter = getattr(self, "drafter", None)
        models = (s.model,) if drafter is None else (s.model, drafter)  # whose product orders must settle first

        def make():  # (its name read once per table: a config's digest is not free)
            name = cost_name(s.model, drafter, drafts=type(self).__name__, block_size=s.b, capture=self.capture,
                             outcomes=getattr(self, "outcomes", []), widths=widths, compile=s.r.caching.compile)
            return MeasuredCosts(forward, widths, self.timed_drafting, s.device, models, name)

        costs = kept_costs(s.model, self.key, make)
        costs.measure(s.batch)
        return costs

    @property
    def key(self) -> tuple:
        """What its costs and its acceptance are kept for, beside the model: the kind of forward, the draft length,
        the drafter and the n-gram table (another drafter or table accepts differently), whether it is compiled."""
        return (type(self).__name__, self.state.b, self.capture, tuple(getattr(self, "outcomes", ())),
                id(getattr(self, "drafter", None)), id(self.verifying.ngram), self.state.r.caching.compile)

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
            nothing = self.proposal(draft, torch.zeros(draft.shape, device=s.device), self.sources[0])
            self.empty = rows, nothing, nothing.host()
        return self.empty[1]


class CleanDrafts(Drafts):
    """Drafts made between forwards: the verification forward reads the clean columns alone, as many as the policy
    chose (1, an AR step, when no row's draft is worth verifying)."""

    def __init__(self, state, policy: Policy, verifying):
        super().__init__(state, policy, verifying)
        if any(name in FREE for name in self.sources):
            ids, mask = state.input_ids.tolist(), state.r.prompt.attention_mask.tolist()
            self.texts = RowTexts([[t for t, m in zip(row, on, strict=True) if m] for row, on in zip(ids, mask, strict=True)])
        self.layouts: dict[tuple[int, int], Layout] = {}  # (width, siblings) -> the forward's template (layout_of)

    @property
    def widths(self) -> tuple[int, ...]:
        """Every width; under compile=True only an AR step's and the whole draft's (each shape compiles once)."""
        b = self.state.b
        return (1, b) if self.state.r.caching.compile and b > 1 else tuple(range(1, b + 1))

    def layout_of(self, width: int, siblings: int) -> Layout:
        """The template of a forward of `width` clean columns and `siblings`, made on first use and then kept (the
        reader keeps its masks by this object). Not made ahead for every width: a call uses few of them (AR steps
        alone where drafting does not pay), and making them all ahead cost every call (docs/results.md, "Set-up
        and host work of verified decoding")."""
        key = (width, siblings)
        if key not in self.layouts:
            self.layouts[key] = verify_layout(width, [], self.state.device, siblings)
        return self.layouts[key]

    def verify(self, opener, draft, width, siblings=None):
        k = 0 if siblings is None else siblings.shape[1]
        ids = torch.cat([opener, draft[:, : width - 1], *([] if siblings is None else [siblings])], 1)
        out = self.state.context.read_draft(ids, self.layout_of(width, k), self.capture)
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

    def host_proposal(self, draft: np.ndarray, confidence: np.ndarray, source: str) -> Proposal:
        """A source's drafts made on the host (none of them siblings: the call's K siblings, all [MASK])."""
        rows, mask_id = draft.shape[0], self.state.mask_id
        return Proposal(draft, confidence, np.full(rows, self.sources.index(source)),
                        np.full((rows, self.siblings), mask_id), np.zeros((rows, self.siblings)))

    def free(self) -> Proposal | None:
        """The drafts at hand without a forward, on the host: the free sources' (FREE), per row the one the policy
        expects to commit more where there are two; None for a kind without any."""
        s, made = self.state, []
        for name in self.sources:
            if name == "lookup":  # its confidence: how long a suffix it matched (one token's is right far less often)
                draft, matched = self.texts.lookup(s.b, s.mask_id)
                confidence = (draft != s.mask_id) * (matched / self.texts.max_ngram)[:, None]
                made.append(self.host_proposal(draft, confidence, name))
            elif name == "ngram":
                made.append(self.host_proposal(*self.verifying.ngram.draft(self.texts.tokens, s.b, s.mask_id), name))
        if len(made) < 2:
            return made[0] if made else None
        return self.policy.choose(made)

    def on_host(self) -> Proposal:
        """The next proposal where `next` made none: the free sources' drafts."""
        return self.free()


class FreeDrafts(CleanDrafts):
    """Drafts that cost no forward (prompt lookup, an n-gram table): no model runs to draft."""

    def first(self):
        proposal = self.free()
        return proposal.to(self.state.device), proposal

    def next(self, length, ar, agreed):
        return None  # made on the host, from the tokens the step committed (on_host)


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
        self.columns = torch.arange(self.room(verifying), device=state.device)  # a forward's columns, for `next`

    def first(self):
        free = self.free()
        proposal = self.nothing() if free is None else free.to(self.state.device)
        return proposal, proposal.host() if free is None else free

    def next(self, length, ar, agreed):
        s = self.state
        captured, head = self.seen
        # every column the forward read, those a row did not commit invalid (no host sync to trim them)
        kept = self.columns[: captured[0].shape[1] - (0 if head is None else head.shape[1])] < length[:, None]
        self.pending.append((captured, kept if head is None else torch.cat([head, kept], 1)))
        self.opener = ar.gather(1, (length - 1).clamp(min=0)[:, None])[:, 0]
        if self.texts is not None:  # weighed against the free sources' drafts, made on the host once read (on_host)
            return None
        if not self.policy.worth("drafter", None, len(s.rows)):
            return self.nothing()
        self.catch_up()
        return self.drafted(self.opener)

    def on_host(self):
        """The free sources' drafts, or, where the policy expects the drafter to beat them by more than its forward
        costs, per row the better of theirs and the drafter's (a second host read, in the steps it drafts)."""
        free = self.free()
        if not self.policy.worth("drafter", free, len(self.state.rows)):
            return free
        self.catch_up()
        return self.policy.choose([free, self.drafted(self.opener).host()])

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

    def keep_rows(self, stay, staying) -> None:
        super().keep_rows(stay, staying)
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

    def first(self):
        """The first window, read by the forward that appends the prompt; where the policy finds windows not worth
        their cost, nothing: the first forward is then the prompt and an AR step."""
        s = self.state
        self.wide, proposal = self.policy.worth("window", None, len(s.rows)), self.nothing()
        if self.wide:
            window = torch.cat([s.input_ids[:, -1:], torch.full_like(s.input_ids[:, :1], s.mask_id).expand(-1, s.b - 1)], 1)
            proposal = self.proposal(*propose(s.context.read(0, window, s.b, clean=False), s.mask_id), "window")
        return proposal, proposal.host()

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

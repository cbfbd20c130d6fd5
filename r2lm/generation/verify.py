"""Lossless verified decoding, `generate(..., verify=True)`: the diffusion window drafts, the causal clean pass
verifies, and what is committed is, token for token, the model's own greedy AR decoding with sidecars off (for a
frozen-backbone R2LM: the original pretrained model's greedy output).

Why it is exact: under causal attention with `shift` prediction, the clean pass over [x_{s-1}, d_s .. d_{s+b-2}]
(sidecars never touch clean columns) gives at column j the AR next-token logits after the committed text followed
by the draft d_s .. d_{s+j-1}, and writes exactly the keys and values AR decoding would. So the longest draft
prefix that agrees with those logits' greedy choices is what AR decoding would have produced, and the greedy choice
at the first disagreement is AR's next token.

One forward per iteration verifies the current draft and, for every way that verification can end, drafts the
next one (after TiDAR's pre-drafting). With b the draft length and t = [x_{s-1}, d_s, .., d_{s+b-1}]:

    clean columns   t_0 .. t_{b-1}                      causal: verification; their keys go to the cache
    window j        [t_j, [MASK] * (b-1)]  (j = 0 .. b)  sees the clean columns before t_j: the draft that follows
                                                         if exactly d_s .. d_{s+j-1} are accepted

Each window is the ordinary decoding window (opened by the last committed token, the rest masked), so it drafts
as the model was trained to. Each row accepts its draft up to its first disagreement k and commits k + 1 tokens
(the agreed prefix and AR's own next token; all b when the whole draft agreed): the clean pass's greedy choices
at its first k + 1 columns. The next draft is window k's proposals after the one AR just decided (b - 1
tokens and a [MASK] that no verification accepts), or, when the whole draft was accepted, window b's b
proposals: in either case conditioned on exactly the committed text. Only the clean columns and each row's
chosen window go through the LM head.

With `verify_windows` = w <= b a forward reads only the windows of outcomes 0 .. w - 2 and b - 1
(`drafted_outcomes`): b (w + 1) columns, a cheaper forward where a draft is mostly accepted whole or rejected
early. After an outcome k without a window the next draft comes from the latest window j < k: its proposals for
the positions after the committed ones (conditioned on the committed text with [MASK] for t_{j+1} .. t_k), then
[MASK].

Rows commit their own lengths, so a batch is not held to its slowest row's acceptance. The cache stays one set of
columns for all rows: a forward keeps as many clean columns as the row that committed most, and marks the
columns a row did not commit as not valid, as left padding is (RoPE positions are per row), so every visible key
and value is a committed token's. The cache grows by at most b columns per forward, and by no more than the rows
commit together: it starts at what AR steps need and grows (KVCache.reserve) when rows drift apart. A row that has
finished (EOS, a stop, max_new_tokens) leaves the cache and the forwards (`WindowReader.keep_rows`; not under
compile=True, where a new batch size would recompile), so a batch costs about its rows' own forwards rather than
its slowest row's times the batch size.

Drafts come from one interface (r2lm.generation.drafts): the window above (pre-drafting inside the verification
forward), prompt lookup (`verify_draft="lookup"`: what followed the latest earlier occurrence of the row's last
tokens in its own text, r2lm.generation.lookup), a drafter model for a frozen target (`drafter=`, r2lm.drafter:
it reads the target's features captured by each verification forward and drafts after it), or lookup where the
text repeats and the drafter elsewhere, and an n-gram table (`ngram=`, r2lm.ngram: what most often followed the
row's last tokens in a corpus) beside lookup, with the drafter or without. Drafts made between forwards need no
window: a forward reads the b clean columns alone, about an AR step's cost on a CPU; where no row has a draft it is
one column, an AR step, rather than b columns of which only the first can be committed (the width is decided with
the iteration's one host sync: two forward shapes). Their first verification forward appends the prompt.

A drafter's next likeliest tokens for a draft's first position, its siblings (`verify_siblings`, at most k), may be
verified in the same forward: each a clean column at the first draft position after the opener, on a branch of
its own (r2lm.layout: no other column sees it, and it sees the opener and itself). Where the target's token there
is a sibling rather than the draft's first token, the sibling takes the first token's place and its column the
first draft column's, in the cache too (`KVCache.relocate`, before the cache advances): the row commits the
sibling and AR's token after it, and what is committed stays one run of columns. The forward costs w + k columns.

The first draft is read by the forward that appends the prompt (`ExactCache`; a window-only forward after a
prefix-cache hit). Greedy only (temperature 0); causal attention, `shift`, softmax layers (a block-hybrid
layer folds its keys inside the forward, before the accepted length is known).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from r2lm.generation.contexts import ExactCache
from r2lm.generation.drafts import DRAFTS
from r2lm.generation.outputs import GenerateOutput, StepInfo, spread
from r2lm.generation.policy import Policy, policy_of
from r2lm.generation.proposal import Proposal
from r2lm.generation.sampling import propose
from r2lm.generation.stopping import Stopper
from r2lm.kind import ATTENTION

SIBLINGS = 3  # by default: a drafter's next few first guesses often hold the target's token where its first does not
MAX_SIBLINGS = 16


@dataclass(frozen=True)
class Verifying:
    """verify=True and how it drafts: `draft` (a name in r2lm.generation.drafts.DRAFTS), `windows` (window drafts:
    drafting windows per verification forward, None: block_size + 1), `drafter` (an r2lm.drafter.Drafter for the
    model), `block_size` (the draft length: the drafter's own unless block_size is given, never more than
    max_new_tokens), `policy` (how much of each draft a step submits: r2lm.generation.policy), `siblings` (the
    most siblings a forward verifies beside a drafter's draft: the drafter's next likeliest first tokens;
    SIBLINGS by default where a drafter drafts, which the policy uses where they pay), `ngram` (an
    r2lm.ngram.NGramTable for the model's vocabulary)."""

    verify: bool = False
    windows: int | None = None
    draft: str = "window"
    drafter: object = None
    block_size: int = 0
    policy: object = "adaptive"
    siblings: int = 0
    ngram: object = None

    @classmethod
    def of(cls, options: dict, config, block_size: int, block_size_given: bool, max_new_tokens: int) -> Verifying:
        verify, windows = bool(options.get("verify", False)), options.get("verify_windows")
        drafter, ngram = options.get("drafter"), options.get("ngram")
        if windows is not None:
            if not verify:
                raise ValueError("verify_windows sets how verify=True drafts; pass verify=True")
            if not (isinstance(windows, int) and 2 <= windows <= block_size + 1):
                raise ValueError(f"verify_windows must be an int in [2, block_size + 1] = [2, {block_size + 1}], "
                                 f"got {windows!r}")
        draft = options.get("verify_draft") or default_draft(drafter is not None, ngram is not None)
        if draft not in DRAFTS:
            raise ValueError(f"verify_draft must be one of {tuple(DRAFTS)}, got {draft!r}")
        # what the kind drafts from (its declared sources), not its name, decides which options it takes
        windowed, drafted = ("window" in DRAFTS[draft].sources), ("drafter" in DRAFTS[draft].sources)
        if (not windowed or drafter is not None or ngram is not None) and not verify:
            raise ValueError("verify_draft, drafter and ngram set how verify=True drafts; pass verify=True")
        if not windowed and windows is not None:
            raise ValueError(f"verify_windows counts drafting windows; verify_draft={draft!r} drafts without any")
        for source, given, option in (("drafter", drafter, "a drafter (drafter=...)"),
                                      ("ngram", ngram, "an n-gram table (ngram=...)")):
            if (source in DRAFTS[draft].sources) != (given is not None):
                users = " or ".join(repr(name) for name, kind in DRAFTS.items() if source in kind.sources)
                raise ValueError(f"verify_draft={draft!r} " + (f"needs {option}" if given is None else
                                 f"does not use the {source} given: use verify_draft={users}"))
        if ngram is not None:
            # the drafts interface (r2lm.generation.drafts.CleanDrafts.tabled), as r2lm.ngram.NGramTable implements it
            if not all(callable(getattr(ngram, name, None)) for name in ("check_model", "draft")):
                raise ValueError(f"ngram must be an r2lm.ngram.NGramTable, got {type(ngram).__name__}")
            ngram.check_model(config)
        policy = options.get("verify_policy", "adaptive")
        if policy != "adaptive" and not verify:
            raise ValueError("verify_policy sets how verify=True drafts; pass verify=True")
        policy_of(policy)  # a name it knows, or a Policy
        siblings = options.get("verify_siblings")
        if siblings is not None:
            if not drafted:
                raise ValueError(f"verify_siblings counts a drafter's other candidates for a draft's first token; "
                                 f"verify_draft={draft!r} has no drafter")
            if not (isinstance(siblings, int) and not isinstance(siblings, bool) and 0 <= siblings <= MAX_SIBLINGS):
                raise ValueError(f"verify_siblings must be an int in [0, {MAX_SIBLINGS}], got {siblings!r}")
        siblings = (SIBLINGS if siblings is None else siblings) if drafted and verify else 0
        if drafter is not None:
            # the drafts interface (r2lm.generation.drafts.ModelDrafts), as r2lm.drafter.Drafter implements it
            if not all(callable(getattr(drafter, name, None)) for name in ("check_target", "bind", "draft")):
                raise ValueError(f"drafter must be an r2lm.drafter.Drafter, got {type(drafter).__name__}")
            drafter.check_target(config)
            if not block_size_given:  # the drafter's own draft length, unless asked otherwise
                block_size = drafter.config.block_size
        if verify and block_size > max_new_tokens:  # a draft past the last new token is never verified: cut it
            block_size = max_new_tokens
            windows = None if windows is None else min(windows, block_size + 1)
        if block_size < 2:  # a sibling stands in for a draft's first token, verified with the one after it
            siblings = 0
        return cls(verify, windows, draft, drafter, block_size, policy, siblings, ngram)


def default_draft(drafter: bool, ngram: bool) -> str:
    """What verify=True drafts from by default: prompt lookup beside the drafter and the n-gram table given, the
    model's own window without either."""
    if not (drafter or ngram):
        return "window"
    return "+".join(["lookup", *(["ngram"] if ngram else []), *(["drafter"] if drafter else [])])


def check_verifiable(config, r) -> None:
    """What else verify=True needs of the model and of request `r`."""
    kind = config.kind
    if not kind.ar:
        causal = " or ".join(f"attention={name!r}" for name, rule in ATTENTION.items() if rule.token_causal)
        raise ValueError(f"verify=True checks drafts against the causal AR pass: it needs {causal} and "
                         f"prediction='shift', got {config.attention!r} / {config.prediction!r}")
    if kind.hybrid:
        raise ValueError("verify=True needs softmax attention layers: block-hybrid layers fold their keys inside the "
                         "forward, before the accepted length is known")
    if r.sampling.temperature > 0:
        raise ValueError("verify=True reproduces greedy AR decoding: it does not sample (temperature must be 0)")
    if not r.caching.use_cache or r.prompt.suffix_ids.shape[1]:
        raise ValueError("verify=True decodes with the exact cache (use_cache=True) and no suffix_ids")


class Verification:
    """The state of one verify=True call: each row's generated tokens `out` (which may overshoot max_new_tokens by
    < b), its committed count `written`, the rows still in the forwards (`rows`, indices into the batch), and the
    exact cache they are verified against."""

    def __init__(self, model, r, forward_width: int):
        ids = r.prompt.input_ids
        self.model, self.r, self.input_ids = model, r, ids
        (self.batch, self.prompt_len), self.n, self.b = ids.shape, r.max_new_tokens, r.verifying.block_size
        self.mask_id, self.device = r.mask_id, ids.device
        self.out = ids.new_full((self.batch, self.n + 2 * self.b), r.stopping.pad_id)
        self.written = torch.zeros(self.batch, dtype=torch.long, device=self.device)
        self.rows = torch.arange(self.batch, device=self.device)
        # the cache columns the loop keeps: n where every step commits as much in every row, at most
        # min(n b, B (n + b)) where rows drift apart (docstring). A static shape (compile=True) is sized for the
        # worst case; otherwise the cache starts at the usual need and grows as a forward needs (`make_room`)
        self.growing = not r.caching.compile
        growth = self.n + self.b if self.growing else min(self.n * self.b, self.batch * (self.n + self.b))
        self.forward_width = forward_width
        self.context = ExactCache(model, r.prompt, growth + forward_width, r.caching)
        self.reader = self.context.reader

    def make_room(self) -> None:
        """Room in the cache for the next verification forward, its widest shape."""
        if self.growing:
            self.reader.cache.reserve(self.forward_width)


def take_sibling(logits, ar, proposal, k: int, width: int, mask_id: int):
    """After a forward that verified k siblings beside drafts of `width`: where the target's token after the opener
    is a sibling (and not the draft's first token), the sibling takes the draft's first token's place and its
    column the first column's: (logits and AR's tokens [R, width], column 1 the sibling's column where one was
    right; the draft and its confidence [R, b], there the sibling then [MASK], so that the row accepts 1 token and
    commits 2; the sibling's rank, -1 where none; the forward column that moved into column 1, 1 where none)."""
    first = ar[:, :1]
    right = (proposal.siblings[:, :k] == first) & (proposal.draft[:, :1] != first)
    hit = torch.where(right.any(1), right.long().argmax(1), -1)
    source = torch.where(hit >= 0, width + hit, 1)
    moved = logits.gather(1, source[:, None, None].expand(-1, 1, logits.shape[2]))
    logits = torch.cat([logits[:, :1], moved, logits[:, 2:width]], 1)
    ar = torch.cat([first, ar.gather(1, source[:, None]), ar[:, 2:width]], 1)
    took = (hit >= 0)[:, None]
    rank = hit.clamp(min=0)[:, None]
    draft = torch.cat([torch.where(took, first, proposal.draft[:, :1]),
                       torch.where(took, mask_id, proposal.draft[:, 1:2]), proposal.draft[:, 2:]], 1)
    confidence = torch.cat([torch.where(took, proposal.sibling_confidence.gather(1, rank), proposal.confidence[:, :1]),
                            torch.where(took, 0.0, proposal.confidence[:, 1:2]), proposal.confidence[:, 2:]], 1)
    return logits, ar, draft, confidence, hit, source


def decode_verified(model, r) -> GenerateOutput:
    check_verifiable(model.config, r)
    v, ids = r.verifying, r.prompt.input_ids
    b = v.block_size
    policy: Policy = policy_of(v.policy)
    kind = DRAFTS[v.draft]
    s = Verification(model, r, kind.room(v))
    drafts = kind(s, policy, v)
    policy.start(drafts.sources, drafts.widths, drafts.costs() if policy.needs_costs else None, r.mask_id, model,
                 drafts.key, drafts.siblings)
    stopper = Stopper(r.stopping, ids, r.prompt.attention_mask, every_token=True)
    cols = torch.arange(b, device=s.device)
    no_hit = torch.full((s.batch,), -1, dtype=torch.long, device=s.device)
    opener = ids[:, -1:]
    leave = not r.caching.compile  # a finished row leaves the forwards (not under compile=True: a new batch size recompiles)
    iterations = 0
    clock = time.perf_counter()  # each step's wall time, from one host sync to the next: the policy checks its prices
    row_steps = torch.zeros((), dtype=torch.long, device=s.device)
    try:
        done = stopper.finished  # rows with nothing left to decode (none yet: max_new_tokens >= 1)
        proposal, seen = drafts.first()  # on the device, and what the policy reads of it on the host
        width = drafts.width(seen)
        while True:
            draft, confidence = proposal.draft, proposal.confidence
            k = drafts.siblings_for(seen, width)
            s.make_room()
            logits = drafts.verify(opener, draft, width, proposal.siblings[:, :k] if k else None)
            ar = propose(logits, r.mask_id)[0]  # AR's greedy tokens after the committed text + the draft
            hit = no_hit[: len(s.rows)]
            if k:  # an accepted sibling takes the draft's first token's place, its column the first one's in the cache
                logits, ar, draft, confidence, hit, source = take_sibling(logits, ar, proposal, k, width, r.mask_id)
                s.reader.cache.relocate(1, source)
                drafts.relocate(source, width)
            agrees = (draft[:, :width] == ar).long().cumprod(1)
            agreed = agrees.sum(1)  # each row's accepted draft length k
            live = ~done[s.rows]
            length = torch.where(live, (agreed + 1).clamp(max=width), 0)  # tokens each row commits: ar[:, :length]
            row_steps += live.sum()
            if r.step_callback is not None:  # a row that is done (compile=True keeps it) decodes nothing
                shown = ((live[:, None] & torch.ones_like(ar, dtype=torch.bool), False), (draft[:, :width], r.mask_id),
                         (confidence[:, :width], 0), (agrees.bool() & live[:, None], False), (logits, 0))
                r.step_callback(StepInfo(iterations, s.written.clone(), *(spread(x, s.rows, s.batch, f) for x, f in shown)))
            opener = ar.gather(1, (length - 1).clamp(min=0)[:, None])
            kept = cols[:width] < length[:, None]
            # [MASK] after a row's commit (no EOS is read there), and for the rows that left
            block = spread(torch.where(kept, ar, r.mask_id), s.rows, s.batch, r.mask_id)
            stopper.check_eos(block, s.written)
            s.out.scatter_(1, s.written[:, None] + cols[:width], block)  # what follows a row's commit is overwritten
            s.written.index_add_(0, s.rows, length)
            iterations += 1
            done = stopper.finished | (s.written >= s.n)
            following = drafts.next(length, ar, agreed)  # (None: made on the host from what the read brings)
            # the one host sync of an iteration: its outcome, each row's committed tokens, the next proposal if made
            remaining = torch.where(done[s.rows], 0, s.n - s.written[s.rows])
            parts = [torch.stack([done.all(), done[s.rows].any()]), agreed, remaining, hit, length, ar,
                     *([] if following is None else following.fields())]
            values = np.asarray(torch.cat([x.double().flatten() for x in parts]).tolist())
            (over, left), agreed_, remaining_, hit_, length_, ar_, *proposed = (
                piece.reshape(x.shape) for piece, x in zip(np.split(values, np.cumsum([x.numel() for x in parts])[:-1]),
                                                           parts, strict=True))
            widest, over, left = int(length_.max()), bool(over), bool(left)
            hit_ = hit_.astype(np.int64)  # (a row whose sibling was right accepted none of the draft)
            s.reader.cache.advance(kept[:, :widest])  # the committed tokens' clean columns: exact keys
            if stopper.reads_text:  # stop strings, criteria and the streamer read the text every row has so far
                aligned = int(torch.where(stopper.finished, s.n, s.written.clamp(max=s.n)).min())
                stopper.advance(torch.cat([ids, s.out[:, :aligned]], 1), s.prompt_len, aligned)
                done = stopper.finished | (s.written >= s.n)
                over, left = torch.stack([done.all(), done[s.rows].any()]).tolist()
            # what the step showed is learnt before the next draft is made: choosing it reads the latest estimates
            policy.observe(seen, width, agreed_.astype(np.int64) - (hit_ >= 0), remaining_, k, hit_)
            if not over:  # the next proposal (a drafter may run here: its time is this step's)
                following, next_seen = drafts.settle(
                    following, None if following is None else Proposal.typed(*proposed),
                    ar_.astype(np.int64), length_.astype(np.int64))
            now = time.perf_counter()
            # the step's time, its drafting included (none for the first, which appends the prompt too)
            policy.took(now - clock if iterations > 1 else None, width + k, len(agreed_))
            clock = now
            if over:
                break
            proposal, seen = following, next_seen
            if left:
                stay = ~done[s.rows]
                staying = np.asarray(stay.tolist())
                if leave:
                    s.rows, opener, proposal, seen = s.rows[stay], opener[stay], proposal.rows(stay), seen.rows(staying)
                    s.reader.keep_rows(stay)
                    drafts.keep_rows(stay, staying)
                    policy.keep_rows(staying)
                else:  # (compile=True) a row that is done stays, and submits nothing
                    seen = replace(seen, draft=np.where(staying[:, None], seen.draft, r.mask_id))
            width = drafts.width(seen)
    finally:
        s.context.close()
    # as wide as the row that kept most: a row's accepted draft may run past its stop (EOS, a stop string) or
    # ahead of the rows the stop strings waited for
    end = min(s.n, int(torch.where(stopper.finished, stopper.stop_at, s.written).max()))
    return stopper.output(torch.cat([ids, s.out[:, :end]], 1), s.prompt_len, s.reader.forwards, iterations, row_steps)

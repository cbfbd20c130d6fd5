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
commit together. A row that has finished (EOS, a stop, max_new_tokens) leaves the cache and the forwards
(`WindowReader.keep_rows`; not under compile=True, where a new batch size would recompile), so a batch costs about
its rows' own forwards rather than its slowest row's times the batch size.

With `verify_draft="lookup"` the drafts are not the window's but prompt-lookup copies (r2lm.generation.lookup):
what followed the latest earlier occurrence of the row's last tokens in its own text, [MASK] where there is none.
A forward then reads the b clean columns alone (no window, no sidecar): about an AR step's cost, so text that
repeats itself is decoded faster than AR whatever the drafter has learnt. Where no row has a draft the forward is
one column, an AR step, rather than b columns of which only the first can be committed (on a CPU 8 rows'
matrix products cost 2x one row's, 4 rows' 1.1x: eval/linear_cost); the width is decided with the iteration's one
host sync (two forward shapes). The first verification forward appends the prompt (its draft is looked up in the
prompt).

The first draft is read by the forward that appends the prompt (`ExactCache`; a window-only forward after a
prefix-cache hit). Greedy only (temperature 0); causal attention, `shift`, softmax layers (a block-hybrid
layer folds its keys inside the forward, before the accepted length is known).
"""

from __future__ import annotations

import torch

from r2lm.generation.contexts import ExactCache
from r2lm.generation.lookup import lookup_draft
from r2lm.generation.outputs import GenerateOutput, StepInfo
from r2lm.generation.sampling import propose
from r2lm.generation.stopping import Stopper
from r2lm.layout import Layout


def check_verifiable(config, r) -> None:
    if config.attention != "causal" or config.prediction != "shift":
        raise ValueError("verify=True checks drafts against the causal AR pass: it needs attention='causal' and "
                         f"prediction='shift', got {config.attention!r} / {config.prediction!r}")
    if config.hybrid_layers:
        raise ValueError("verify=True needs softmax attention layers: block-hybrid layers fold their keys inside the "
                         "forward, before the accepted length is known")
    if r.temperature > 0:
        raise ValueError("verify=True reproduces greedy AR decoding: it does not sample (temperature must be 0)")
    if not r.use_cache or r.suffix_ids.shape[1]:
        raise ValueError("verify=True decodes with the exact cache (use_cache=True) and no suffix_ids")


def drafted_outcomes(b: int, windows: int | None) -> list[int]:
    """The accepted lengths whose next draft a verification forward reads, `windows` of them (default all b + 1).
    Fewer: 0 .. windows - 2 (early rejections) and b - 1 (a draft whose last token is a [MASK] accepted up to it:
    the steady state of a good drafter, committing b tokens); window b only serves a draft of b real tokens, which
    only window b writes."""
    if windows is None or windows > b:
        return list(range(b + 1))
    return [*range(windows - 1), b - 1]


def verify_layout(b: int, outcomes: list[int], device=None) -> Layout:
    """The columns of one verification forward, positions relative to the cache's next position: clean column j
    at position j in chunk 2j + 1 (so it sees the clean columns before it), then for each j in `outcomes` window j
    at positions j .. j + b - 1 in chunk 2j (so it sees the clean columns before position j)."""
    one, window = torch.ones(1, 1, device=device), torch.ones(1, b, device=device)
    clean = [Layout.span(one, start=j, chunk=2 * j + 1) for j in range(b)]
    windows = [Layout.span(window, start=j, noisy=True, chunk=2 * j) for j in outcomes]
    return Layout.cat(*clean, *windows)


def spread(x: torch.Tensor, rows: torch.Tensor, batch: int, fill) -> torch.Tensor:
    """Per-row values of the rows still decoding (`rows`: their indices in the batch) as a whole batch, `fill` for
    the rows that left (x itself while no row has left)."""
    if x.shape[0] == batch:
        return x
    return x.new_full((batch, *x.shape[1:]), fill).index_copy_(0, rows, x)


def decode_verified(model, r) -> GenerateOutput:
    ids = r.input_ids
    (batch, prompt_len), n, b = ids.shape, r.max_new_tokens, r.block_size
    check_verifiable(model.config, r)
    lookup = r.verify_draft == "lookup"
    # each row's text: the prompt (-1 at padding: never looked up), then its generated tokens, `out` (a row may
    # overshoot n by < b)
    text = ids.new_full((batch, prompt_len + n + 2 * b), r.pad_id)
    text[:, :prompt_len] = ids.masked_fill(r.attention_mask == 0, -1)
    out = text[:, prompt_len:]
    stopper = Stopper(r, batch, ids.device, every_token=True)
    stopper.stream(ids)
    reads_text = bool(stopper.stop_strings or stopper.criteria or stopper.streamer)
    outcomes = [] if lookup else drafted_outcomes(b, r.verify_windows)
    layout = verify_layout(b, outcomes, ids.device)
    narrow = verify_layout(1, [], ids.device)  # lookup: a forward where no row has a draft (an AR step)
    openers = torch.tensor(outcomes, dtype=torch.long, device=ids.device)
    windows = ids.new_full((batch, len(outcomes), b), r.mask_id)  # window j: [t_j, [MASK] * (b - 1)]
    growth = min(n * b, batch * (n + b))  # cache columns the loop may keep (module docstring)
    context = ExactCache(model, r, extra_room=growth - n + layout.length)
    reader, head = context.reader, model.lm_head
    for shape in (layout, narrow) if lookup else (layout,):  # the loop's forward shapes, built outside its steps
        reader.prepare(shape.length, shape.length if lookup else b, shape)
    cols = torch.arange(b, device=ids.device)
    opener = ids[:, -1:]
    written = torch.zeros(batch, dtype=torch.long, device=ids.device)  # each row's committed tokens
    # The rows still in the forward (indices into the batch): a finished row leaves the cache and the per-row
    # state below, so it costs nothing while the others finish. Not under compile=True, where each batch size
    # would be a recompilation.
    rows = torch.arange(batch, device=ids.device)
    leave = not r.compile
    iterations = streamed = 0
    row_steps = torch.zeros((), dtype=torch.long, device=ids.device)

    def looked_up():  # lookup drafts from each row's text as committed so far, and whether a decoding row has one
        draft = lookup_draft(text[rows], prompt_len + written[rows], b, r.mask_id)
        real = draft != r.mask_id
        return draft, real.float(), (real & ~done[rows, None]).any()

    try:
        done = stopper.finished  # rows with nothing left to decode (none yet: max_new_tokens >= 1)
        if lookup:  # the first draft is looked up in the prompt; the first verification appends the prompt
            draft, confidence, drafted = looked_up()
        else:  # the first draft, read with the prompt
            draft, confidence = propose(context.read(0, torch.cat([opener, windows[:, 0, 1:]], 1), b, clean=False),
                                        r.mask_id)
            drafted = torch.ones((), dtype=torch.bool, device=ids.device)  # a window always drafts
        width = b if drafted else 1  # the forward's clean columns, b or (no lookup draft anywhere) 1
        while True:
            span = cols[:width]
            if lookup:
                draft, confidence = draft[:, :width], confidence[:, :width]
                logits = context.read_draft(torch.cat([opener, draft[:, : width - 1]], 1), layout if width == b else narrow)
            else:
                t = torch.cat([opener, draft], 1)
                windows[:, :, 0] = t[:, openers]
                h = reader.read(torch.cat([t[:, :b], windows.flatten(1)], 1), b, keep=slice(None), advance=False,
                                layout=layout, head=False)
                logits = head(h[:, :b])
            ar = propose(logits, r.mask_id)[0]  # AR's greedy tokens after the committed text + the draft
            agrees = (draft == ar).long().cumprod(1)
            agreed = agrees.sum(1)  # each row's accepted draft length k
            live = ~done[rows]
            length = torch.where(live, (agreed + 1).clamp(max=width), 0)  # tokens each row commits: ar[:, :length]
            row_steps += live.sum()
            if r.step_callback is not None:
                seen = ((torch.ones_like(draft, dtype=torch.bool), 0), (draft, r.mask_id), (confidence, 0),
                        (agrees.bool(), 0), (logits, 0))  # (masked, proposals, confidence, accepted, logits)
                r.step_callback(StepInfo(iterations, written.clone(), *(spread(x, rows, batch, f) for x, f in seen)))
            if not lookup:
                # The next draft: the proposals of the latest drafted window opened at or before the row's accepted
                # length k, from the first uncommitted position on, [MASK] after them (module docstring).
                source = (openers <= agreed[:, None]).sum(1) - 1
                chosen = (b * (source + 1))[:, None] + cols
                guess, guess_confidence = propose(head(h.gather(1, chosen[..., None].expand(-1, -1, h.shape[-1]))),
                                                  r.mask_id)
                ahead = (length - openers[source])[:, None] + cols  # window column of each next draft position
                inside = ahead < b  # (a row that is done has length 0: its draft is never read)
                ahead = ahead.clamp(0, b - 1)
                draft = torch.where(inside, guess.gather(1, ahead), r.mask_id)
                confidence = torch.where(inside, guess_confidence.gather(1, ahead), 0.0)
            opener = ar.gather(1, (length - 1).clamp(min=0)[:, None])
            kept = span < length[:, None]
            # [MASK] after a row's commit (no EOS is read there), and for the rows that left
            block = spread(torch.where(kept, ar, r.mask_id), rows, batch, r.mask_id)
            stopper.check_eos(block, written)
            out.scatter_(1, written[:, None] + span, block)  # what follows a row's commit is overwritten next
            written.index_add_(0, rows, length)
            iterations += 1
            done = stopper.finished | (written >= n)
            if lookup:
                draft, confidence, drafted = looked_up()
            # the one host sync of an iteration
            widest, over, left, any_draft = torch.stack([length.max(), done.all(), done[rows].any(), drafted]).tolist()
            reader.cache.advance(kept[:, :widest])  # the committed tokens' clean columns: exact keys
            if reads_text:  # stop strings, criteria and the streamer read the text every row has so far
                aligned = int(torch.where(stopper.finished, n, written.clamp(max=n)).min())
                stopper.end_block(torch.cat([ids, out[:, :aligned]], 1), prompt_len, aligned)
                stopper.stream(out[:, streamed:aligned], streamed)
                streamed = aligned
                done = stopper.finished | (written >= n)
                over, left = torch.stack([done.all(), done[rows].any()]).tolist()
            if over:
                break
            if left and leave:
                stay = ~done[rows]
                rows, draft, confidence, opener, windows = (x[stay] for x in (rows, draft, confidence, opener, windows))
                reader.keep_rows(stay)
            width = b if any_draft else 1
    finally:
        context.close()
    stopper.end()
    # as wide as the row that kept most: a row's accepted draft may run past its stop (EOS, a stop string) or
    # ahead of the rows the stop strings waited for
    end = min(n, int(torch.where(stopper.finished, stopper.stop_at, written).max()))
    sequences = stopper.trim(torch.cat([ids, out[:, :end]], 1), prompt_len)
    return GenerateOutput(sequences=sequences, nfe=reader.forwards, steps=iterations, new_tokens=stopper.count(end),
                          row_steps=int(row_steps))

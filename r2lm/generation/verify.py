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
as the model was trained to. Every row accepts its draft up to its first disagreement k; the batch commits
min_k + 1 tokens per row (the agreed prefix and AR's own next token: for a row that agreed further, that token
is its draft token), so rows stay in lockstep and the cache keeps keys and values of committed tokens only (it
advances by the committed columns; the rest of the forward's columns were scratch). The next draft is window k's
proposals after the one AR just decided (b - 1 tokens and a [MASK] that no verification accepts), or, when the
whole draft was accepted, window b's b proposals: in either case conditioned on exactly the committed text. Only
the clean columns and the chosen window go through the LM head.

The first draft takes one window-only forward. Greedy only (temperature 0); causal attention, `shift`, softmax
layers (a block-hybrid layer folds its keys inside the forward, before the accepted length is known).
"""

from __future__ import annotations

import torch

from r2lm.generation.contexts import ExactCache
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


def verify_layout(b: int, device=None) -> Layout:
    """The columns of one verification forward, positions relative to the cache's next position: clean column j
    at position j in chunk 2j + 1 (so it sees the clean columns before it), then window j at positions
    j .. j + b - 1 in chunk 2j (so it sees the clean columns before position j), for j = 0 .. b."""
    one, window = torch.ones(1, 1, device=device), torch.ones(1, b, device=device)
    clean = [Layout.span(one, start=j, chunk=2 * j + 1) for j in range(b)]
    windows = [Layout.span(window, start=j, noisy=True, chunk=2 * j) for j in range(b + 1)]
    return Layout.cat(*clean, *windows)


def decode_verified(model, r) -> GenerateOutput:
    ids = r.input_ids
    (batch, prompt_len), n, b = ids.shape, r.max_new_tokens, r.block_size
    check_verifiable(model.config, r)
    out = ids.new_full((batch, n + b), r.pad_id)  # generated tokens (one iteration may overshoot by < b)
    stopper = Stopper(r, batch, ids.device)
    stopper.stream(ids)
    layout = verify_layout(b, ids.device)
    windows = ids.new_full((batch, b + 1, b), r.mask_id)  # window j: [t_j, [MASK] * (b - 1)]
    context = ExactCache(model, r, extra_room=layout.length + b)
    reader, head = context.reader, model.lm_head
    opener = ids[:, -1:]
    written = iterations = 0
    row_steps = torch.zeros((), dtype=torch.long, device=ids.device)
    try:
        draft, confidence = propose(reader.read(torch.cat([opener, windows[:, 0, 1:]], 1), 0, keep=slice(0, b)),
                                    r.mask_id)
        while written < n:
            t = torch.cat([opener, draft], 1)
            windows[:, :, 0] = t
            h = reader.read(torch.cat([t[:, :b], windows.flatten(1)], 1), b, keep=slice(None), advance=False,
                            layout=layout, head=False)
            logits = head(h[:, :b])
            ar = propose(logits, r.mask_id)[0]  # AR's greedy tokens after the committed text + the draft
            agrees = (draft == ar).long().cumprod(1)
            agreed = torch.where(stopper.finished, b, agrees.sum(1))  # each row's accepted draft length
            row_steps += (~stopper.finished).sum()
            k = int(agreed.min())  # the one host sync of an iteration
            if r.step_callback is not None:
                r.step_callback(StepInfo(iterations, written, torch.ones_like(agrees, dtype=torch.bool), draft,
                                         confidence, agrees.bool(), logits))
            guess, guess_confidence = propose(head(h[:, b * (k + 1) : b * (k + 2)]), r.mask_id)  # window k
            if k == b:
                committed, opener, draft, confidence = draft, draft[:, -1:], guess, guess_confidence
            else:
                committed = torch.cat([draft[:, :k], ar[:, k : k + 1]], 1)
                opener = ar[:, k : k + 1]
                draft = torch.cat([guess[:, 1:], windows[:, 0, 1:2]], 1)  # a [MASK] last: no draft for it
                confidence = torch.cat([guess_confidence[:, 1:], guess_confidence.new_zeros(batch, 1)], 1)
            reader.cache.advance(committed.shape[1])  # the clean columns of the committed tokens: their keys are exact
            block = out[:, written : written + committed.shape[1]]
            block.copy_(torch.where(stopper.finished[:, None], r.pad_id, committed))
            stopper.check_eos(block, written)
            written += block.shape[1]
            iterations += 1
            canvas = torch.cat([ids, out[:, : min(written, n)]], 1)
            stopper.end_block(canvas, prompt_len, min(written, n))
            stopper.stream(block[:, : max(0, n - written + block.shape[1])], written - block.shape[1])
            if bool(stopper.finished.all()):
                break
    finally:
        context.close()
    stopper.end()
    end = min(written, n)
    sequences = stopper.trim(torch.cat([ids, out[:, :end]], 1), prompt_len)
    return GenerateOutput(sequences=sequences, nfe=reader.forwards, steps=iterations, new_tokens=stopper.count(end),
                          row_steps=int(row_steps))

"""`generate()`: semi-autoregressive block decoding with an exact KV cache (DESIGN section 4).

    cache = model.new_cache(...)                 # allocated once per call
    model.prefill(prompt, cache)                 # shift: all but the last prompt token, which opens the first window
    for each block of [MASK]:
        until the block has no [MASK]:
            logits = model.denoise(window, cache)      # sidecar on, cache untouched
            unmask by the rule (>= 1 per row)
        model.commit(block, cache)               # clean, sidecar off: exactly what training's clean stream computes

Under `shift`, window column j predicts block token j from the inputs [x_{s-1}, block_0 .. block_{b-2}]; under
`inplace` the window is the block itself. A window with no [MASK] left (block size 1 under `shift`, or the last
step of a block) is committed and read in one forward when that is exact, i.e. when no sidecar is active: the
AR baseline then runs one forward per token.

`use_cache=False` recomputes the whole layout (prompt, committed blocks, window) every step: the oracle.
Bidirectional models have no exact cache and are decoded by r2lm.generation.bidirectional.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from r2lm.cache import KVCache
from r2lm.generation.request import Request, make_request
from r2lm.generation.sampling import propose, select
from r2lm.layout import Layout
from r2lm.prefix.prefill import prefill_rows


@dataclass
class GenerateOutput:
    sequences: torch.LongTensor  # [batch, prompt + new]: like transformers' generate, padded after a row stops
    nfe: int  # model forwards
    steps: int  # forwards that unmasked tokens
    new_tokens: int  # tokens decoded, summed over rows, up to each row's stop

    @property
    def tokens_per_step(self) -> float:
        """Tokens a row accepts per denoising step, averaged over rows."""
        return self.new_tokens / max(self.steps * self.sequences.shape[0], 1)


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **options) -> GenerateOutput:
    """Decode `max_new_tokens` after left-padded prompts `input_ids` [B, P].

    Options (see r2lm.generation.request.make_request for all and their checks): max_new_tokens=128,
    block_size (default: the model's), threshold=0.9 | factor | tokens_per_step, confidence ("max_prob",
    "margin", "entropy"), temperature=0.0, top_k, top_p, generator, eos_token_id, pad_token_id, stop_strings +
    tokenizer, streamer, use_cache=True, approximate_cache (None, "prefix" or "dual": bidirectional models only),
    bicache (an r2lm.prefix.BiCache: APPROXIMATE reuse of a stored shared prefix's shallow-layer keys and values,
    bidirectional models only).
    """
    request = make_request(model, input_ids, attention_mask, **options)
    if model.config.attention == "bidirectional":
        from r2lm.generation.bidirectional import decode_bidirectional

        return decode_bidirectional(model, request)
    return decode_blocks(model, request)


def choose(logits: torch.Tensor, masked: torch.Tensor, r: Request):
    """Proposed tokens [B, L] and which masked positions take them now; [MASK] itself is never proposed."""
    logits = logits.clone()
    logits[..., r.mask_id] = float("-inf")
    tokens, conf = propose(logits, r.temperature, r.top_k, r.top_p, r.confidence, r.generator)
    return tokens, select(conf, masked, r.threshold, r.factor, r.tokens_per_step)


class CachedContext:
    """Committed tokens held as keys and values in one preallocated KVCache."""

    def __init__(self, model, cache: KVCache):
        self.model, self.cache = model, cache

    def prefill(self, ids, mask):
        self.model.prefill(ids, self.cache, attention_mask=mask)

    def commit(self, ids, logits=False):
        return self.model.commit(ids, self.cache, logits_to_keep=0 if logits else 1)

    def denoise(self, window):
        return self.model.denoise(window, self.cache)


class RecomputedContext:
    """Committed tokens kept as ids: every read recomputes the full layout (the oracle for the cache)."""

    def __init__(self, model, batch: int, device):
        self.model = model
        self.ids, self.layouts = [], []
        self.next_position = torch.zeros(batch, dtype=torch.long, device=device)
        self.next_chunk = 0

    def prefill(self, ids, mask):
        self._append(ids, self.model.prompt_layout(mask, start=self.next_position, chunk=self.next_chunk), mask)

    def commit(self, ids, logits=False):
        mask = torch.ones_like(ids)
        self._append(ids, Layout.span(mask, start=self.next_position, chunk=self.next_chunk), mask)

    def _append(self, ids, layout, mask):
        self.ids.append(ids)
        self.layouts.append(layout)
        self.next_position = self.next_position + mask.sum(1)
        self.next_chunk = int(layout.chunks.max()) + 1

    def denoise(self, window):
        win = Layout.span(torch.ones_like(window), start=self.next_position, noisy=True, chunk=self.next_chunk)
        out = self.model(torch.cat([*self.ids, window], 1), layout=Layout.cat(*self.layouts, win))
        return out.logits[:, -window.shape[1] :]


def sidecars_active(model) -> bool:
    return any(layer.sidecar is not None and bool(layer.sidecar.gate.ne(0).any()) for layer in model.model.layers)


def decode_blocks(model, r: Request) -> GenerateOutput:
    ids, mask = r.input_ids, r.attention_mask
    batch, prompt_len = ids.shape
    n_new = r.max_new_tokens
    shift = model.config.prediction == "shift"
    fuse = r.use_cache and shift and not sidecars_active(model)
    nfe = steps = 0
    opener = ids[:, -1:] if shift else None  # shift: the last prompt token opens the first window
    head, head_mask = (ids[:, :-1], mask[:, :-1]) if shift else (ids, mask)
    pinned = []
    if r.prefix_cache is not None:  # rows resume from their cached prefixes
        rows = [row[keep.bool()].tolist() for row, keep in zip(head, head_mask, strict=True)]
        cache, pinned, nfe = prefill_rows(model, r.prefix_cache, rows, max(map(len, rows)) + n_new)
        context = CachedContext(model, cache)
    elif r.use_cache:
        context = CachedContext(model, KVCache(model.config, batch, prompt_len + n_new, model.dtype, model.device))
    else:
        context = RecomputedContext(model, batch, ids.device)
    if r.prefix_cache is None and head.shape[1]:
        context.prefill(head, head_mask)
        nfe += r.use_cache
    try:
        return _decode(model, r, context, opener, fuse, nfe, steps)
    finally:
        if r.prefix_cache is not None:
            r.prefix_cache.release(pinned)


def _decode(model, r: Request, context, opener, fuse: bool, nfe: int, steps: int) -> GenerateOutput:
    ids = r.input_ids
    batch, n_new, b, mask_id = ids.shape[0], r.max_new_tokens, r.block_size, r.mask_id
    shift = opener is not None
    out = torch.full((batch, n_new), mask_id, dtype=ids.dtype, device=ids.device)
    stopper = r.stopper
    stopper.stream(ids)

    end = 0
    for start in range(0, n_new, b):
        end = min(start + b, n_new)
        block = out[:, start:end]  # a view: unmasking writes straight into `out`
        block[stopper.finished] = r.pad_id  # finished rows have nothing left to decode
        committed = False
        while True:
            masked = block == mask_id
            if not masked.any():
                break
            window = torch.cat([opener, block[:, :-1]], 1) if shift else block
            if fuse and not (window == mask_id).any():  # clean window: read and commit in one forward
                logits, committed = context.commit(window, logits=True), True
            else:
                logits = context.denoise(window)
            nfe, steps = nfe + 1, steps + 1
            tokens, take = choose(logits, masked, r)
            block[take] = tokens[take]
            finished = stopper.check_eos(out, start, end, mask_id)
            block[finished[:, None] & (block == mask_id)] = r.pad_id  # a stopped row's tail needs no decoding
        if stopper.stop_strings:
            stopper.check_strings(out, end)
        stopper.stream(block, start)
        if stopper.finished.all():
            break
        if not committed and end < n_new:  # the last block needs no commit: no window will read it
            context.commit(torch.cat([opener, block[:, :-1]], 1) if shift else block)
            nfe += r.use_cache
        if shift:
            opener = block[:, -1:]
    stopper.end()
    new = stopper.trim(out[:, :end])
    return GenerateOutput(torch.cat([ids, new], 1), nfe, steps, stopper.count(new))

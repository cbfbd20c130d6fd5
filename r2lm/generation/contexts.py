"""How a decoder holds the committed text and reads a block's logits from it: the strategies of the one decode
loop (r2lm.generation.decoding).

    ExactCache       causal / block_causal models: prompt and finished blocks as keys and values in a KVCache
                     (optionally resumed from a PrefixCache); a finished block is committed by the forward that
                     reads the next window, and (causal softmax models) the prompt by the forward that reads the
                     first window. Exact.
    Recompute        causal / block_causal, use_cache=False: the whole layout every read. The oracle of ExactCache.
    Canvas           bidirectional models (LLaDA, Dream): [prompt ; generated] re-encoded every read; with
                     approximate_cache="prefix" / "dual" Fast-dLLM's prefix / dual cache, with bicache=... BiCache's
                     stored shared prefix. APPROXIMATE (but for the no-cache case): kept keys would change as the
                     canvas fills in; they are refreshed once per block (Fast-dLLM) or never (BiCache).

Each has `read(start, window, n, clean)` -> logits [B, n, V] predicting the block's n tokens (generated
positions [start, start + n)), `commit(window)` once the block is final, `keep_rows(keep, canvas)` when finished
rows leave the batch (after a commit; `canvas` is the remaining rows' canvas), `forwards` and `close()`. The window is
the canvas columns the block is read through (r2lm.kind.ModelKind.window_columns): under `shift` the token
before the block and the block but its last token, column j predicting block token j; under `inplace` the block;
either followed by clean suffix tokens when infilling. `clean`: the window holds no [MASK].

Which one a call gets, and with which cache, is said by its `Caching` options, checked here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from r2lm.cache import KVCache
from r2lm.generation.window import WindowReader
from r2lm.layout import Layout
from r2lm.prefix.bicache import BiCache
from r2lm.prefix.cache import PrefixCache
from r2lm.prefix.prefill import prefill_rows

APPROXIMATE_CACHES = (None, "prefix", "dual")


@dataclass(frozen=True)
class Caching:
    """How committed text is held: the exact KV cache (`use_cache`; `compile`: its decode step torch.compiled;
    `prefix_cache`: resumed from an r2lm.prefix.PrefixCache), or for bidirectional models Fast-dLLM's
    `approximate_cache` or BiCache's stored prefix (`bicache`)."""

    use_cache: bool = True
    compile: bool = False
    approximate_cache: str | None = None
    prefix_cache: PrefixCache | None = None
    bicache: BiCache | None = None

    @classmethod
    def of(cls, options: dict, kind) -> Caching:
        use_cache, compile_ = bool(options.get("use_cache", True)), bool(options.get("compile", False))
        approximate, prefix_cache, bicache = (options.get(k) for k in ("approximate_cache", "prefix_cache", "bicache"))
        if approximate not in APPROXIMATE_CACHES:
            raise ValueError(f"approximate_cache must be None, 'prefix' or 'dual', got {approximate!r}")
        if approximate and kind.exact_cache:
            raise ValueError("approximate_cache is for bidirectional models; causal and block_causal models have an "
                             "exact cache")
        if prefix_cache is not None:
            if not isinstance(prefix_cache, PrefixCache):
                raise ValueError(f"prefix_cache must be an r2lm.prefix.PrefixCache, got {type(prefix_cache).__name__}")
            if not use_cache or not kind.exact_cache:
                raise ValueError("prefix_cache reuses exact keys: it needs use_cache=True and a causal or block_causal "
                                 "model")
        if bicache is not None:
            if not isinstance(bicache, BiCache):
                raise ValueError(f"bicache must be an r2lm.prefix.BiCache, got {type(bicache).__name__}")
            if kind.exact_cache:
                raise ValueError("bicache is the approximate shallow-layer prefix reuse of bidirectional models; "
                                 "causal and block_causal models reuse exact keys with prefix_cache")
            if approximate is not None:
                raise ValueError("bicache runs in the no-cache bidirectional decoder; it does not combine with "
                                 "approximate_cache")
        if compile_ and (not use_cache or not kind.exact_cache):
            raise ValueError("compile=True compiles the cached decode step: it needs use_cache=True and a causal or "
                             "block_causal model")
        return cls(use_cache, compile_, approximate, prefix_cache, bicache)


def sidecars_active(model) -> bool:
    return any(layer.sidecar is not None and bool(layer.sidecar.gate.ne(0).any()) for layer in model.model.layers)


def open_context(model, r, canvas: torch.Tensor):
    """The context of request `r` (r2lm.generation.options.Request) over its canvas."""
    if not model.config.kind.exact_cache:
        return Canvas(model, r.prompt, r.max_new_tokens, r.caching, canvas)
    if r.caching.use_cache:
        return ExactCache(model, r.prompt, r.max_new_tokens, r.caching)
    return Recompute(model, r.prompt)


def _head(model, prompt):
    """The prompt's part held as context (ModelKind.head: all of it, or all but the last token under shift)."""
    n = model.config.kind.head(prompt.input_ids.shape[1])
    return prompt.input_ids[:, :n], prompt.attention_mask[:, :n]


class ExactCache:
    """`new_tokens`: the columns to hold after the prompt (generated tokens, and a verifier's scratch)."""

    def __init__(self, model, prompt, new_tokens: int, caching: Caching):
        self.model = model
        head, head_mask = _head(model, prompt)
        batch = prompt.input_ids.shape[0]
        room = prompt.input_ids.shape[1] + new_tokens + prompt.suffix_ids.shape[1]
        self.pinned, forwards, self.head = [], 0, None
        kind = model.config.kind
        if caching.prefix_cache is not None:  # rows resume from their cached prefixes
            rows = [row[keep.bool()].tolist() for row, keep in zip(head, head_mask, strict=True)]
            self.prefix_cache = caching.prefix_cache
            cache, self.pinned, forwards = prefill_rows(model, self.prefix_cache, rows,
                                                        max(map(len, rows)) + room - head.shape[1])
        else:
            cache = KVCache(model.config, batch, room, model.dtype, model.device)
            if head.shape[1] and kind.plain_causal:  # its keys are its own, whatever is read with it
                self.head = (head, head_mask)  # appended by the forward that reads the first window
            elif head.shape[1]:  # (the prompt on the block grid, or folded block by block: its own forward)
                model.prefill(head, cache, attention_mask=head_mask)
                forwards = 1
        self.reader = WindowReader(model, cache, compile=caching.compile)
        self.reader.forwards = forwards
        # A window without [MASK] can be committed by the forward that reads it only where that forward equals the
        # commit: no active sidecar (it would touch the window), plain causal attention (the previous block's clean
        # columns are read with it as one clean span) -- the AR baseline.
        self.clean_commits = kind.shift and kind.plain_causal and not sidecars_active(model)
        self.pending = None  # a finished block's clean columns, appended by the next read
        self.committed = False  # the block being decoded was committed by the read of its clean window

    @property
    def forwards(self) -> int:
        return self.reader.forwards

    def read(self, start, window, n, clean: bool):
        if self.committed:  # the selection rules finish a block whose window is clean in that very step
            raise RuntimeError("a block whose clean window was committed still has [MASK] left")
        self.committed = clean and self.clean_commits
        own = window.shape[1] if self.committed else 0  # the window's own columns this read commits
        if self.head is not None:
            logits = self._read_after_prompt(window, n, own, noisy=not own)
            self.reader.prepare(window.shape[1], own)  # the next reads' shape (same window and commit)
            return logits
        pending = 0 if self.pending is None else self.pending.shape[1]
        ids = window if self.pending is None else torch.cat([self.pending, window], 1)
        self.pending = None
        return self.reader.read(ids, pending + own, keep=slice(pending, pending + n))

    def read_draft(self, draft, layout: Layout, capture: tuple[int, ...] = ()):
        """Logits of clean columns `draft` [B, T] (verified decoding's draft, `layout` its template: clean columns
        only, prepared by the caller), read after the committed text with their keys and values written but not
        committed: the caller advances the cache by the columns it accepts. The first read appends the prompt's head
        with them. With `capture` (layer indices): (logits, the layers' outputs over every column the forward read,
        the validity [B, H] of its H leading columns that were appended: the prompt's head; None after the first)."""
        if self.head is not None:
            mask = self.head[1]
            out = self._read_after_prompt(draft, draft.shape[1], 0, noisy=False, capture=capture)
            return (*out, mask.bool()) if capture else out
        out = self.reader.read(draft, draft.shape[1], keep=slice(None), advance=False, layout=layout, capture=capture)
        return (*out, None) if capture else out

    def _read_after_prompt(self, window, n, own, noisy: bool, capture: tuple[int, ...] = ()):
        """The first read: the prompt's head, appended to the cache, and the first window, in one forward (so a
        generation takes no forward of its own for the prefill). A one-off shape (per-row padding), so the model's
        own forward rather than the reader's kept masks; the caller builds the next reads' shape (outside the steps).
        With `capture`: (logits, the captured layers' outputs over every column)."""
        (head, mask), self.head = self.head, None
        cache, reader = self.reader.cache, self.reader
        prompt = self.model.prompt_layout(mask, start=cache.next_position)
        after = Layout.span(torch.ones_like(window), start=cache.next_position + mask.sum(1), noisy=noisy, chunk=1)
        plan = self.model.model.plan(Layout.cat(prompt, after), cache, commit=head.shape[1] + own)
        first = head.shape[1]
        reader.forwards += 1
        out = self.model(torch.cat([head, window], 1), cache=cache, plan=plan, logits_to_keep=slice(first, first + n),
                         capture=capture)
        return (out.logits, out.hidden_states) if capture else out.logits

    def commit(self, window):
        if not self.committed:
            self.pending = window
        self.committed = False

    def keep_rows(self, keep, canvas):
        self.reader.keep_rows(keep)
        if self.pending is not None:
            self.pending = self.pending[keep]

    def close(self):
        if self.pinned:
            self.prefix_cache.release(self.pinned)
            self.pinned = []


class Recompute:
    """Committed tokens kept as ids: every read recomputes the full layout."""

    def __init__(self, model, prompt):
        self.model, self.forwards = model, 0
        head, head_mask = _head(model, prompt)
        self.ids, self.layouts = [], []
        self.next_position = torch.zeros(head.shape[0], dtype=torch.long, device=head.device)
        self.next_chunk = 0
        if head.shape[1]:
            self._append(head, model.prompt_layout(head_mask), head_mask)

    def _append(self, ids, layout, mask):
        self.ids.append(ids)
        self.layouts.append(layout)
        self.next_position = self.next_position + mask.sum(1)
        self.next_chunk = int(layout.chunks.max()) + 1

    def read(self, start, window, n, clean: bool):
        win = Layout.span(torch.ones_like(window), start=self.next_position, noisy=True, chunk=self.next_chunk)
        ids = torch.cat([*self.ids, window], 1)
        first = ids.shape[1] - window.shape[1]
        self.forwards += 1
        return self.model(ids, layout=Layout.cat(*self.layouts, win), logits_to_keep=slice(first, first + n)).logits

    def commit(self, window):
        mask = torch.ones_like(window)
        self._append(window.clone(), Layout.span(mask, start=self.next_position, chunk=self.next_chunk), mask)

    def keep_rows(self, keep, canvas):
        self.ids = [ids[keep] for ids in self.ids]
        self.layouts = [layout.select_rows(keep) for layout in self.layouts]
        self.next_position = self.next_position[keep]

    def close(self):
        pass


class Canvas:
    """Bidirectional models: the canvas [prompt ; generated], with [MASK] where nothing is decoded yet; blocks are
    filled semi-autoregressively (positions beyond the current block are not candidates). Under `shift` (Dream)
    canvas position p is predicted by the logits of p - 1."""

    def __init__(self, model, prompt, new_tokens: int, caching: Caching, canvas):
        self.model, self.canvas, self.forwards = model, canvas, 0
        ids, mask = prompt.input_ids, prompt.attention_mask
        batch, self.prompt_len = ids.shape
        self.lead = model.config.kind.lead
        self.mask = torch.cat([mask, mask.new_ones(batch, canvas.shape[1] - self.prompt_len)], 1)
        self.approximate, self.cache, self.block = caching.approximate_cache, None, None
        self.reuse = None
        if caching.bicache is not None:
            self.reuse = caching.bicache.prepare(model, ids, mask, new_tokens, self.lead)

    def read(self, start, window, n, clean: bool):
        model, canvas = self.model, self.canvas
        first = self.prompt_len + start - self.lead  # the first column whose logits predict this block
        self.forwards += 1
        if self.reuse is not None:  # rest column c - P holds canvas column c (c >= padding + P: prepare() sees to it)
            col = first - self.reuse.prefix_len
            return self.reuse.logits(canvas)[:, col : col + n]
        if self.approximate is None:
            return model(canvas, attention_mask=self.mask, logits_to_keep=slice(first, first + n)).logits
        if self.block != start:  # block start: one full forward fills the cache, then keep only its left part
            self.block = start
            self.cache = KVCache(model.config, canvas.shape[0], canvas.shape[1], model.dtype, model.device)
            logits = model(canvas, attention_mask=self.mask, cache=self.cache, update_cache=True,
                           logits_to_keep=slice(first, first + n)).logits
            self.cache.rewind(first, keep_stale=self.approximate == "dual")
            return logits
        stop = first + n if self.approximate == "dual" else canvas.shape[1]
        return model(canvas[:, first:stop], cache=self.cache, logits_to_keep=slice(0, n)).logits

    def commit(self, window):
        pass

    def keep_rows(self, keep, canvas):
        self.canvas, self.mask = canvas, self.mask[keep]
        self.block = None  # an approximate cache is rebuilt at the next block start anyway
        if self.reuse is not None:
            self.reuse.keep_rows(keep)

    def close(self):
        pass

"""The model kind: what the config fields that make a model -- attention, prediction, sidecar and hybrid layers --
imply for training, decoding and scoring, derived in one place. Code reads `config.kind` (a ModelKind) instead of
comparing the fields' strings.

ATTENTION is the table of attention kinds. A row holds the rules r2lm.layout's predicate evaluates (who sees whom);
what follows from them -- which context holds committed text, whether a prompt goes in on the block grid, whether a
clean pass is an AR pass -- is derived here. A new attention kind is a row, plus a new rule in the predicate if it
needs one (tests/model/test_kind.py adds a sliding-window causal kind so). PREDICTIONS is the table of prediction
conventions: how many columns before its block a window opens.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Attention:
    """One attention kind: the rules of who sees whom (r2lm.layout's predicate evaluates them) and their consequences.

    streams: a query sees its own stream (its chunk's clean columns, or its window) and the clean columns of earlier
        chunks; False: every real column (bidirectional), so no key stays what it was when later text arrives.
    causal: inside its stream, a query sees only keys at positions up to its own.
    window: a query sees only keys fewer than `window` positions before its own, cached keys included (sliding
        window); None: no limit.
    """

    name: str
    streams: bool = True
    causal: bool = True
    window: int | None = None

    @property
    def token_causal(self) -> bool:
        """Every column sees only columns at or before its position: a clean pass over a text is an AR pass."""
        return self.streams and self.causal

    @property
    def sees_chunk(self) -> bool:
        """A clean column sees the later columns of its chunk (block_causal): where chunks end changes its key."""
        return self.streams and not self.causal


ATTENTION = {rule.name: rule for rule in (
    Attention("causal"),  # R2LM, AR backbones
    Attention("block_causal", causal=False),  # block diffusion (LLaDA 2, Fast-dLLM v2): bidirectional in a chunk
    Attention("bidirectional", streams=False, causal=False),  # LLaDA 1
)}

SHIFT, INPLACE = "shift", "inplace"
# the lead: the hidden state at i - lead predicts token i. Under shift a block's window opens with the token before
# it, and a prompt's last token is read with the first window rather than held as context.
PREDICTIONS = {SHIFT: 1, INPLACE: 0}


def attention_rule(name: str) -> Attention:
    """The row of attention kind `name`."""
    if name not in ATTENTION:
        raise ValueError(f"unknown attention kind {name!r}; expected one of {tuple(ATTENTION)}")
    return ATTENTION[name]


def prediction_lead(name: str) -> int:
    if name not in PREDICTIONS:
        raise ValueError(f"unknown prediction {name!r}; expected one of {tuple(PREDICTIONS)}")
    return PREDICTIONS[name]


@dataclass(frozen=True)
class ModelKind:
    """What a model is, derived from its config (`config.kind`)."""

    attention: Attention
    lead: int  # PREDICTIONS
    block_size: int
    sidecars: bool  # it has sidecar layers (whether their gates are open is a matter of its weights)
    hybrid: bool  # it has block-hybrid layers

    @classmethod
    def of(cls, config) -> ModelKind:
        return cls(attention_rule(config.attention), prediction_lead(config.prediction), config.block_size,
                   bool(config.sidecar_layers), bool(config.hybrid_layers))

    @property
    def shift(self) -> bool:
        return self.lead == 1

    @property
    def exact_cache(self) -> bool:
        """Committed text is held as keys and values in a KVCache, exactly; otherwise (bidirectional) every read
        re-encodes the canvas, and a cache of it can only be approximate."""
        return self.attention.streams

    @property
    def chunked(self) -> bool:
        """Where chunks end changes keys: a clean column sees the rest of its chunk (block_causal), or block-hybrid
        layers fold keys chunk by chunk. A prompt then goes in on the block grid, as training chunks its clean
        stream, and a cached prefix is reusable only up to a grid boundary."""
        return self.attention.sees_chunk or self.hybrid

    @property
    def plain_causal(self) -> bool:
        """Token-causal softmax attention: a clean span read together with what follows keeps its own keys, and can
        be appended to the cache by the forward that reads what follows."""
        return self.attention.token_causal and not self.hybrid

    @property
    def ar(self) -> bool:
        """A clean pass predicts each next token: next-token scoring, the `ar` objective."""
        return self.attention.token_causal and self.shift

    @property
    def verifiable(self) -> bool:
        """verify=True can check drafts against the clean pass (r2lm.generation.verify): an AR pass whose keys are
        written before the accepted length is known (no block-hybrid layer folding them)."""
        return self.ar and not self.hybrid

    # ------------------------------------------------------------------ the block grid

    def head(self, length: int) -> int:
        """How much of a prompt of `length` tokens is held as context: all but its last token under shift (that
        token opens the first window), all of it under inplace."""
        return length - self.lead

    def grid_floor(self, n: int) -> int:
        """The deepest prefix length <= n whose keys do not depend on later tokens: n, or under chunks the last
        block-grid boundary (block k's chunk opens at k * block_size - lead) at or before n."""
        if not self.chunked:
            return n
        k = (n + self.lead) // self.block_size
        return k * self.block_size - self.lead if k > 0 else 0

    def grid_ceil(self, n: int) -> int:
        """The end of the tokens the keys of the first n depend on: n, or under chunks the end of the chunk that
        holds token n - 1."""
        if not self.chunked:
            return n
        return -(-(n + self.lead) // self.block_size) * self.block_size - self.lead

    def window_columns(self, prompt_len: int, start: int, end: int, block_size: int, n: int, suffix: int) -> slice:
        """The canvas columns ([prompt ; n generated ; suffix]) through which the block of generated positions
        [start, end) is read: under shift the token before the block, then the block but its last token (nothing
        reads that token until the next block); under inplace the block. When infilling, clean suffix tokens within a
        block's width of the block start join its window (every one of them is an input under shift); later ones
        lie beyond the block and are not seen."""
        stop = end - 1 if self.shift and not suffix else n + suffix
        return slice(prompt_len + start - self.lead, prompt_len + min(start + block_size - self.lead, stop))

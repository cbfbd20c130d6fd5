"""BiCache: APPROXIMATE cross-request reuse of a shared prefix's keys and values in bidirectional models
(docs/notes/prefix_caching.md section 1, after Go et al., "Enabling KV Caching of Shared Prefix for Diffusion Language
Models", EMNLP 2026).

Under bidirectional attention a prefix's K/V depend on every token after it, so no reuse is exact. In shallow layers
they barely move, and how many layers count as shallow grows with the prefix ratio r = P / (P + rest): the more of
the sequence the prefix is, the less the rest can change it. So:

    table = profile(model, samples, tau)              # offline, once per model: safe depth b(r) per ratio bucket
    store = BiCache(table)
    store.add(model, prefix_ids)                      # one prefix-alone forward: every layer's K/V and hidden states
    generate(model, prompts, bicache=store)           # prompts that start with a stored prefix reuse it

One stitched forward of depth b (notes 1.4):
- layers < b run only the rest's columns, attending to the stored prefix-alone K/V plus themselves;
- layer b takes [the prefix's hidden state after b layers, computed alone ; the rest's hidden states], and
  layers >= b run on the whole sequence as usual.
b = 0 is the ordinary forward; b = num_layers never runs the prefix at all. Every depth in between changes the
outputs: that difference is what profile() bounds (through tau) and eval/bicache_bench.py measures.

Unlike the paper's engine, a request here does not also keep the deep layers' prefix K/V between denoising steps
(its "intra-request" refresh interval): each step recomputes layers >= b over the whole sequence.
"""

from __future__ import annotations

import dataclasses
import json
from bisect import bisect_right
from collections import Counter, OrderedDict
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path

import torch
import torch.nn.functional as F

from r2lm.cache import KVCache
from r2lm.layout import Layout
from r2lm.prefix.identity import bind

BUCKETS = tuple(i / 20 for i in range(20))  # lower edges of 5%-wide prefix-ratio buckets


def prefix_ratio(prefix_len: int, rest_len: int) -> float:
    """The share of the sequence that is the shared prefix. `rest_len` counts everything after the prefix: the
    question and the [MASK] canvas. profile() and BiCache both call this, so the table is read with the quantity it
    was built on (the released BiCache code profiles without the canvas and looks up with it; notes 1.1)."""
    if prefix_len <= 0 or rest_len < 0:
        raise ValueError(f"a prefix ratio needs a non-empty prefix and a rest of >= 0 tokens, got {prefix_len}, {rest_len}")
    return prefix_len / (prefix_len + rest_len)


# ---------------------------------------------------------------------------------------------- the table


@dataclass
class SafeDepthTable:
    """b(r): how many leading layers may reuse prefix-alone K/V at prefix ratio r.

    `edges` are the lower edges of the profiled buckets (only those that had samples); a ratio maps to the bucket of
    the largest edge <= r, so a ratio above the last bucket gets its depth and a ratio below the first gets 0."""

    edges: list[float]
    depths: list[int]  # after the running maximum: non-decreasing in r
    num_layers: int
    tau: float
    quantile: float  # the sample quantile a layer's similarity had to exceed tau at (0 = every sample)
    measured: list[int] = field(default_factory=list)  # depth per bucket before the running maximum
    similarity: list[list[float]] = field(default_factory=list)  # per bucket, per layer: the aggregated similarity
    samples: list[int] = field(default_factory=list)  # profiled samples per bucket

    def __post_init__(self):
        self.edges, self.depths = [float(e) for e in self.edges], [int(d) for d in self.depths]
        if len(self.edges) != len(self.depths):
            raise ValueError(f"table has {len(self.edges)} bucket edges but {len(self.depths)} depths")
        if any(not 0 <= e < 1 for e in self.edges) or any(a >= b for a, b in pairwise(self.edges)):
            raise ValueError(f"bucket edges must be increasing and in [0, 1), got {self.edges}")
        if any(not 0 <= d <= self.num_layers for d in self.depths):
            raise ValueError(f"depths must be in [0, {self.num_layers}], got {self.depths}")
        if any(a > b for a, b in pairwise(self.depths)):
            raise ValueError(f"depths must not decrease with the prefix ratio, got {self.depths}")

    def depth(self, ratio: float) -> int:
        """The safe depth at a prefix ratio (from prefix_ratio()); 0 (no reuse) below the first profiled bucket."""
        if not 0 <= ratio <= 1:
            raise ValueError(f"a prefix ratio is in [0, 1], got {ratio}")
        i = bisect_right(self.edges, ratio) - 1
        return self.depths[i] if i >= 0 else 0

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path) -> SafeDepthTable:
        return cls(**json.loads(Path(path).read_text()))


# ---------------------------------------------------------------------------------------------- profiling


@torch.no_grad()
def encode(model, ids: torch.Tensor):
    """The model's forward over one clean, unpadded span `ids` [1, T], with every layer's keys and values
    ([1, Hkv, T, d], after RoPE: what attention reads) and the hidden state after d layers for d = 0..L."""
    _check_model(model)
    inner, T = model.model, ids.shape[1]
    cache = KVCache(model.config, 1, T, model.dtype, model.device)  # never advanced: the forward writes its scratch
    plan = inner.plan(Layout.span(torch.ones_like(ids)), cache)
    h = inner.embed_tokens(ids)
    hidden = [h]
    for d in range(model.config.num_hidden_layers):
        h = inner(hidden_states=h, plan=plan, cache=cache, layers=range(d, d + 1), norm=False).last_hidden_state
        hidden.append(h)
    keys = [k[:, :, :T].clone() for k in cache.key]
    values = [v[:, :, :T].clone() for v in cache.value]
    return keys, values, hidden


def _per_token(x: torch.Tensor) -> torch.Tensor:
    """[1, Hkv, T, d] -> [T, Hkv * d] in fp32: one vector per token, heads flattened (as the paper compares them)."""
    return x[0].transpose(0, 1).flatten(1).float()


@torch.no_grad()
def layer_similarity(model, prefix_ids, rest_ids) -> torch.Tensor:
    """[L]: per layer, how much the prefix's K/V move when the rest follows it. For each of K and V, the cosine of
    every prefix token's vector alone vs in [prefix ; rest], averaged over the prefix tokens; the layer's value is
    the smaller of the two (the paper averages K and V; taking the worse one is the conservative reading)."""
    prefix, rest = _as_ids(prefix_ids, model), _as_ids(rest_ids, model)
    if prefix.numel() == 0:
        raise ValueError("layer_similarity needs a non-empty prefix")
    P = prefix.numel()
    k_alone, v_alone, _ = encode(model, prefix[None])
    k_full, v_full, _ = encode(model, torch.cat([prefix, rest])[None])
    sims = []
    for ka, va, kf, vf in zip(k_alone, v_alone, k_full, v_full, strict=True):
        k = F.cosine_similarity(_per_token(ka), _per_token(kf[:, :, :P]), dim=-1).mean()
        v = F.cosine_similarity(_per_token(va), _per_token(vf[:, :, :P]), dim=-1).mean()
        sims.append(torch.minimum(k, v))
    return torch.stack(sims)


@torch.no_grad()
def profile(model, samples, tau: float = 0.97, buckets=BUCKETS, quantile: float = 0.0) -> SafeDepthTable:
    """Build b(r) from `samples`, (prefix_ids, rest_ids) pairs of real text where rest is laid out as at decode
    time: the question followed by the [MASK] canvas.

    Each sample falls in the bucket of the largest edge <= prefix_ratio(P, len(rest)). Per bucket and layer, the
    similarity (layer_similarity) is aggregated over the bucket's samples by their `quantile`-quantile: 0 (the
    default) takes the minimum, so a layer counts as stable at a ratio only if it was for every profiled sample.
    The bucket's depth is the number of leading layers whose aggregate exceeds tau (stopping at the first that
    does not). Finally the depths take a running maximum over increasing ratio, as the paper's lookup does: a larger
    prefix share leaves the prefix at least as stable. Buckets without samples are left out of the table; samples
    below the first edge are ignored (such ratios never reuse)."""
    if not -1 < tau <= 1:
        raise ValueError(f"tau is a cosine similarity threshold in (-1, 1], got {tau}")
    if not 0 <= quantile <= 1:
        raise ValueError(f"quantile must be in [0, 1], got {quantile}")
    buckets = [float(b) for b in buckets]
    if not buckets or any(not 0 <= b < 1 for b in buckets) or any(a >= b for a, b in pairwise(buckets)):
        raise ValueError(f"buckets must be increasing lower edges in [0, 1), got {buckets}")
    per_bucket: dict[int, list[torch.Tensor]] = {}
    for prefix, rest in samples:
        prefix, rest = _as_ids(prefix, model), _as_ids(rest, model)
        ratio = prefix_ratio(prefix.numel(), rest.numel())
        i = bisect_right(buckets, ratio) - 1
        if i >= 0:
            per_bucket.setdefault(i, []).append(layer_similarity(model, prefix, rest))
    if not per_bucket:
        raise ValueError("profile needs at least one sample whose prefix ratio is in a bucket")
    edges, measured, similarity, counts = [], [], [], []
    for i in sorted(per_bucket):
        agg = torch.quantile(torch.stack(per_bucket[i]), quantile, dim=0)
        stable = (agg > tau).tolist()
        depth = stable.index(False) if False in stable else len(stable)
        edges.append(buckets[i])
        measured.append(depth)
        similarity.append([round(float(s), 6) for s in agg])
        counts.append(len(per_bucket[i]))
    depths = [max(measured[: i + 1]) for i in range(len(measured))]
    return SafeDepthTable(edges, depths, model.config.num_hidden_layers, tau, quantile, measured, similarity, counts)


# ---------------------------------------------------------------------------------------------- the store


@dataclass(eq=False)
class Entry:
    """One stored prefix, computed alone: K/V of every layer [1, Hkv, P, d] and the hidden state after d layers
    [1, P, D] for every depth d = 0..L, so one entry serves any depth the table returns."""

    tokens: tuple
    keys: list = field(repr=False)
    values: list = field(repr=False)
    hidden: list = field(repr=False)

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class Stats:
    lookups: int = 0  # generate() calls that looked up a prefix
    hits: int = 0  # calls whose prompts all started with one stored prefix
    depths: Counter = field(default_factory=Counter)  # depth used -> calls (0: a hit the table gave no reuse)
    evictions: int = 0


class BiCache:
    """Stored prefixes for APPROXIMATE shallow-layer reuse (see the module docstring), with the model's table.

    Prefixes are added explicitly (`add`), typically a shared document or system prompt. A request uses the longest
    stored prefix that its prompt starts with, as a whole: there is no partial matching inside a prefix. A batch
    reuses a prefix only when every row starts with the same one. With `capacity_tokens`, whole prefixes are
    evicted least recently used first."""

    def __init__(self, table: SafeDepthTable, capacity_tokens: int | None = None):
        if capacity_tokens is not None and capacity_tokens <= 0:
            raise ValueError(f"capacity_tokens must be positive, got {capacity_tokens}")
        self.table, self.capacity = table, capacity_tokens
        self.entries: OrderedDict[tuple, Entry] = OrderedDict()
        self.stats = Stats()
        self.identity = None  # of the model it serves (r2lm.prefix.identity)

    def bind(self, model) -> None:
        """Tie the store to one model, its configuration and its weights (entries hold its K/V; the table its
        depths); a model that differs from the one bound is refused (every call checks: r2lm.prefix.identity)."""
        _check_model(model)
        config = model.config
        if self.table.num_layers != config.num_hidden_layers:
            raise ValueError(f"the safe-depth table was profiled for {self.table.num_layers} layers, the model has "
                             f"{config.num_hidden_layers}")
        self.identity = bind(self.identity, model, "BiCache")

    def clear(self) -> None:
        """Forget every stored prefix and the model: the next call binds the store anew (e.g. to the same model after
        its weights changed; the table, profiled on the old weights, stays: profile again if they changed much)."""
        self.entries.clear()
        self.identity = None

    @property
    def tokens(self) -> int:
        return sum(e.length for e in self.entries.values())

    def add(self, model, prefix_ids) -> Entry:
        """Compute `prefix_ids` alone once and store it (a stored prefix is returned as is)."""
        self.bind(model)
        ids = _as_ids(prefix_ids, model)
        key = tuple(ids.tolist())
        if not key:
            raise ValueError("cannot store an empty prefix")
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key]
        if self.capacity is not None:
            if len(key) > self.capacity:
                raise ValueError(f"a prefix of {len(key)} tokens exceeds the capacity of {self.capacity} tokens")
            while self.tokens + len(key) > self.capacity:
                self.entries.popitem(last=False)
                self.stats.evictions += 1
        keys, values, hidden = encode(model, ids[None])
        self.entries[key] = Entry(key, keys, values, hidden)
        return self.entries[key]

    def match(self, rows: list[list[int]]) -> Entry | None:
        """The longest stored prefix that every row starts with (tokens compared), or None."""
        for n in sorted({e.length for e in self.entries.values()}, reverse=True):
            heads = {tuple(row[:n]) for row in rows}  # a row shorter than n gives a head no length-n key equals
            entry = self.entries.get(heads.pop()) if len(heads) == 1 else None
            if entry is not None:
                self.entries.move_to_end(entry.tokens)
                return entry
        return None

    def depth(self, prefix_len: int, rest_len: int) -> int:
        return self.table.depth(prefix_ratio(prefix_len, rest_len))

    def prepare(self, model, input_ids, attention_mask, new_tokens: int, lead: int = 0) -> Reuse | None:
        """How one generate() call over the canvas [prompt ; [MASK] * new_tokens] reuses a stored prefix, or None
        when it does not (no stored prefix shared by every row, or the table gives depth 0 at its ratio).

        The batch gets one depth, that of its smallest prefix ratio (the row with the longest rest). `lead` prompt
        tokens at the end are never matched: under `shift` the last prompt token's logits predict the first canvas
        token and must be computed with the rest, not taken from a stored prefix."""
        self.bind(model)
        prompts = [row[keep.bool()].tolist() for row, keep in zip(input_ids, attention_mask, strict=True)]
        self.stats.lookups += 1
        entry = self.match([p[: len(p) - lead] for p in prompts])
        if entry is None:
            return None
        self.stats.hits += 1
        depth = self.depth(entry.length, max(map(len, prompts)) - entry.length + new_tokens)
        self.stats.depths[depth] += 1
        if depth == 0:
            return None
        canvas_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], new_tokens)], 1)
        return Reuse(model, entry, depth, canvas_mask)


class Reuse:
    """One generate() call's reuse of a stored prefix at a fixed depth.

    Each row's canvas is [padding ; prefix ; rest of the prompt ; canvas]; the stitched forward sees [prefix ;
    padding ; rest ; canvas] instead, which bidirectional attention computes identically (RoPE positions come from
    the real tokens, padding is masked). So rest column j is canvas column j on the padding and j + P after it, and
    the prefix K/V are loaded once into a KVCache whose scratch columns every step overwrites."""

    def __init__(self, model, entry: Entry, depth: int, canvas_mask: torch.Tensor):
        self.model, self.entry, self.depth = model, entry, depth
        P, (batch, width) = entry.length, canvas_mask.shape
        pad = (canvas_mask == 0).sum(1, keepdim=True)
        j = torch.arange(width - P, device=canvas_mask.device)[None]
        self.columns = torch.where(j < pad, j, j + P)
        self.rest_mask = canvas_mask.gather(1, self.columns)
        self.cache = prefix_kv(model, entry, depth, batch, width - P)

    @property
    def prefix_len(self) -> int:
        return self.entry.length

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Only the rows `keep` go on decoding (finished rows leave the batch)."""
        self.columns, self.rest_mask = self.columns[keep], self.rest_mask[keep]
        self.cache.keep_rows(keep)

    def logits(self, canvas: torch.Tensor) -> torch.Tensor:
        """[B, W - P, V]: logits of the rest columns; canvas column c >= padding + P is rest column c - P."""
        return stitched_forward(self.model, self.entry, canvas.gather(1, self.columns), self.depth, self.rest_mask,
                                cache=self.cache)


# ---------------------------------------------------------------------------------------------- the stitched forward


def prefix_kv(model, entry: Entry, depth: int, batch: int, rest_len: int) -> KVCache:
    """A KVCache holding the entry's prefix-alone K/V of layers < depth, with room for `rest_len` more columns."""
    cache = KVCache(model.config, batch, entry.length + rest_len, model.dtype, model.device)
    cache.load(entry.keys[:depth], entry.values[:depth], None, entry.length)  # [1, ...] broadcasts over the batch
    return cache


@torch.no_grad()
def stitched_forward(model, entry: Entry, rest_ids: torch.Tensor, depth: int, rest_mask: torch.Tensor | None = None,
                     cache: KVCache | None = None, prefix_logits: bool = False) -> torch.Tensor:
    """APPROXIMATE logits of [entry's prefix ; rest_ids] (rest_ids [B, S], left-padded by rest_mask) with the first
    `depth` layers of the prefix taken from the entry (computed alone) instead of recomputed with the rest.

    Returns the rest's logits [B, S, V], or with `prefix_logits` those of every column [B, P + S, V]. `cache` (from
    prefix_kv, same depth and sizes) saves reloading the prefix K/V on every call."""
    config, inner = model.config, model.model
    _check_model(model)
    if not 0 <= depth <= config.num_hidden_layers:
        raise ValueError(f"depth must be in [0, {config.num_hidden_layers}], got {depth}")
    if rest_ids.dim() != 2:
        raise ValueError(f"rest_ids must be [batch, length], got {tuple(rest_ids.shape)}")
    (batch, S), P = rest_ids.shape, entry.length
    rest_mask = torch.ones_like(rest_ids) if rest_mask is None else rest_mask
    if rest_mask.shape != rest_ids.shape:
        raise ValueError(f"rest_mask {tuple(rest_mask.shape)} does not match rest_ids {tuple(rest_ids.shape)}")
    if cache is not None and (cache.length != P or cache.max_length != P + S or cache.batch_size != batch):
        raise ValueError("the prefix cache was prepared for another prefix or rest size")

    h = inner.embed_tokens(rest_ids)
    if depth and S:  # shallow layers: the rest alone, reading the prefix through its stored K/V
        cache = cache if cache is not None else prefix_kv(model, entry, depth, batch, S)
        layout = Layout.span(rest_mask, start=P)
        plan = inner.plan(layout, cache)
        rule = config.kind.attention
        if not rule.streams and rule.window is None and layout.valid is None:
            # every column sees every column, as in the ordinary forward's unmasked SDPA call
            plan = dataclasses.replace(plan, mask=None)
        h = inner(hidden_states=h, plan=plan, cache=cache, layers=range(depth), norm=False).last_hidden_state
    h = torch.cat([entry.hidden[depth].expand(batch, -1, -1), h], 1)  # the boundary: prefix rows as computed alone
    layers = range(depth, config.num_hidden_layers)  # deep layers: the whole sequence, as the ordinary forward runs them
    layout = Layout.span(torch.cat([rest_mask.new_ones(batch, P), rest_mask], 1))
    h = inner(hidden_states=h, layout=layout, layers=layers).last_hidden_state
    return model.lm_head(h if prefix_logits else h[:, P:])


# ---------------------------------------------------------------------------------------------- helpers


def _check_model(model) -> None:
    if model.config.hybrid_layers:
        raise ValueError("BiCache reuses per-token keys of every layer; block-hybrid layers keep none")


def _as_ids(ids, model) -> torch.Tensor:
    ids = torch.as_tensor(ids, dtype=torch.long, device=model.device)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"expected one sequence of token ids, got shape {tuple(ids.shape)}")
    return ids

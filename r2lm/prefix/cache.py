"""PrefixCache: clean-context keys and values shared across requests (docs/design.md section 5, issue "prefix reuse").

Token blocks of `block_tokens` form a tree keyed by chained hashes of (parent key, block tokens), as in vLLM;
a hit compares the stored tokens too, so a hash collision is a miss, never a wrong answer. Each block holds the
keys and values of its tokens for every softmax layer, computed as clean context (exact in arithmetic, see
Exactness below: a committed token's K/V depend only on tokens to its left and in its chunk). Block-hybrid layers
have no per-token keys: their (S, Z) state is kept as sparse checkpoints at positions chosen by the exact dynamic
program over the observed distribution of match depths (r2lm.prefix.placement); a hit resumes from the deepest
checkpoint it reaches and recomputes the rest.

A cache serves one model: every config field that can change its forward and every bit of its weights
(r2lm.prefix.identity), taken by the first request and checked again by every later one. Another model's requests,
or this model's once anything of it changed (an optimizer step, merge_and_unload, an edit through .data), are
refused rather than served keys and values computed by other weights: use one PrefixCache per model, or clear() it
after changing the model.

Exactness. The cache adds no error of its own: the keys, values and hybrid states a hit reads are bit-identical to
the ones the request that stored them computed. Decoding with a PrefixCache (even an empty one) is exact up to
float rounding, not bit-exact, against decoding without one: it computes the same function with differently shaped
matrix products (each row prefilled alone rather than in a padded batch, a prompt's uncached rest as its own
piece, hybrid rows in pieces ending at their checkpoints), and kernels round by shape. Logits agree to rounding
error; a token whose top-2 logits are closer than that can flip (tests/prefix/test_prefix_cache.py tests both claims).

Blocks in use by a running request are pinned by reference counts; only unpinned leaves (no cached children)
can be evicted, in the order of an LRU or ARC policy (r2lm.prefix.eviction).

Where chunks matter (block_causal attention, block-hybrid layers) a token's keys depend on its whole chunk, so
reuse stops at the last chunk boundary a match reaches and only complete chunks are stored; and a block is keyed
by its tokens and the rest of the chunk its last token is in, so two prompts that agree on a block but not on
its whole chunk keep a block each (the keys of the shared tokens differ).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from r2lm.prefix.eviction import make_policy
from r2lm.prefix.identity import bind
from r2lm.prefix.placement import DepthHistogram, place_checkpoints


@dataclass(eq=False)
class Block:
    key: int
    parent: int | None
    tokens: tuple  # the block's tokens, then (chunked models) the rest of its last token's chunk
    keys: list  # per layer [Hkv, block_tokens, head_dim], None for hybrid layers
    values: list
    checkpoints: dict = field(default_factory=dict)  # position -> per-layer (S, Z) (None for softmax layers)
    refs: int = 0
    children: int = 0


@dataclass
class Stats:
    lookups: int = 0  # prompts looked up
    hits: int = 0  # prompts that reused at least one token
    lookup_tokens: int = 0  # tokens looked up
    hit_tokens: int = 0  # tokens served from the cache (reused, not recomputed)
    inserted: int = 0  # blocks stored
    evictions: int = 0
    collisions: int = 0  # hash matches whose stored tokens differed

    @property
    def hit_rate(self) -> float:
        """Share of looked-up tokens served from the cache."""
        return self.hit_tokens / max(self.lookup_tokens, 1)


class PrefixCache:
    def __init__(self, capacity_tokens: int, block_tokens: int = 16, policy: str = "arc", checkpoints: int = 4,
                 max_depth: int = 8192, max_roots: int = 1024):
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        if capacity_tokens < block_tokens:
            raise ValueError(f"capacity_tokens {capacity_tokens} is below one block of {block_tokens} tokens")
        self.block_tokens = block_tokens
        self.capacity = capacity_tokens // block_tokens  # in blocks
        self.policy_name = policy
        self.checkpoints_per_sequence = checkpoints
        self.max_blocks = max_depth // block_tokens
        self.max_roots = max_roots
        self.blocks: dict[int, Block] = {}
        self.clear()

    def clear(self) -> None:
        """Forget every block, every statistic and the model: the next request binds the cache anew (e.g. to the
        same model after its weights changed). Not while a request holds blocks."""
        if any(block.refs for block in self.blocks.values()):
            raise ValueError("cannot clear a PrefixCache while a request is using its blocks")
        self.policy = make_policy(self.policy_name, self.capacity)
        # Match depths, in blocks (a match is a whole number of blocks): of every lookup, and per first block,
        # i.e. per cached entry, for the most recently seen `max_roots` entries.
        self.depths = DepthHistogram(self.max_blocks)
        self.root_depths: OrderedDict[int, DepthHistogram] = OrderedDict()
        self.blocks = {}
        self.stats = Stats()
        self.identity = None  # of the model it serves (r2lm.prefix.identity)

    # ------------------------------------------------------------------ the model it serves

    def bind(self, model) -> None:
        """Tie the cache to one model, its configuration and its weights (every request calls this: it reads every
        weight once, at about the cost of one batch-1 forward); a model that differs from the one bound is refused."""
        if self.identity is None:
            config = model.config
            if config.kind.chunked and config.block_size % self.block_tokens:
                raise ValueError(
                    f"block_tokens {self.block_tokens} must divide the model's block_size {config.block_size}: its "
                    "prompts are committed block by block, and cached keys are only reusable up to a block boundary"
                )
        self.identity = bind(self.identity, model, "PrefixCache")

    def span(self, config, start: int) -> int:
        """The end of the tokens the keys of the block at `start` depend on: its own, and under chunks the rest of
        the chunk its last token is in."""
        return config.kind.grid_ceil(start + self.block_tokens)

    def boundary(self, config, n: int) -> int:
        """The deepest prefix length <= n whose keys do not depend on later tokens."""
        return config.kind.grid_floor(n)

    # ------------------------------------------------------------------ lookup

    def _hash(self, parent: int | None, tokens: tuple) -> int:
        return hash((parent, tokens))

    def match(self, config, tokens: list[int]) -> list[Block]:
        """The cached blocks covering the longest prefix of `tokens` made of full blocks (tokens compared, with
        the rest of their chunks)."""
        found, parent, bt = [], None, self.block_tokens
        for start in range(0, len(tokens) - bt + 1, bt):
            if self.span(config, start) > len(tokens):
                break
            piece = tuple(tokens[start : self.span(config, start)])
            block = self.blocks.get(self._hash(parent, piece))
            if block is None:
                break
            if block.tokens != piece or block.parent != parent:
                self.stats.collisions += 1
                break
            found.append(block)
            parent = block.key
        return found

    def lookup(self, config, tokens: list[int]):
        """(blocks to pin, reusable length n, per-layer hybrid state at n or None) for one prompt."""
        blocks = self.match(config, tokens)
        matched = len(blocks) * self.block_tokens
        self.depths.observe(len(blocks))
        root = self._root(tokens)
        if root is not None:
            if root not in self.root_depths:
                self.root_depths[root] = DepthHistogram(self.max_blocks)
                if len(self.root_depths) > self.max_roots:
                    self.root_depths.popitem(last=False)
            self.root_depths.move_to_end(root)
            self.root_depths[root].observe(len(blocks))
        n = self.boundary(config, min(matched, len(tokens)))
        state = None
        if config.hybrid_layers:  # resume from the deepest checkpoint at or below n
            points = {q: s for block in blocks for q, s in block.checkpoints.items() if q <= n}
            n = max(points, default=0)
            state = points.get(n)
        self.stats.lookups += 1
        self.stats.lookup_tokens += len(tokens)
        self.stats.hit_tokens += n
        self.stats.hits += n > 0
        used = blocks[: -(-n // self.block_tokens)] if n else []
        self.pin(used)
        return used, n, state

    def pin(self, blocks: list[Block]) -> None:
        for block in blocks:
            block.refs += 1
        if blocks:
            self.policy.touch([b.key for b in blocks])

    def release(self, blocks: list[Block]) -> None:
        for block in blocks:
            block.refs -= 1

    # ------------------------------------------------------------------ insertion

    def checkpoint_positions(self, config, start: int, end: int, tokens: list[int] | None = None) -> list[int]:
        """Where to keep hybrid-layer states along a new sequence resumed at `start` and stored up to `end`: the DP's
        choice among chunk boundaries in (start, end] whose block gets stored, under the match depths observed for
        this sequence's first block (or all sequences, before it has any) and a linear recompute cost, the savings
        counted from `start`, where this request resumed."""
        if not config.hybrid_layers or end <= start:
            return []
        bt = self.block_tokens
        candidates = sorted({self.boundary(config, q) for q in range(start + 1, end + 1)})
        # a checkpoint at q lives in the block holding token q - 1: that block must be one insert() stores
        candidates = [q for q in candidates if start < q and -(-q // bt) * bt <= end]
        if not candidates:
            return []
        depths = self._depths_for(tokens)
        survival = lambda x: depths.survival(-(-(x + start) // bt))  # noqa: E731  P(match >= start + x tokens)
        placement = place_checkpoints([q - start for q in candidates], lambda t: t, survival, self.checkpoints_per_sequence)
        return [q + start for q in placement.positions]

    def _root(self, tokens: list[int] | None):
        if tokens is None or len(tokens) < self.block_tokens:
            return None
        return self._hash(None, tuple(tokens[: self.block_tokens]))

    def _depths_for(self, tokens: list[int] | None) -> DepthHistogram:
        own = self.root_depths.get(self._root(tokens))
        return own if own is not None and own.total > 0 else self.depths

    def insert(self, config, tokens: list[int], keys: list, values: list, states: dict) -> None:
        """Store the blocks of `tokens` not cached yet. keys/values: per layer [Hkv, len, d] (None for hybrid
        layers) of the first len(tokens) tokens; states: position -> per-layer (S, Z) checkpoints."""
        bt, usable = self.block_tokens, self.boundary(config, len(tokens))
        parent, chain = None, []  # the chain is pinned while it grows: making room must not evict its own parent
        try:
            for start in range(0, usable - bt + 1, bt):
                piece = tuple(tokens[start : self.span(config, start)])  # within usable: it ends on a chunk boundary
                key = self._hash(parent, piece)
                block = self.blocks.get(key)
                if block is not None and (block.tokens != piece or block.parent != parent):
                    self.stats.collisions += 1
                    break  # another prefix owns this key: keep the first, cache nothing below
                if block is None:
                    if not self._make_room(key):
                        break
                    block = Block(
                        key, parent, piece,
                        [None if k is None else k[:, start : start + bt].clone() for k in keys],
                        [None if v is None else v[:, start : start + bt].clone() for v in values],
                    )
                    self.blocks[key] = block
                    self.policy.admit(key)
                    if parent is not None:
                        self.blocks[parent].children += 1
                    self.stats.inserted += 1
                block.refs += 1
                chain.append(block)
                for q, state in states.items():
                    if start < q <= start + bt:
                        block.checkpoints.setdefault(q, state)
                parent = key
        finally:
            self.release(chain)

    def _make_room(self, incoming: int) -> bool:
        while len(self.policy) >= self.capacity:
            victim = self.policy.victim(self._evictable, incoming=incoming)
            if victim is None:
                return False  # everything is pinned or interior: do not cache
            block = self.blocks.pop(victim)
            if block.parent is not None:
                self.blocks[block.parent].children -= 1
            self.stats.evictions += 1
        return True

    def _evictable(self, key) -> bool:
        block = self.blocks[key]
        return block.refs == 0 and block.children == 0

    def __len__(self) -> int:
        """Blocks held."""
        return len(self.blocks)

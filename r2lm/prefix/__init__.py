"""Cross-request prefix reuse: the block store (PrefixCache, used as generate(..., prefix_cache=...)), which
blocks to keep (eviction) and where to keep recurrent-state checkpoints along a cached sequence (placement).
See docs/notes/prefix_caching.md sections 2 and 3. BiCache (section 1) is the separate, APPROXIMATE shallow-layer reuse of
a shared prefix for bidirectional models."""

from r2lm.prefix.bicache import BiCache, SafeDepthTable, prefix_ratio, profile
from r2lm.prefix.cache import PrefixCache
from r2lm.prefix.eviction import ARCPolicy, EvictionPolicy, LRUPolicy, make_policy
from r2lm.prefix.placement import (
    DepthHistogram,
    Placement,
    block_spacing,
    expected_gain,
    expected_recompute,
    last_only,
    place_checkpoints,
    place_checkpoints_quadratic,
    uniform,
)

__all__ = [
    "PrefixCache",
    "BiCache",
    "SafeDepthTable",
    "prefix_ratio",
    "profile",
    "ARCPolicy",
    "DepthHistogram",
    "EvictionPolicy",
    "LRUPolicy",
    "Placement",
    "block_spacing",
    "expected_gain",
    "expected_recompute",
    "last_only",
    "make_policy",
    "place_checkpoints",
    "place_checkpoints_quadratic",
    "uniform",
]

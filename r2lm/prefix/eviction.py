"""Eviction policies for the prefix-block store: LRU and ARC (Megiddo and Modha, FAST 2003).

A policy only orders keys (hashable block ids); the store owns the tensors, the reference counts and the
tree shape. The store drives it with four calls:

    admit(key)          a newly computed block became resident
    touch(keys)         a request matched these resident blocks (root first)
    victim(evictable)   the store needs one slot: pick a resident block and record its eviction
    forget(key)         the store dropped a block for another reason

Keeping "which blocks may go" out of the policy (the `evictable` predicate: ref count 0 and no cached
children) is what lets ARC run over a prefix tree: pinned blocks and interior nodes are skipped in place
rather than moved, so the recency order stays honest. Keeping the resident count within `capacity` is the
store's job: it calls victim() while full, before admit().
"""

from __future__ import annotations

import numbers
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable


class EvictionPolicy(ABC):
    """Recency bookkeeping over resident block keys; subclasses implement every method below."""

    def __init__(self, capacity: int):
        if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral) or capacity < 1:
            raise ValueError(f"an eviction policy needs an integer capacity >= 1 (in blocks), got {capacity!r}")
        self.capacity = int(capacity)

    @abstractmethod
    def admit(self, key: Hashable) -> None:
        """`key` became resident (admitting a resident key counts as a hit)."""
        ...

    @abstractmethod
    def touch(self, keys: list) -> None:
        """A request hit these resident blocks, given root first. Applied deepest first, so that ancestors
        end more recent than their descendants and a chain is evicted from its tail."""
        ...

    @abstractmethod
    def victim(self, evictable: Callable[[Hashable], bool], incoming: Hashable | None = None):
        """Pick the block to evict now among resident keys with `evictable(key)` True, scanning from the
        least recently used end, and record the eviction (the key stops being resident). Returns None, with
        no state change, when nothing is evictable. `incoming`, if given, is the key about to be admitted:
        ARC uses it to apply the paper's order (adapt p on a ghost hit, then replace)."""
        ...

    @abstractmethod
    def forget(self, key: Hashable) -> None:
        """Drop `key` everywhere (no ghost entry); a no-op for unknown keys."""
        ...

    @abstractmethod
    def __contains__(self, key) -> bool:  # resident?
        ...

    @abstractmethod
    def __len__(self) -> int:  # resident count
        ...


_NOBODY = object()  # a sentinel no block key can equal


def _first(order: Iterable, evictable: Callable) -> Hashable | None:
    """The least recently used key of `order` that may be evicted."""
    return next((k for k in order if evictable(k)), None)


class LRUPolicy(EvictionPolicy):
    """Plain LRU over resident blocks: one OrderedDict, LRU first."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.order: OrderedDict = OrderedDict()

    def admit(self, key):
        self.order[key] = None
        self.order.move_to_end(key)

    def touch(self, keys):
        for key in reversed(keys):
            if key not in self.order:
                raise KeyError(f"touch() of a block that is not resident: {key!r}")
            self.order.move_to_end(key)

    def victim(self, evictable, incoming=None):
        key = _first(self.order, evictable)
        if key is not None:
            del self.order[key]
        return key

    def forget(self, key):
        self.order.pop(key, None)

    def __contains__(self, key):
        return key in self.order

    def __len__(self):
        return len(self.order)


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache over resident blocks.

    t1: resident, seen once recently; t2: resident, seen at least twice; b1, b2: ghost keys evicted from t1,
    t2. All four are OrderedDicts with the LRU end first. p in [0, c] is the adaptive target size of t1: a hit
    in b1 means t1 was too small (p grows), a hit in b2 means t2 was (p shrinks). Directory bounds, as in the
    paper: |t1| + |b1| <= c and |t1| + |t2| + |b1| + |b2| <= 2c (given the store keeps |t1| + |t2| <= c).

    Driven as "victim(evictable, incoming=x) while full, then admit(x)" with everything evictable, this is
    exactly ARC(c) of the paper's Fig. 4 (tests/prefix/test_prefix_eviction.py checks it against a transcription).
    """

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.p = 0.0
        self.t1: OrderedDict = OrderedDict()
        self.t2: OrderedDict = OrderedDict()
        self.b1: OrderedDict = OrderedDict()
        self.b2: OrderedDict = OrderedDict()
        self.ghost_hits_b1 = 0
        self.ghost_hits_b2 = 0
        self._adapted_for = _NOBODY  # the incoming ghost key whose p update victim() already applied

    def _target(self, key) -> float:
        """p after a ghost hit on `key` (Cases II and III), or p itself when `key` is no ghost or its hit was
        already applied. A B1 hit means T1 was too small, a B2 hit that T2 was; the step is the paper's
        delta1 = 1 if |B1| >= |B2| else |B2|/|B1| (delta2 symmetric), i.e. max(1, ratio)."""
        c = float(self.capacity)
        if key == self._adapted_for:
            return self.p
        if key in self.b1:
            return min(c, self.p + max(1.0, len(self.b2) / len(self.b1)))
        if key in self.b2:
            return max(0.0, self.p - max(1.0, len(self.b1) / len(self.b2)))
        return self.p

    def _adapt(self, key) -> None:
        """Apply a ghost hit once per admission, by whichever of victim(incoming=key) / admit(key) sees it
        first: the paper updates p before REPLACE, with the ghost list sizes from before it."""
        if key == self._adapted_for or (key not in self.b1 and key not in self.b2):
            return
        self.p = self._target(key)
        if key in self.b1:
            self.ghost_hits_b1 += 1
        else:
            self.ghost_hits_b2 += 1
        self._adapted_for = key

    def admit(self, key):
        if key in self:  # Case I
            self.touch([key])
            return
        self._adapt(key)
        self._adapted_for = _NOBODY
        if key in self.b1 or key in self.b2:  # Cases II, III: seen before, so it is frequent
            self.b1.pop(key, None)
            self.b2.pop(key, None)
            self.t2[key] = None
        else:  # Case IV: new
            self.t1[key] = None
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        # Case IV's "delete LRU(B1)" / "delete LRU(B2)", stated as the bounds they restore; a ghost just
        # created by victim() for a full T1 (paper: evict LRU(T1) with no ghost, B1 being empty) goes here too.
        c = self.capacity
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            self.b2.popitem(last=False)
        while self.b1 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            self.b1.popitem(last=False)

    def touch(self, keys):
        for key in reversed(keys):
            if key in self.t1:
                del self.t1[key]
                self.t2[key] = None
            elif key in self.t2:
                self.t2.move_to_end(key)
            else:
                raise KeyError(f"touch() of a block that is not resident: {key!r}")

    def victim(self, evictable, incoming=None):
        # REPLACE(x, p): take from T1 when it is over target; on a tie, an x coming back from B2 (a frequent
        # block) also takes from T1. Fall back to the other list when the preferred one has nothing evictable.
        fresh = incoming is not None and incoming not in self
        p = self._target(incoming) if fresh else self.p
        t1_first = len(self.t1) > p or (fresh and incoming in self.b2 and len(self.t1) == p)
        order = [(self.t1, self.b1), (self.t2, self.b2)]
        for src, ghosts in order if t1_first else order[::-1]:
            key = _first(src, evictable)
            if key is not None:
                if fresh:
                    self._adapt(incoming)
                del src[key]
                ghosts[key] = None
                return key
        return None

    def forget(self, key):
        for lst in (self.t1, self.t2, self.b1, self.b2):
            lst.pop(key, None)

    def __contains__(self, key):
        return key in self.t1 or key in self.t2

    def __len__(self):
        return len(self.t1) + len(self.t2)


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """The policy called `name` ("lru" or "arc") over `capacity` blocks."""
    policies = {"lru": LRUPolicy, "arc": ARCPolicy}
    if name not in policies:
        raise ValueError(f"unknown eviction policy {name!r}; expected one of {sorted(policies)}")
    return policies[name](capacity)

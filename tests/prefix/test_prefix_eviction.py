"""LRU and ARC over prefix blocks: ARC against a transcription of the paper, scan resistance, adaptation of p,
ghost hits, the `evictable` predicate (pins and interior nodes), reverse-order touch and the directory bounds."""

import random

import pytest

from r2lm.prefix import ARCPolicy, EvictionPolicy, LRUPolicy, make_policy

ALL = lambda key: True  # noqa: E731


def request(policy, key, evictable=ALL):
    """What the block store does for one block: a hit is touched; a miss evicts while full, then is admitted
    (or not cached at all when nothing can go). Returns whether it was a hit."""
    if key in policy:
        policy.touch([key])
        return True
    while len(policy) >= policy.capacity:
        if policy.victim(evictable, incoming=key) is None:
            return False
    policy.admit(key)
    return False


class PaperARC:
    """ARC(c) transcribed case by case from Megiddo and Modha (FAST 2003), Fig. 4. Lists are LRU first."""

    def __init__(self, c):
        self.c, self.p = c, 0.0
        self.t1, self.t2, self.b1, self.b2 = [], [], [], []

    def replace(self, x):
        if self.t1 and (len(self.t1) > self.p or (x in self.b2 and len(self.t1) == self.p)):
            self.b1.append(self.t1.pop(0))
        else:
            self.b2.append(self.t2.pop(0))

    def request(self, x):
        c = self.c
        if x in self.t1 or x in self.t2:  # Case I
            (self.t1 if x in self.t1 else self.t2).remove(x)
            self.t2.append(x)
        elif x in self.b1:  # Case II
            delta = 1 if len(self.b1) >= len(self.b2) else len(self.b2) / len(self.b1)
            self.p = min(self.p + delta, c)
            self.replace(x)
            self.b1.remove(x)
            self.t2.append(x)
        elif x in self.b2:  # Case III
            delta = 1 if len(self.b2) >= len(self.b1) else len(self.b1) / len(self.b2)
            self.p = max(self.p - delta, 0)
            self.replace(x)
            self.b2.remove(x)
            self.t2.append(x)
        else:  # Case IV
            l1 = len(self.t1) + len(self.b1)
            if l1 == c:
                if len(self.t1) < c:
                    self.b1.pop(0)
                    self.replace(x)
                else:
                    self.t1.pop(0)
            else:
                total = l1 + len(self.t2) + len(self.b2)
                if total >= c:
                    if total == 2 * c:
                        self.b2.pop(0)
                    self.replace(x)
            self.t1.append(x)


def mixed_trace(rng, n, hot=6, cold=40):
    """Hot keys, a cold pool revisited now and then, and one-time scans, with the mix drifting over time."""
    out, fresh = [], 0
    for t in range(n):
        phase = (t // 400) % 3
        r = rng.random()
        if r < (0.5, 0.2, 0.35)[phase]:
            out.append(("hot", rng.randrange(hot)))
        elif r < 0.8:
            out.append(("cold", rng.randrange(cold)))
        else:
            fresh += 1
            out.append(("scan", fresh))
    return out


@pytest.mark.parametrize("c", [1, 2, 3, 5, 8, 13])
def test_arc_is_the_paper_algorithm_when_everything_is_evictable(c):
    rng = random.Random(c)
    ours, paper = ARCPolicy(c), PaperARC(c)
    for x in mixed_trace(rng, 3000):
        request(ours, x)
        paper.request(x)
        assert (list(ours.t1), list(ours.t2), list(ours.b1), list(ours.b2)) == (paper.t1, paper.t2, paper.b1, paper.b2)
        assert ours.p == paper.p


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_one_time_scan_and_reused_working_set(name):
    """ARC keeps a twice-used working set through a long one-time scan; LRU loses it."""
    policy, work = make_policy(name, 8), [("w", i) for i in range(4)]
    for _ in range(2):
        for key in work:
            request(policy, key)
    for i in range(50):
        request(policy, ("scan", i))
    kept = sum(key in policy for key in work)
    assert kept == (4 if name == "arc" else 0)
    # Keep alternating reuse and scans longer than the cache: ARC hits every reuse, LRU none.
    hits = 0
    for r in range(20):
        hits += sum(request(policy, key) for key in work)
        for i in range(10):
            request(policy, ("scan", r, i))
    assert hits == (80 if name == "arc" else 0)


def test_p_adapts_both_ways_and_ghost_hits_are_counted():
    arc = ARCPolicy(2)
    for key in "aab":  # a twice (T2), b once (T1)
        request(arc, key)
    request(arc, "c")  # full: T1 is over p = 0, so b goes to B1
    assert (list(arc.t1), list(arc.t2), list(arc.b1), list(arc.b2), arc.p) == (["c"], ["a"], ["b"], [], 0.0)
    request(arc, "b")  # B1 hit: T1 was too small; p = 0 + max(1, |B2|/|B1|) = 1; now |T1| = p, so a goes
    assert (arc.p, arc.ghost_hits_b1, arc.ghost_hits_b2) == (1.0, 1, 0)
    assert (list(arc.t1), list(arc.t2), list(arc.b1), list(arc.b2)) == (["c"], ["b"], [], ["a"])
    request(arc, "a")  # B2 hit: T2 was too small; p = 1 - max(1, |B1|/|B2|) = 0
    assert (arc.p, arc.ghost_hits_b1, arc.ghost_hits_b2) == (0.0, 1, 1)
    assert (list(arc.t1), list(arc.t2), list(arc.b1), list(arc.b2)) == ([], ["b", "a"], ["c"], [])


def test_p_follows_a_workload_shift():
    """Blocks asked for again a few requests later (recency pays) push p up to c; then a reused hot set mixed
    with scans (frequency pays) pulls it back down, after which every hot request hits."""
    arc, c, ghosts = ARCPolicy(8), 8, 0

    def ask(key):
        nonlocal ghosts
        ghosts += key in arc.b1 or key in arc.b2
        return request(arc, key)

    for i in range(300):
        ask(("new", i))
        if i >= 6:
            ask(("new", i - 6))
    assert arc.p == c and arc.ghost_hits_b1 > 0 and arc.ghost_hits_b2 == 0
    hot = [("hot", i) for i in range(6)]
    for key in hot + hot:
        ask(key)
    for r in range(20):
        hits = sum(ask(key) for key in hot)
        for i in range(4):
            ask(("scan", r, i))
    assert arc.p < 1 and arc.ghost_hits_b2 > 0
    assert hits == len(hot)
    assert arc.ghost_hits_b1 + arc.ghost_hits_b2 == ghosts


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_victim_respects_evictable(name):
    policy = make_policy(name, 4)
    for key in "abcd":
        policy.admit(key)
    pinned = {"a", "b"}
    assert policy.victim(lambda k: k not in pinned) == "c"
    assert "c" not in policy and len(policy) == 3
    before = repr(vars(policy))
    assert policy.victim(lambda k: False) is None
    assert repr(vars(policy)) == before  # no side effect when nothing can go
    assert policy.victim(lambda k: k != "d") in {"a", "b"}


def test_arc_falls_back_to_the_other_list():
    arc = ARCPolicy(4)
    for key in ["x", "x", "y", "y", "a", "b"]:  # T2 = [x, y], T1 = [a, b]
        request(arc, key)
    assert arc.victim(lambda k: k in {"x", "y"}) == "x"  # T1 is over p = 0 but fully pinned
    assert list(arc.b2) == ["x"]
    arc.p = 4.0  # T1 is under target, but nothing in T2 may go
    assert arc.victim(lambda k: k in {"a", "b"}) == "a"
    assert list(arc.b1) == ["a"]


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_only_unpinned_leaves_are_ever_evicted(name):
    """The store's predicate: ref count 0 and no cached children. Interior and pinned blocks never come back."""
    rng = random.Random(7)
    policy, parent, children, refs = make_policy(name, 12), {}, {}, {}
    leaf_free = lambda k: refs[k] == 0 and children[k] == 0  # noqa: E731
    for t in range(3000):
        if rng.random() < 0.6 or not len(policy):  # a request extends a random resident block (or a new root)
            resident = [k for k in parent if k in policy]
            up = rng.choice(resident) if resident and rng.random() < 0.8 else None
            key = t
            if up is not None:
                refs[up] += 1  # the request extending `up` holds it while its new block is stored
            while len(policy) >= policy.capacity:
                v = policy.victim(leaf_free, incoming=key)
                if v is None:
                    break
                assert leaf_free(v)
                if parent[v] is not None:
                    children[parent[v]] -= 1
                del parent[v], children[v], refs[v]
            if len(policy) < policy.capacity:
                policy.admit(key)
                parent[key], children[key], refs[key] = up, 0, 0
                if up is not None:
                    children[up] += 1
            if up is not None:
                refs[up] -= 1
        else:  # pin or unpin a chain from a random resident block up to its root, touched root first
            node = rng.choice(list(parent))
            chain = []
            while node is not None:
                chain.append(node)
                node = parent[node]
            chain.reverse()
            policy.touch(chain)
            for k in chain:
                refs[k] = max(0, refs[k] + rng.choice([1, -1]))
        if all(not leaf_free(k) for k in parent):
            assert policy.victim(leaf_free) is None


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_reverse_touch_makes_the_parent_more_recent_than_its_child(name):
    policy = make_policy(name, 4)
    for key in ["root", "mid", "leaf"]:
        policy.admit(key)
    policy.touch(["root", "mid", "leaf"])
    order = list(policy.order) if name == "lru" else list(policy.t2)
    assert order == ["leaf", "mid", "root"]  # LRU end first: the tail block goes first
    assert policy.victim(ALL) == "leaf"


def test_arc_directory_bounds_hold_on_a_long_random_trace():
    rng = random.Random(11)
    for c in (1, 4, 16):
        arc, pinned = ARCPolicy(c), set()  # `pinned` is only ever updated in place
        for key in mixed_trace(rng, 4000, hot=c, cold=3 * c):
            r = rng.random()
            if r < 0.05 and len(arc):
                pinned ^= {rng.choice(list(arc.t1) + list(arc.t2))}
            elif r < 0.08:
                arc.forget(rng.choice([key, ("hot", 0), ("cold", 1)]))
            request(arc, key, evictable=lambda k, pinned=pinned: k not in pinned)
            lists = [set(arc.t1), set(arc.t2), set(arc.b1), set(arc.b2)]
            assert sum(map(len, lists)) == len(set().union(*lists))  # disjoint
            assert len(arc) == len(arc.t1) + len(arc.t2) <= c
            assert len(arc.t1) + len(arc.b1) <= c
            assert len(arc.t1) + len(arc.t2) + len(arc.b1) + len(arc.b2) <= 2 * c
            assert 0.0 <= arc.p <= c
            pinned.intersection_update(set(arc.t1) | set(arc.t2))


def test_lru_basic_order():
    lru = LRUPolicy(3)
    for key in "abc":
        lru.admit(key)
    lru.touch(["a"])
    assert list(lru.order) == ["b", "c", "a"]
    assert lru.victim(ALL) == "b" and "b" not in lru and len(lru) == 2
    lru.admit("c")  # re-admitting a resident block is a hit
    assert list(lru.order) == ["a", "c"]


def test_forget_touch_and_make_policy():
    arc = ARCPolicy(2)
    for key in "abc":
        request(arc, key)
    assert (list(arc.t1), list(arc.b1)) == (["b", "c"], [])  # T1 was the whole cache: a left without a ghost
    arc = ARCPolicy(2)
    for key in "aabc":
        request(arc, key)
    assert (list(arc.t1), list(arc.t2), list(arc.b1)) == (["c"], ["a"], ["b"])
    arc.forget("b")  # a ghost
    arc.forget("a")  # a resident block
    arc.forget("zzz")  # unknown: no-op
    assert (list(arc.t1), list(arc.t2), list(arc.b1), len(arc)) == (["c"], [], [], 1)
    with pytest.raises(KeyError):
        arc.touch(["a"])
    with pytest.raises(KeyError):
        LRUPolicy(2).touch(["a"])
    assert isinstance(make_policy("lru", 3), LRUPolicy) and isinstance(make_policy("arc", 3), ARCPolicy)
    assert isinstance(make_policy("arc", 1), EvictionPolicy)
    for bad in [("lfu", 3), ("ARC", 3), ("arc", 0), ("lru", -1), ("arc", 2.5), ("arc", True)]:
        with pytest.raises(ValueError):
            make_policy(*bad)

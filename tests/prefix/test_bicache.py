"""BiCache (r2lm.prefix.bicache): the stitched forward, the profiler and its table, and generate(bicache=...)."""

from itertools import pairwise

import pytest
import torch

from r2lm import generate
from r2lm.layout import Layout
from r2lm.prefix import BiCache, SafeDepthTable, prefix_ratio, profile
from r2lm.prefix.bicache import encode, layer_similarity, stitched_forward
from tests.helpers.models import MASK_ID, tiny_r2lm

L = 4  # layers of the tiny models


def bidir(prediction="inplace", **kw):
    return tiny_r2lm(attention="bidirectional", sidecar_layers=[], prediction=prediction, **kw)


def ids(n, seed=1):
    return torch.randint(0, MASK_ID, (n,), generator=torch.Generator().manual_seed(seed))


def fixed(depth):
    """A table that gives `depth` at every ratio."""
    return SafeDepthTable([0.0], [depth], L, tau=0.9, quantile=0.0)


def store_with(model, prefix, depth):
    store = BiCache(fixed(depth))
    store.add(model, prefix)
    return store


def reference(model, prefix, rest, depth):
    """The stitched forward written the naive way: the full sequence through every layer, with the prefix rows
    overwritten by their prefix-alone hidden states for d <= depth (so shallow layers read prefix-alone K/V)."""
    alone = encode(model, prefix[None])[2]
    inner, P = model.model, prefix.numel()
    x = torch.cat([prefix, rest])[None]
    plan = inner.plan(Layout.span(torch.ones_like(x)))
    h = inner.embed_tokens(x)
    for d, layer in enumerate(inner.layers):
        if d <= depth:
            h = torch.cat([alone[d], h[:, P:]], 1)
        h, _ = layer(h, plan)
    if depth == L:
        h = torch.cat([alone[L], h[:, P:]], 1)
    return model.lm_head(inner.norm(h))[:, P:]


# ---------------------------------------------------------------------------------------------- stitched forward


@torch.no_grad()
def test_depth_zero_is_the_ordinary_forward():
    model = bidir()
    prefix, rest = ids(20), torch.cat([ids(6, 2), torch.full((10,), MASK_ID)])
    entry = BiCache(fixed(0)).add(model, prefix)
    full = model(torch.cat([prefix, rest])[None]).logits
    got = stitched_forward(model, entry, rest[None], 0, prefix_logits=True)
    torch.testing.assert_close(got, full, atol=1e-5, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("depth", [0, 2, L])
def test_empty_rest_is_the_prefix_alone(depth):
    model = bidir()
    prefix = ids(16)
    entry = BiCache(fixed(depth)).add(model, prefix)
    got = stitched_forward(model, entry, prefix.new_zeros(1, 0), depth, prefix_logits=True)
    torch.testing.assert_close(got, model(prefix[None]).logits, atol=1e-5, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("depth", [1, 3, L])
def test_stitched_forward_matches_the_naive_reference(depth):
    model = bidir()
    prefix, rest = ids(18), torch.cat([ids(5, 3), torch.full((8,), MASK_ID)])
    entry = BiCache(fixed(depth)).add(model, prefix)
    got = stitched_forward(model, entry, rest[None], depth)
    torch.testing.assert_close(got, reference(model, prefix, rest, depth), atol=1e-5, rtol=0)
    # and it is an approximation: the rest's logits move once the prefix is not recomputed with it
    exact = model(torch.cat([prefix, rest])[None]).logits[:, 18:]
    assert (got - exact).abs().max() > 1e-3


@torch.no_grad()
@pytest.mark.parametrize("depth", range(L + 1))
def test_causal_model_reuse_is_exact_at_every_depth(depth):
    """A causal prefix does not see the rest, so its stored K/V and hidden states are the in-context ones."""
    model = tiny_r2lm(attention="causal", sidecar_layers=[])
    prefix, rest = ids(15), ids(9, 4)
    entry = BiCache(fixed(depth)).add(model, prefix)
    got = stitched_forward(model, entry, rest[None], depth, prefix_logits=True)
    torch.testing.assert_close(got, model(torch.cat([prefix, rest])[None]).logits, atol=1e-5, rtol=0)


@torch.no_grad()
def test_left_padded_rest_matches_unpadded_rows():
    model = bidir()
    prefix = ids(12)
    long, short = ids(7, 5), ids(3, 6)
    entry = BiCache(fixed(2)).add(model, prefix)
    batch = torch.stack([long, torch.cat([torch.zeros(4, dtype=torch.long), short])])
    mask = torch.tensor([[1] * 7, [0] * 4 + [1] * 3])
    got = stitched_forward(model, entry, batch, 2, rest_mask=mask)
    torch.testing.assert_close(got[0], stitched_forward(model, entry, long[None], 2)[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1, 4:], stitched_forward(model, entry, short[None], 2)[0], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------- profiler and table


def samples(n_prefix, n_rest, count=2):
    return [(ids(n_prefix, 10 + i), torch.cat([ids(n_rest // 2, 20 + i), torch.full((n_rest - n_rest // 2,), MASK_ID)]))
            for i in range(count)]


@torch.no_grad()
def test_profile_of_a_causal_model_gives_full_depth_everywhere():
    model = tiny_r2lm(attention="causal", sidecar_layers=[])
    data = samples(6, 30) + samples(20, 20) + samples(40, 8)
    table = profile(model, data, tau=0.999)
    assert table.edges == [0.15, 0.5, 0.8]  # ratios 1/6, 1/2, 5/6
    assert table.depths == [L] * 3 and table.measured == [L] * 3
    assert all(s > 0.9999 for row in table.similarity for s in row)


@torch.no_grad()
def test_profile_of_a_bidirectional_model():
    model = bidir()
    data = samples(6, 30) + samples(20, 20) + samples(40, 8)
    sims = layer_similarity(model, *data[0])
    # layer 0 projects the embeddings, which the rest cannot change; above it, bidirectional attention moves them
    assert sims.shape == (L,) and float(sims[0]) > 1 - 1e-6 and bool((sims[1:] < 1 - 1e-4).all())
    table = profile(model, data, tau=0.95)
    assert table.samples == [2, 2, 2] and table.num_layers == L
    assert all(a <= b for a, b in pairwise(table.depths))
    assert table.depths == [max(table.measured[: i + 1]) for i in range(3)]
    # tau decides: only layer 0 passes tau = 1 - 1e-5, everything passes tau = -0.99
    assert profile(model, data, tau=1 - 1e-5).depths == [1, 1, 1]
    assert profile(model, data, tau=-0.99).depths == [L, L, L]


def test_profile_aggregates_by_the_quantile(monkeypatch):
    """quantile 0 takes the worst sample; quantile 1 the best."""
    import r2lm.prefix.bicache as bc

    values = iter([torch.tensor([0.99, 0.99, 0.5, 0.5]), torch.tensor([0.99, 0.5, 0.5, 0.5])] * 2)
    monkeypatch.setattr(bc, "layer_similarity", lambda model, p, r: next(values))
    model = bidir()
    data = samples(10, 10)
    assert profile(model, data, tau=0.9, quantile=0.0).depths == [1]
    assert profile(model, data, tau=0.9, quantile=1.0).depths == [2]


def test_running_maximum_makes_the_table_monotone(monkeypatch):
    import r2lm.prefix.bicache as bc

    # measured depths 2, 1, 3 over increasing ratios -> 2, 2, 3
    by_prefix = {5: torch.tensor([1.0, 1.0, 0.0, 0.0]), 10: torch.tensor([1.0, 0.0, 0.0, 0.0]),
                 30: torch.tensor([1.0, 1.0, 1.0, 0.0])}
    monkeypatch.setattr(bc, "layer_similarity", lambda model, p, r: by_prefix[len(p)])
    table = profile(bidir(), [(ids(5), ids(15)), (ids(10), ids(10)), (ids(30), ids(5))], tau=0.5)
    assert table.edges == [0.25, 0.5, 0.85] and table.measured == [2, 1, 3] and table.depths == [2, 2, 3]


def test_table_lookup_and_json_round_trip(tmp_path):
    table = SafeDepthTable([0.3, 0.5, 0.8], [1, 2, 4], L, tau=0.97, quantile=0.0, measured=[1, 2, 4])
    assert table.depth(0.0) == 0 and table.depth(0.29) == 0  # below the table: no reuse
    assert table.depth(0.3) == 1 and table.depth(0.79) == 2 and table.depth(1.0) == 4
    assert table.depth(prefix_ratio(30, 70)) == 1 and prefix_ratio(30, 70) == 0.3
    table.save(tmp_path / "t.json")
    loaded = SafeDepthTable.load(tmp_path / "t.json")
    assert loaded == table and loaded.depth(0.6) == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (([0.5, 0.3], [1, 2]), "increasing"),
        (([0.3, 1.0], [1, 2]), "increasing"),
        (([0.3, 0.5], [2, 1]), "must not decrease"),
        (([0.3], [L + 1]), "depths must be in"),
        (([0.3], [1, 2]), "2 depths"),
    ],
)
def test_bad_tables(args, message):
    with pytest.raises(ValueError, match=message):
        SafeDepthTable(*args, num_layers=L, tau=0.9, quantile=0.0)


def test_bad_profile_inputs():
    model = bidir()
    with pytest.raises(ValueError, match="tau"):
        profile(model, samples(5, 5), tau=1.5)
    with pytest.raises(ValueError, match="quantile"):
        profile(model, samples(5, 5), quantile=-0.1)
    with pytest.raises(ValueError, match="buckets"):
        profile(model, samples(5, 5), buckets=[0.5, 0.2])
    with pytest.raises(ValueError, match="at least one sample"):
        profile(model, [], tau=0.9)
    with pytest.raises(ValueError, match="at least one sample"):
        profile(model, samples(2, 18), buckets=[0.5])  # every ratio below the table
    with pytest.raises(ValueError, match="non-empty prefix"):
        profile(model, [([], ids(4))])
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        fixed(1).depth(1.5)


# ---------------------------------------------------------------------------------------------- the store


def test_store_matching_and_eviction():
    model = bidir()
    store = BiCache(fixed(2), capacity_tokens=30)
    short, long = ids(6), torch.cat([ids(6), ids(10, 7)])
    store.add(model, short)
    store.add(model, long)
    row = long.tolist() + [1, 2, 3]
    assert store.match([row]).tokens == tuple(long.tolist())  # the longest stored prefix
    assert store.match([short.tolist() + [9, 9]]).length == 6
    assert store.match([row, short.tolist() + [5]]).length == 6  # the longest one every row shares
    assert store.match([[5, 5, 5]]) is None
    store.add(model, ids(14, 8))  # 6 + 16 + 14 > 30: the least recently matched (the long one) goes
    assert store.stats.evictions == 1 and store.tokens == 20 and store.match([row]).length == 6
    with pytest.raises(ValueError, match="exceeds the capacity"):
        store.add(model, ids(31))
    with pytest.raises(ValueError, match="empty prefix"):
        store.add(model, [])


def test_store_refuses_other_models():
    store = BiCache(fixed(2))
    store.add(bidir(), ids(5))
    with pytest.raises(ValueError, match="different configuration"):
        store.add(bidir(hidden_size=32, head_dim=8), ids(5))
    with pytest.raises(ValueError, match="a model with other weights"):  # same config, other weights: not its K/V
        store.prepare(bidir(seed=1), ids(5)[None], torch.ones(1, 5, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="profiled for 4 layers"):
        BiCache(fixed(2)).add(bidir(num_hidden_layers=3), ids(5))
    with pytest.raises(ValueError, match="block-hybrid"):
        BiCache(fixed(2)).add(tiny_r2lm(sidecar_layers=[], hybrid_layers=[1], hybrid_feature_dim=8), ids(5))


# ---------------------------------------------------------------------------------------------- generate


def decode(model, prompt, **kw):
    return generate(model, prompt, max_new_tokens=16, block_size=8, steps=8, **kw)


@torch.no_grad()
def test_generate_with_depth_zero_equals_no_reuse():
    model = bidir()
    prefix = ids(24)
    prompt = torch.cat([prefix, ids(4, 3)])[None]
    store = store_with(model, prefix, 0)
    assert torch.equal(decode(model, prompt, bicache=store).sequences, decode(model, prompt).sequences)
    assert store.stats.hits == 1 and store.stats.depths == {0: 1}


@torch.no_grad()
def test_generate_with_reuse_follows_the_stitched_forward():
    model = bidir()
    prefix = ids(24)
    prompt = torch.cat([prefix, ids(4, 3)])[None]
    plain = decode(model, prompt)
    store = store_with(model, prefix, L)
    out = decode(model, prompt, bicache=store)
    assert store.stats.depths == {L: 1} and out.nfe == plain.nfe
    assert not torch.equal(out.sequences, plain.sequences)  # full-depth reuse on a random model changes the output
    # the first step's choice is the stitched forward's argmax at the first block
    entry = store.match([prompt[0].tolist()])
    rest = torch.cat([prompt[0, 24:], torch.full((16,), MASK_ID)])[None]
    first = stitched_forward(model, entry, rest, L)[:, 4:12]
    first[..., MASK_ID] = float("-inf")
    confident = first.softmax(-1).max(-1).values.topk(2).indices[0]
    assert torch.equal(out.sequences[0, 28 + confident], first.argmax(-1)[0, confident])
    # a prompt that does not start with the stored prefix decodes as without the store
    other = torch.cat([ids(24, 9), ids(4, 3)])[None]
    assert torch.equal(decode(model, other, bicache=store).sequences, decode(model, other).sequences)
    assert store.stats.lookups == 2 and store.stats.hits == 1


@torch.no_grad()
def test_reuse_maps_padded_canvas_columns():
    """prepare() on a left-padded batch: each row's rest logits are those of the row alone."""
    model = bidir()
    prefix = ids(20)
    store = store_with(model, prefix, 2)
    rows = [torch.cat([prefix, ids(6, 3)]), torch.cat([prefix, ids(2, 4)])]
    batch = torch.stack([rows[0], torch.cat([torch.zeros(4, dtype=torch.long), rows[1]])])
    mask = torch.tensor([[1] * 26, [0] * 4 + [1] * 22])
    canvas = torch.cat([batch, torch.full((2, 8), MASK_ID)], 1)
    reuse = store.prepare(model, batch, mask, 8)
    got = reuse.logits(canvas)  # rest column c - P holds canvas column c for c >= padding + P
    for r, row in enumerate(rows):
        rest = torch.cat([row[20:], torch.full((8,), MASK_ID)])[None]
        want = stitched_forward(model, reuse.entry, rest, 2)[0]
        torch.testing.assert_close(got[r, -want.shape[0] :], want, atol=1e-5, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("prediction", ["inplace", "shift"])
def test_generate_batch_rows_match_single_rows(prediction):
    model = bidir(prediction=prediction)
    prefix = ids(20)
    store = store_with(model, prefix, 2)
    rows = [torch.cat([prefix, ids(6, 3)]), torch.cat([prefix, ids(2, 4)])]
    batch = torch.stack([rows[0], torch.cat([torch.zeros(4, dtype=torch.long), rows[1]])])
    mask = torch.tensor([[1] * 26, [0] * 4 + [1] * 22])
    got = decode(model, batch, attention_mask=mask, bicache=store, pad_token_id=0).sequences
    for r, row in enumerate(rows):
        single = decode(model, row[None], bicache=store, pad_token_id=0).sequences[0]
        assert torch.equal(got[r, -16:], single[-16:])
    assert store.stats.depths == {2: 3}


@torch.no_grad()
def test_shift_never_reuses_the_last_prompt_token():
    """Under shift the last prompt token predicts the first canvas token: a prompt that is exactly a stored prefix
    does not match it."""
    model = bidir(prediction="shift")
    prefix = ids(20)
    store = store_with(model, prefix, L)
    decode(model, prefix[None], bicache=store)
    assert store.stats.hits == 0
    inplace = bidir()
    store = store_with(inplace, prefix, L)
    decode(inplace, prefix[None], bicache=store)
    assert store.stats.hits == 1


def test_generate_refuses_bad_bicache_arguments():
    bi, prompt = bidir(), ids(10)[None]
    store = store_with(bi, ids(5), 2)
    with pytest.raises(ValueError, match="bicache must be an r2lm.prefix.BiCache"):
        decode(bi, prompt, bicache=object())
    with pytest.raises(ValueError, match="bidirectional models"):
        decode(tiny_r2lm(attention="causal", sidecar_layers=[]), prompt, bicache=BiCache(fixed(2)))
    with pytest.raises(ValueError, match="does not combine with approximate_cache"):
        decode(bi, prompt, bicache=store, approximate_cache="prefix")
    with pytest.raises(ValueError, match="different configuration"):
        decode(bidir(hidden_size=32, head_dim=8), prompt, bicache=store)
    with pytest.raises(ValueError, match="depth must be in"):
        stitched_forward(bi, store.match([ids(5).tolist()]), prompt, L + 1)


@pytest.mark.parametrize("prediction", ["inplace", "shift"])
def test_the_bench_scores_the_columns_that_predict_the_continuation(prediction):
    """eval/bicache_bench.py's exact (depth 0) masked CE equals the CE of a plain full forward read at the columns
    that predict each token: its own under inplace (LLaDA), the one before under shift (Dream)."""
    import argparse

    import torch.nn.functional as F

    from eval.bicache_bench import masked_scores

    model = tiny_r2lm(seed=3, attention="bidirectional", prediction=prediction, sidecar_layers=[])
    g = torch.Generator().manual_seed(0)
    q, n = 4, 6
    samples = [(torch.randint(0, MASK_ID - 1, (8,), generator=g).tolist(),
                torch.randint(0, MASK_ID - 1, (q + n,), generator=g).tolist()) for _ in range(2)]
    tables = {0.9: SafeDepthTable([0.0], [0], model.config.num_hidden_layers, 0.9, 0.0)}
    got = masked_scores(model, samples, argparse.Namespace(question_tokens=q), tables)["all_masked"]["loss_by_depth"][0]
    first = q - 1 if prediction == "shift" else q
    total = 0.0
    for prefix, after in samples:
        ids = torch.tensor([prefix + after[:q] + [MASK_ID] * n])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prefix) + first : len(prefix) + first + n]
        total += float(F.cross_entropy(logits, torch.tensor(after[q:]), reduction="sum"))
    assert got == pytest.approx(total / (2 * n), rel=1e-4)

"""generate(..., prefix_cache=...): identical outputs, pinned blocks stay, collisions are caught, bad input; what is
bit-exact and what is exact up to float rounding."""

import pytest
import torch

from r2lm import generate
from r2lm.cache import KVCache
from r2lm.prefix import PrefixCache
from r2lm.prefix.prefill import prefill_rows
from tests.helpers.decoding import left_pad
from tests.helpers.models import MASK_ID, peaky, tiny_r2lm

KINDS = {
    "r2lm": dict(sidecar_layers=[1, 3]),
    "block_causal": dict(attention="block_causal", sidecar_layers=[2]),
    "r2lm+hybrid": dict(sidecar_layers=[1], hybrid_layers=[0, 2], hybrid_feature_dim=8),
    "block_causal+hybrid": dict(attention="block_causal", prediction="inplace", hybrid_layers=[1], hybrid_feature_dim=8),
}


def workload(seed=0, docs=2, questions=3, doc_len=37):
    """Prompts that share long prefixes: several questions over each of a few documents."""
    g = torch.Generator().manual_seed(seed)
    documents = [torch.randint(0, MASK_ID, (doc_len,), generator=g) for _ in range(docs)]
    return [torch.cat([d, torch.randint(0, MASK_ID, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g)])
            for _ in range(questions) for d in documents]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("capacity", [4096, 48], ids=["roomy", "evicting"])
def test_outputs_are_identical_with_and_without_the_cache(kind, capacity):
    model = peaky(**KINDS[kind])
    cache = PrefixCache(capacity, block_tokens=4, policy="arc")
    options = dict(max_new_tokens=12, block_size=8, threshold=0.6)
    prompts = workload()
    for prompt in prompts:  # one request at a time
        cached = generate(model, prompt[None], prefix_cache=cache, **options)
        assert torch.equal(cached.sequences, generate(model, prompt[None], **options).sequences)
    ids, mask = left_pad(prompts[:4])  # and a batch of rows with different cached depths
    assert torch.equal(generate(model, ids, mask, prefix_cache=cache, **options).sequences,
                       generate(model, ids, mask, **options).sequences)
    assert cache.stats.hits > 0 and cache.stats.hit_tokens > 0
    if capacity == 48:
        assert cache.stats.evictions > 0 and len(cache) <= 12


def test_hybrid_hits_resume_from_a_checkpoint():
    model = peaky(**KINDS["r2lm+hybrid"])
    cache = PrefixCache(4096, block_tokens=4, checkpoints=2)
    prompts = workload(docs=1, questions=4)
    for prompt in prompts:
        generate(model, prompt[None], max_new_tokens=4, block_size=8, prefix_cache=cache)
    checkpoints = sorted(q for block in cache.blocks.values() for q in block.checkpoints)
    assert 0 < len(checkpoints) <= 2 * len(prompts)
    assert all((q + 1) % 8 == 0 for q in checkpoints)  # shift: chunk boundaries at k * block_size - 1
    blocks, n, state = cache.lookup(model.config, prompts[0][:-1].tolist())
    assert n in checkpoints and state is not None and state[0] is not None and state[1] is None
    cache.release(blocks)


def test_pinned_blocks_are_never_evicted():
    model = peaky(**KINDS["r2lm"])
    cache = PrefixCache(32, block_tokens=4, policy="lru")  # 8 blocks
    first = workload(seed=1)[0]
    generate(model, first[None], max_new_tokens=4, prefix_cache=cache)
    pinned, n, _ = cache.lookup(model.config, first[:-1].tolist())
    assert n > 0 and all(b.refs == 1 for b in pinned)
    for prompt in workload(seed=2, docs=4, questions=1):  # unrelated traffic that fills the cache
        generate(model, prompt[None], max_new_tokens=4, prefix_cache=cache)
    assert all(cache.blocks.get(b.key) is b for b in pinned)
    cache.release(pinned)
    for prompt in workload(seed=3, docs=4, questions=1):
        generate(model, prompt[None], max_new_tokens=4, prefix_cache=cache)
    assert any(cache.blocks.get(b.key) is not b for b in pinned)  # unpinned, they can go


def test_a_forced_hash_collision_is_caught_by_the_token_comparison(monkeypatch):
    model = peaky(**KINDS["r2lm"])
    cache = PrefixCache(4096, block_tokens=4)
    monkeypatch.setattr(cache, "_hash", lambda parent, tokens: 7)  # every block collides
    a, b = workload(seed=4, docs=2, questions=1)
    generate(model, a[None], max_new_tokens=4, prefix_cache=cache)
    out = generate(model, b[None], max_new_tokens=8, prefix_cache=cache)
    assert cache.stats.collisions > 0 and cache.stats.hit_tokens == 0
    assert torch.equal(out.sequences, generate(model, b[None], max_new_tokens=8).sequences)


def test_bad_input():
    with pytest.raises(ValueError, match="capacity_tokens 8 is below one block of 16 tokens"):
        PrefixCache(8, block_tokens=16)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        PrefixCache(64, policy="fifo")
    block_causal = peaky(**KINDS["block_causal"])  # block_size 8
    with pytest.raises(ValueError, match="block_tokens 3 must divide the model's block_size 8"):
        generate(block_causal, torch.tensor([[5, 6, 7]]), max_new_tokens=4, prefix_cache=PrefixCache(64, block_tokens=3))
    cache = PrefixCache(64, block_tokens=4)
    generate(peaky(**KINDS["r2lm"]), torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=4, prefix_cache=cache)
    with pytest.raises(ValueError, match="a model with a different configuration"):
        generate(block_causal, torch.tensor([[5, 6, 7]]), max_new_tokens=4, prefix_cache=cache)
    with pytest.raises(ValueError, match="prefix_cache reuses exact keys"):
        generate(peaky(**KINDS["r2lm"]), torch.tensor([[5, 6, 7]]), max_new_tokens=4, prefix_cache=cache, use_cache=False)


def test_every_chosen_checkpoint_is_stored():
    """The placement only offers positions whose block insert() keeps, and counts savings from the resume point."""
    model = peaky(**KINDS["r2lm+hybrid"])  # shift, block_size 8: chunk boundaries at 7, 15, 23, ...
    cache = PrefixCache(4096, block_tokens=4, checkpoints=3)
    cache.bind(model)
    for start, end in [(0, 39), (7, 39), (15, 31)]:
        chosen = cache.checkpoint_positions(model.config, start, end)
        assert chosen and all(start < q <= end and (q + 1) % 8 == 0 and -(-q // 4) * 4 <= end for q in chosen)
    prompt = workload(docs=1, questions=1)[0]
    generate(model, prompt[None], max_new_tokens=4, block_size=8, prefix_cache=cache)
    stored = {q for block in cache.blocks.values() for q in block.checkpoints}
    assert len(stored) == 3 and all((q + 1) % 8 == 0 for q in stored)  # the whole budget was kept


@pytest.mark.parametrize("kind", [dict(attention="block_causal", sidecar_layers=[]),
                                  dict(attention="block_causal", prediction="inplace", sidecar_layers=[2])],
                         ids=["block_causal_shift", "block_causal_inplace"])
@pytest.mark.parametrize("block_tokens", [1, 4, 8])
def test_prompts_that_share_part_of_a_chunk_keep_their_own_keys(kind, block_tokens):
    """Under block_causal attention a token's keys depend on the rest of its chunk: B, which shares its first
    tokens (and, under shift, a whole cache block of 8) with A but not the whole chunk, must not be stored with A's
    keys for them; B again then resumes from its own (the exact keys: output == no cache)."""
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, MASK_ID - 1, (4 if block_tokens < 8 else 8,), generator=g)
    a, b = (torch.cat([shared, torch.randint(0, MASK_ID - 1, (14,), generator=g)])[None] for _ in range(2))
    model = peaky(**kind)  # block_size 8
    options = dict(max_new_tokens=8, block_size=4, threshold=0.7, eos_token_id=[])
    plain = generate(model, b, **options).sequences
    cache = PrefixCache(4096, block_tokens=block_tokens)
    generate(model, a, prefix_cache=cache, **options)
    assert torch.equal(generate(model, b, prefix_cache=cache, **options).sequences, plain)
    hits = cache.stats.hit_tokens
    assert torch.equal(generate(model, b, prefix_cache=cache, **options).sequences, plain)
    assert cache.stats.hit_tokens > hits  # B again reused its own stored keys


# --------------------------------------------------------- issue 32: what is bit-exact, what is exact up to rounding


@pytest.mark.parametrize("kind", ["r2lm", "block_causal+hybrid"])
def test_a_hit_reads_bit_identical_keys_values_and_states(kind):
    """The cache adds no error of its own: what a hit reads is what the storing request computed, bit for bit."""
    model = tiny_r2lm(open_gates=True, **KINDS[kind])  # block_size 8
    cache = PrefixCache(4096, block_tokens=4, checkpoints=2)
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, MASK_ID, (37,), generator=g).tolist()
    b = a[:32] + torch.randint(0, MASK_ID, (6,), generator=g).tolist()
    stored, pinned, _ = prefill_rows(model, cache, [a], 40)
    cache.release(pinned)
    blocks, n, state = cache.lookup(model.config, b)
    assert n > 0 and cache.stats.hit_tokens == n
    for layer in range(model.config.num_hidden_layers):
        if stored.key[layer] is not None:
            assert torch.equal(torch.cat([x.keys[layer] for x in blocks], 1)[:, :n], stored.key[layer][0, :, :n])
            assert torch.equal(torch.cat([x.values[layer] for x in blocks], 1)[:, :n], stored.value[layer][0, :, :n])
    if model.config.hybrid_layers:  # the checkpoint is the state the storing request had at n: recompute it alike
        again = KVCache(model.config, 1, n, model.dtype, model.device)
        done = 0
        for stop in sorted(q for block in cache.blocks.values() for q in block.checkpoints if q <= n):
            model.prefill(torch.tensor([a[done:stop]]), again)
            done = stop
        assert done == n
        for layer in model.config.hybrid_layers:
            assert torch.equal(state[layer][0], again.S[layer]) and torch.equal(state[layer][1], again.Z[layer])
    cache.release(blocks)


ROUNDING = 1e-5  # logits of about 0.5: 30x the rounding differences seen (3e-7), far below their spread


def step_logits(model, ids, mask, **options):
    """(sequences, [per step: logits [B, V]]) of AR decoding (one token per row and step)."""
    seen = []
    out = generate(model, ids, mask, max_new_tokens=8, block_size=1, eos_token_id=[],
                   step_callback=lambda info: seen.append(info.logits[:, 0].clone()), **options)
    return out.sequences, seen


@pytest.mark.parametrize("kind", KINDS)
def test_decoding_with_the_cache_is_exact_up_to_float_rounding(kind):
    """The soak's claim: with a PrefixCache, empty or not, every logit is within ROUNDING of decoding without one, and
    so every greedy token is the same where the top-2 margin is wider than that (a closer tie may flip)."""
    model = tiny_r2lm(open_gates=True, **KINDS[kind])  # not peaky: margins of every size occur
    cache = PrefixCache(4096, block_tokens=4)
    prompts = workload(questions=2)
    batches = [left_pad(prompts[i : i + 1]) for i in range(2)] + [left_pad(prompts)]  # empty cache, then hits
    compared = 0
    for ids, mask in batches:
        cached, cached_logits = step_logits(model, ids, mask, prefix_cache=cache)
        plain, plain_logits = step_logits(model, ids, mask)
        agree = torch.ones(len(ids), dtype=torch.bool)  # rows whose tokens so far are the same
        for step, (ours, theirs) in enumerate(zip(cached_logits, plain_logits, strict=True)):
            gap = (ours - theirs).abs().amax(-1)
            assert bool((gap[agree] <= ROUNDING).all()), f"step {step}: logits differ by {gap[agree].max():.2e}"
            top2 = theirs.topk(2, -1).values
            clear = agree & (top2[:, 0] - top2[:, 1] > 2 * ROUNDING)
            same = ours.argmax(-1) == theirs.argmax(-1)
            assert bool(same[clear].all()), f"step {step}: a token with a clear margin differs"
            compared += int(clear.sum())
            agree &= same
    assert cache.stats.hit_tokens > 0 and compared >= 40  # most steps have a clear margin

"""generate(..., prefix_cache=...): identical outputs, pinned blocks stay, collisions are caught, bad input."""

import pytest
import torch

from conftest import MASK_ID, tiny_r2lm
from r2lm import generate
from r2lm.prefix import PrefixCache

KINDS = {
    "r2lm": dict(sidecar_layers=[1, 3]),
    "block_causal": dict(attention="block_causal", sidecar_layers=[2]),
    "r2lm+hybrid": dict(sidecar_layers=[1], hybrid_layers=[0, 2], hybrid_feature_dim=8),
    "block_causal+hybrid": dict(attention="block_causal", prediction="inplace", hybrid_layers=[1], hybrid_feature_dim=8),
}


def peaky(**kind):
    model = tiny_r2lm(open_gates=True, **kind)
    with torch.no_grad():
        model.lm_head.weight.mul_(50)
    return model


def workload(seed=0, docs=2, questions=3, doc_len=37):
    """Prompts that share long prefixes: several questions over each of a few documents."""
    g = torch.Generator().manual_seed(seed)
    documents = [torch.randint(0, MASK_ID, (doc_len,), generator=g) for _ in range(docs)]
    return [torch.cat([d, torch.randint(0, MASK_ID, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g)])
            for _ in range(questions) for d in documents]


def left_pad(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    return ids, mask


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

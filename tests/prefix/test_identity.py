"""The model a PrefixCache serves (issue 14 item 2, issue 32): a cache refuses a model with other weights, however
they changed, and serves the same weights in another object; a request that fails in prefill pins nothing
(item 8)."""

import copy
import re

import pytest
import torch
from peft import LoraConfig, get_peft_model

from r2lm import R2LMForDiffusionLM, generate
from r2lm.prefix import PrefixCache
from r2lm.prefix.identity import tensor_digests
from tests.helpers.models import MASK_ID, VOCAB, tiny_r2lm

# ------------------------------------------------------------------------------- item 2: a PrefixCache serves one model


def prompt_ids(n, seed):
    return torch.randint(0, MASK_ID, (1, n), generator=torch.Generator().manual_seed(seed))


def test_prefix_cache_refuses_a_model_with_other_weights():
    """Before: model B (same config, other weights) was served model A's cached keys and values."""
    a, b = tiny_r2lm(seed=0, sidecar_layers=[1]), tiny_r2lm(seed=1, sidecar_layers=[1])
    cache, prompt = PrefixCache(4096, block_tokens=4), prompt_ids(21, seed=0)
    generate(a, prompt, max_new_tokens=4, prefix_cache=cache)
    with pytest.raises(ValueError, match="a model with other weights .*use one PrefixCache per model"):
        generate(b, prompt, max_new_tokens=4, prefix_cache=cache)
    b.load_state_dict(a.state_dict())  # now the same weights: served
    generate(b, prompt, max_new_tokens=4, prefix_cache=cache)
    assert cache.stats.hit_tokens == 20


def test_tensor_digests_follow_every_bit_of_the_weights(tmp_path):
    model = tiny_r2lm(sidecar_layers=[1])
    first = tensor_digests(model)
    assert tensor_digests(model) == first
    model.save_pretrained(tmp_path / "m")
    assert tensor_digests(R2LMForDiffusionLM.from_pretrained(tmp_path / "m")) == first  # a reload is the same model
    weight = model.model.layers[2].mlp.down_proj.weight
    for flip in (1, 1 << 31):  # the lowest mantissa bit, and the sign, of one value
        word = weight.data.view(torch.int32).view(-1)
        word[77] ^= flip  # through .data: no version counter moves
        changed = tensor_digests(model)
        assert {k for k in first if changed[k] != first[k]} == {"model.layers.2.mlp.down_proj.weight"}
        word[77] ^= flip
        assert tensor_digests(model) == first
    with torch.no_grad():  # two rows swapped: every value is still there, in other places
        rows = model.model.embed_tokens.weight
        rows[[3, 4]] = rows[[4, 3]]
    assert tensor_digests(model)["model.embed_tokens.weight"] != first["model.embed_tokens.weight"]
    assert tensor_digests(model.to(torch.float64)) != tensor_digests(model.to(torch.float32))


# ------------------------------------------------------------------- issue 32: the model a PrefixCache serves

def served(model, cache, prompt):
    return generate(model, prompt, max_new_tokens=4, prefix_cache=cache, eos_token_id=[]).sequences


def lora_merged(model):
    """`model` after peft adds a LoRA to its q/v projections (B non-zero: as after training) and merges it in."""
    peft = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if ".lora_B." in name:
                param.normal_(std=0.2)
    merged = peft.merge_and_unload()
    assert merged is model  # the same object, its weights changed in place
    return merged


def through_data(model):
    model.model.layers[3].mlp.up_proj.weight.data[5].add_(0.5)  # no version counter moves
    return model


def one_row(model):
    with torch.no_grad():
        model.model.embed_tokens.weight[2] += 0.05  # a row the old 64-value sample did not read
    return model


def another_object(model):
    other = copy.deepcopy(model)
    return one_row(other)


def reloaded_with(**fields):
    def reload(model, folder):
        model.save_pretrained(folder)
        return R2LMForDiffusionLM.from_pretrained(folder, **fields).eval()
    return reload


CHANGES = {
    "merge_and_unload": (lora_merged, "other weights (model.layers.0.self_attn.q_proj.weight, "),
    ".data write": (through_data, "other weights (model.layers.3.mlp.up_proj.weight differ)"),
    "one row in place": (one_row, "other weights (model.embed_tokens.weight differ)"),
    "another object, one row": (another_object, "other weights (model.embed_tokens.weight differ)"),
    "rms_norm_eps": (reloaded_with(rms_norm_eps=1e-3), "a different configuration (rms_norm_eps 1e-06 vs 0.001)"),
    "hidden_act": (reloaded_with(hidden_act="gelu"), "a different configuration (hidden_act 'silu' vs 'gelu')"),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_prefix_cache_refuses_a_changed_model(change, tmp_path):
    """Before: the cache recognised a model by 64 sampled values per tensor (re-read only when a version counter
    moved) and part of its config, and served the old model's keys: logits off by up to 1.09 in the soak."""
    model, prompt = tiny_r2lm(seed=0, open_gates=True, sidecar_layers=[1]), prompt_ids(21, seed=0)
    cache = PrefixCache(4096, block_tokens=4)
    served(model, cache, prompt)
    make, difference = CHANGES[change]
    changed = make(model, tmp_path / "m") if change in ("rms_norm_eps", "hidden_act") else make(model)
    with pytest.raises(ValueError, match=re.escape(f"this PrefixCache holds keys and values computed by a model with "
                                                   f"{difference}")):
        served(changed, cache, prompt)
    assert cache.stats.hit_tokens == 0  # the refused request read nothing
    cache.clear()  # bound anew, to the changed model: its own keys are served
    served(changed, cache, prompt)
    served(changed, cache, prompt)
    assert cache.stats.hit_tokens == 20


def test_a_prefix_cache_serves_the_same_weights_in_another_object(tmp_path):
    model, prompt = tiny_r2lm(seed=0, sidecar_layers=[1]), prompt_ids(21, seed=0)
    cache = PrefixCache(4096, block_tokens=4)
    served(model, cache, prompt)
    served(reloaded_with()(model, tmp_path / "m"), cache, prompt)
    served(copy.deepcopy(model), cache, prompt)
    assert cache.stats.hit_tokens == 40


def test_a_bicache_refuses_a_model_changed_through_data():
    from r2lm.prefix import BiCache, SafeDepthTable

    model = tiny_r2lm(attention="bidirectional", sidecar_layers=[], prediction="inplace")
    store, prefix = BiCache(SafeDepthTable([0.0], [2], 4, tau=0.9, quantile=0.0)), prompt_ids(12, seed=0)[0]
    store.add(model, prefix)
    through_data(model)
    with pytest.raises(ValueError, match=re.escape("this BiCache holds keys and values computed by a model with other "
                                                   "weights (model.layers.3.mlp.up_proj.weight differ)")):
        store.add(model, prefix)
    store.clear()
    assert store.add(model, prefix).length == 12


# ------------------------------------------------------------------------ item 8: a failed prefill pins nothing


def ctrl_c(module, args):
    raise KeyboardInterrupt


@pytest.mark.parametrize("failure", ["ctrl_c", "out_of_vocabulary"])
def test_a_request_that_fails_in_prefill_leaves_no_block_pinned(failure):
    """Before: the blocks the failed request had matched stayed pinned for ever; once they filled the cache, it
    cached nothing (0 hit tokens for a repeated prompt)."""
    model = tiny_r2lm(sidecar_layers=[1])
    cache = PrefixCache(32, block_tokens=4, policy="lru")  # 8 blocks
    document = prompt_ids(37, seed=0)
    generate(model, document, max_new_tokens=4, prefix_cache=cache)
    assert len(cache) == 8  # full: 32 of its 36 prefilled tokens
    if failure == "ctrl_c":  # the request matches the 8 blocks, then Ctrl-C hits its first forward
        prompt, hook = document, model.register_forward_pre_hook(ctrl_c)
        expected, hits = KeyboardInterrupt, 32
    else:  # an id outside the vocabulary after the 8 blocks: now refused before the cache is even looked up
        prompt, hook = torch.cat([document[:, :34], torch.tensor([[VOCAB + 5]]), document[:, 34:]], 1), None
        expected, hits = ValueError, 0
    with pytest.raises(expected):
        generate(model, prompt, max_new_tokens=4, prefix_cache=cache)
    if hook is not None:
        hook.remove()
    assert cache.stats.hit_tokens == hits  # it had pinned the 8 blocks...
    assert all(block.refs == 0 for block in cache.blocks.values())  # ...and released them
    other = prompt_ids(37, seed=1)
    generate(model, other, max_new_tokens=4, prefix_cache=cache)  # evicts the old blocks
    generate(model, other, max_new_tokens=4, prefix_cache=cache)
    assert cache.stats.hit_tokens == hits + 32

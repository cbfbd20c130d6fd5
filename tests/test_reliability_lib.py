"""Issue 14 (a careless user): loading, the prefix cache, r2lm-generate and the lm-eval adapter refuse bad
input clearly and leave nothing behind."""

import json
import re

import pytest
import torch
from conftest import MASK_ID, VOCAB, tiny_r2lm, tiny_r2lm_config

from r2lm import R2LMForDiffusionLM, generate
from r2lm.cache import weight_fingerprint
from r2lm.cli.generate import main as generate_cli
from r2lm.prefix import PrefixCache

# ------------------------------------------------------------------------------------------ item 7: strict loading


@pytest.fixture
def tied_checkpoint(tmp_path):
    tiny_r2lm(tie_word_embeddings=True).save_pretrained(tmp_path / "tied")  # 4 layers
    return tmp_path / "tied"


def edit_config(folder, **fields):
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


@pytest.mark.parametrize("fields,message", [
    (dict(num_hidden_layers=6), r"22 weights missing from the checkpoint .*: model\.layers\.4\..* and 17 more"),
    (dict(num_hidden_layers=2), r"22 weights in the checkpoint but not in the model .*: model\.layers\.2\..* and 17 more"),
    (dict(tie_word_embeddings=False), r"1 weight missing from the checkpoint .*: lm_head\.weight\."),
    (dict(sidecar_layers=[1]), r"10 weights missing from the checkpoint .*: model\.layers\.1\.sidecar\."),
])
@pytest.mark.parametrize("where", ["config.json", "keyword"])
def test_from_pretrained_refuses_weights_that_do_not_match_the_config(tied_checkpoint, fields, message, where):
    """Before: a 6-layer model with 2 random layers, a random lm_head, or 2 layers silently dropped."""
    if where == "config.json":
        edit_config(tied_checkpoint, **fields)
        fields = {}
    with pytest.raises(ValueError, match=f"checkpoint {re.escape(str(tied_checkpoint))} does not match its config: {message}"):
        R2LMForDiffusionLM.from_pretrained(tied_checkpoint, **fields)


def test_from_pretrained_refuses_a_state_dict_that_does_not_match_the_config():
    """The way deepspeed-to-hf builds its model: a config and a state dict."""
    state = tiny_r2lm().state_dict()
    with pytest.raises(ValueError, match=r"the state_dict given does not match its config: 22 weights missing"):
        R2LMForDiffusionLM.from_pretrained(None, config=tiny_r2lm_config(num_hidden_layers=6), state_dict=state)


@pytest.mark.parametrize("layers", [0, -1])
@pytest.mark.parametrize("where", ["config.json", "keyword"])
def test_from_pretrained_refuses_a_model_without_layers(tied_checkpoint, layers, where):
    """Before: a 0-layer model (every weight of the checkpoint unused)."""
    fields = dict(num_hidden_layers=layers)
    if where == "config.json":
        edit_config(tied_checkpoint, **fields)
        fields = {}
    with pytest.raises(ValueError, match=f"num_hidden_layers must be a positive integer, got {layers}"):
        R2LMForDiffusionLM.from_pretrained(tied_checkpoint, **fields)


def test_from_pretrained_still_loads_matching_checkpoints(tied_checkpoint, tmp_path):
    model, info = R2LMForDiffusionLM.from_pretrained(tied_checkpoint, output_loading_info=True, block_size=16)
    assert model.config.block_size == 16 and not info["missing_keys"] and not info["unexpected_keys"]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    untied = tiny_r2lm(sidecar_layers=[1], hybrid_layers=[2], hybrid_feature_dim=8)
    untied.save_pretrained(tmp_path / "untied")
    loaded = R2LMForDiffusionLM.from_pretrained(tmp_path / "untied")
    assert all(v.equal(untied.state_dict()[k]) for k, v in loaded.state_dict().items())


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


def test_weight_fingerprint_follows_the_weights(tmp_path):
    model = tiny_r2lm(sidecar_layers=[1])
    first = weight_fingerprint(model)
    assert weight_fingerprint(model) == first  # memoised
    model.save_pretrained(tmp_path / "m")
    assert weight_fingerprint(R2LMForDiffusionLM.from_pretrained(tmp_path / "m")) == first  # a reload is the same model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(prompt_ids(8, seed=0)).logits.sum().backward()
    optimizer.step()  # written in place: the version counters move
    stepped = weight_fingerprint(model)
    assert stepped != first
    with torch.no_grad():
        model.model.layers[1].sidecar.gate.fill_(0.5)  # one scalar: every tensor is sampled
    assert weight_fingerprint(model) not in (first, stepped)
    assert weight_fingerprint(model.to(torch.float64)) != weight_fingerprint(model.to(torch.float32))


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


# ------------------------------------------------------------------- item 15: r2lm-generate on a bad path


@pytest.mark.parametrize("make,message", [
    (lambda tmp: tmp / "missing", "missing: no such checkpoint folder"),
    (lambda tmp: tmp, "is not a checkpoint folder: it has no config.json"),
])
def test_generate_script_names_a_bad_checkpoint_path(tmp_path, make, message, capsys):
    """Before: transformers' "Repo id must be in the form ..." traceback (exit status 1)."""
    with pytest.raises(SystemExit) as exit_:
        generate_cli([str(make(tmp_path)), "--prompt", "The"])
    assert exit_.value.code == 2 and message in capsys.readouterr().err

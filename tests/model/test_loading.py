"""Strict loading (issue 14 item 7, a careless user): from_pretrained refuses weights that do not match the config
instead of leaving layers random or dropping them."""

import json
import re

import pytest

from r2lm import R2LMForDiffusionLM
from tests.helpers.models import tiny_r2lm, tiny_r2lm_config

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


def test_from_pretrained_asks_for_no_hub_kernels(tied_checkpoint):
    """transformers >= 5.2x kernelizes a loaded model by default, and on a GPU that means downloading Hub kernels for
    its activations: offline (HF_HUB_OFFLINE=1) every training run on a GPU failed at its first forward (seen by
    scripts/gpu_check.sh on an H200). r2lm asks for none unless told to."""
    assert not R2LMForDiffusionLM.from_pretrained(tied_checkpoint).use_kernels
    assert R2LMForDiffusionLM.from_pretrained(tied_checkpoint, use_kernels=True).use_kernels

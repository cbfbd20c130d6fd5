"""Bad input raises ValueError naming the problem."""

import pytest
import torch

from conftest import MASK_ID, tiny_r2lm, tiny_r2lm_config
from r2lm import Layout, R2LMConfig


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(sidecar_layers=[1, 4]), r"sidecar_layers \[4\] out of range for a model with 4 layers"),
        (dict(hybrid_layers=[-1]), r"hybrid_layers \[-1\] out of range"),
        (dict(sidecar_layers=[1, 1]), "lists a layer twice"),
        (dict(attention="sliding"), "unknown attention kind 'sliding'"),
        (dict(prediction="left"), "unknown prediction 'left'"),
        (dict(mask_token_id=96), "mask_token_id 96 is outside the vocabulary"),
        (dict(num_key_value_heads=3), r"num_attention_heads \(4\) is not divisible by num_key_value_heads \(3\)"),
        (dict(head_dim=None, hidden_size=66), r"hidden_size \(66\) is not divisible by num_attention_heads \(4\)"),
        (dict(block_size=0), "block_size must be positive"),
        (dict(sidecar_layers=[0], sidecar_headdim=48), "not divisible by sidecar_headdim 48"),
        (dict(sidecar_layers=[0], attention="bidirectional"), "sidecar_layers need a causal or block_causal model"),
        (dict(hybrid_layers=[0], hybrid_feature_dim=32), "hybrid_feature_dim 32 is above head_dim 16"),
        (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}), "rope_type 'dynamic' is not supported"),
    ],
)
def test_bad_config(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_r2lm_config(**overrides)


def test_bad_config_in_a_saved_checkpoint(tmp_path):
    tiny_r2lm_config().save_pretrained(tmp_path)
    text = (tmp_path / "config.json").read_text().replace('"attention": "causal"', '"attention": "diagonal"')
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match="unknown attention kind 'diagonal'"):
        R2LMConfig.from_pretrained(tmp_path)


def test_bad_forward_input():
    model = tiny_r2lm()
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, length\]"):
        model(torch.randint(0, MASK_ID, (5,)))
    with pytest.raises(ValueError, match="layout has 4 columns but input_ids has 5"):
        model(torch.randint(0, MASK_ID, (1, 5)), layout=Layout.span(torch.ones(1, 4)))
    cache = model.new_cache(2, 16)
    with pytest.raises(ValueError, match="cache batch size 2 != input batch size 1"):
        model.prefill(torch.randint(0, MASK_ID, (1, 5)), cache)
    with pytest.raises(ValueError, match="KVCache overflow: 0 cached \\+ 17 new tokens exceed its max_length 16"):
        model.prefill(torch.randint(0, MASK_ID, (2, 17)), cache)
    with pytest.raises(ValueError, match="windows are never cached"):
        model(torch.randint(0, MASK_ID, (2, 4)), layout=Layout.span(torch.ones(2, 4), noisy=True), cache=cache, update_cache=True)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 512"):
        model.new_cache(1, 513)
    with pytest.raises(ValueError, match="has no sidecar_layers"):
        model.freeze_backbone()

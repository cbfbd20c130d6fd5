"""Bad input raises ValueError naming the problem."""

import pytest
import torch

from r2lm import Layout, R2LMConfig
from tests.helpers.models import MASK_ID, tiny_r2lm, tiny_r2lm_config


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(sidecar_layers=[1, 4]), r"sidecar_layers \[4\] out of range for a model with 4 layers"),
        (dict(hybrid_layers=[-1]), r"hybrid_layers \[-1\] out of range"),
        (dict(sidecar_layers=[1, 1]), "lists a layer twice"),
        (dict(attention="sliding"), "attention must be one of .*, got 'sliding'"),
        (dict(prediction="left"), "prediction must be one of .*, got 'left'"),
        (dict(mask_token_id=96), "mask_token_id 96 is outside the vocabulary"),
        (dict(num_key_value_heads=3), r"num_attention_heads \(4\) is not divisible by num_key_value_heads \(3\)"),
        (dict(head_dim=None, hidden_size=66), r"hidden_size \(66\) is not divisible by num_attention_heads \(4\)"),
        (dict(block_size=0), "block_size must be a positive integer, got 0"),
        (dict(sidecar_layers=[0], sidecar_headdim=48), "not divisible by sidecar_headdim 48"),
        (dict(sidecar_layers=[0], attention="bidirectional"), "sidecar_layers need a causal or block_causal model"),
        (dict(hybrid_layers=[0], hybrid_feature_dim=32), "hybrid_feature_dim 32 is above head_dim 16"),
        (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}), "rope_type 'dynamic' is not supported"),
        # issue 14 item 12: each of these raised a TypeError, ZeroDivisionError or AttributeError, or was accepted
        (dict(sidecar_layers=3), "sidecar_layers must be a list of layer indices, got 3"),
        (dict(hybrid_layers=[True]), r"hybrid_layers must be a list of layer indices, got \[True\]"),
        (dict(block_size="16"), "block_size must be a positive integer, got '16'"),
        (dict(block_size=16.0), "block_size must be a positive integer, got 16.0"),
        (dict(num_key_value_heads=0), "num_key_value_heads must be a positive integer"),
        (dict(head_dim=0), "head_dim must be a positive integer"),
        (dict(num_attention_heads=0, head_dim=None), "num_attention_heads must be a positive integer, got 0"),
        (dict(num_attention_heads=3), r"num_attention_heads \(3\) is not divisible by num_key_value_heads \(2\)"),
        (dict(num_hidden_layers=0), "num_hidden_layers must be a positive integer, got 0"),
        (dict(num_hidden_layers=-1), "num_hidden_layers must be a positive integer, got -1"),
        (dict(hidden_size=True), "hidden_size must be a positive integer, got True"),
        (dict(max_position_embeddings=-512), "max_position_embeddings must be a positive integer, got -512"),
        (dict(rms_norm_eps=-1e-6), "rms_norm_eps must be a positive number, got -1e-06"),
        (dict(dtype="float8"), "dtype must be one of .*, got 'float8'"),
        (dict(torch_dtype="float8"), "torch_dtype must be one of .*, got 'float8'"),
        (dict(eos_token_id=96), r"eos_token_id 96 is outside the vocabulary \[0, 96\)"),
        (dict(eos_token_id=[1, 200]), r"eos_token_id \[1, 200\] has ids outside the vocabulary"),
        (dict(pad_token_id=-1), "pad_token_id -1 is outside the vocabulary"),
        (dict(bos_token_id=1000), "bos_token_id 1000 is outside the vocabulary"),
        (dict(mask_token_id=-1), "mask_token_id -1 is outside the vocabulary"),
        (dict(qk_norm="yes"), "qk_norm must be true or false, got 'yes'"),
        (dict(hidden_act="swish2"), "hidden_act must be an activation name"),
        # issue 32: a model whose [MASK] is its EOS or padding can never generate
        (dict(eos_token_id=MASK_ID), f"mask_token_id {MASK_ID} is also the EOS token id \\({MASK_ID}\\)"),
        (dict(eos_token_id=[2, MASK_ID]), f"mask_token_id {MASK_ID} is also the EOS token id \\(\\[2, {MASK_ID}\\]\\)"),
        (dict(pad_token_id=MASK_ID), f"pad_token_id {MASK_ID} is also the mask token id: padding would read as"),
    ],
)
def test_bad_config(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_r2lm_config(**overrides)


@pytest.mark.parametrize("overrides", [
    dict(sidecar_layers=(0, 2), hybrid_layers=[3], hybrid_feature_dim=8),  # lists or tuples
    dict(eos_token_id=(1, 2), pad_token_id=0, bos_token_id=1),
    dict(dtype="bfloat16"), dict(dtype=torch.float16), dict(torch_dtype="float32"),
    dict(head_dim=None, num_key_value_heads=None),  # derived
])
def test_valid_config_variants(overrides):
    config = tiny_r2lm_config(**overrides)
    assert config.sidecar_layers == sorted(overrides.get("sidecar_layers", []))
    assert config.head_dim and config.num_key_value_heads


def test_bad_config_in_a_saved_checkpoint(tmp_path):
    tiny_r2lm_config().save_pretrained(tmp_path)
    text = (tmp_path / "config.json").read_text().replace('"attention": "causal"', '"attention": "diagonal"')
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match="attention must be one of .*, got 'diagonal'"):
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

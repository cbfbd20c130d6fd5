"""`python -m convert to-hybrid`: swaps layers to block-hybrid attention; bad input leaves DST untouched."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from r2lm import Layout, R2LMForDiffusionLM
from r2lm.convert.__main__ import main
from r2lm.convert.to_hybrid import convert_to_hybrid
from tests.helpers.models import MASK_ID, tiny_r2lm


@pytest.fixture
def r2lm_dir(tmp_path):
    model = tiny_r2lm(open_gates=True, attention="block_causal", sidecar_layers=[1])
    model.save_pretrained(tmp_path / "src")
    return tmp_path / "src"


def test_swapped_layers_keep_the_first_block_exact(r2lm_dir, tmp_path):
    assert main(["to-hybrid", str(r2lm_dir), str(tmp_path / "hyb"), "--layers", "0,2", "--feature-dim", "8"]) == 0
    before = R2LMForDiffusionLM.from_pretrained(r2lm_dir).eval()
    after = R2LMForDiffusionLM.from_pretrained(tmp_path / "hyb").eval()
    assert after.config.hybrid_layers == [0, 2] and after.config.hybrid_feature_dim == 8
    assert after.model.layers[0].self_attn.linear_attention is not None
    assert after.model.layers[1].self_attn.linear_attention is None
    ids = torch.randint(0, MASK_ID, (2, 20))
    one_chunk = Layout.span(torch.ones_like(ids))
    two_chunks = Layout.cat(Layout.span(torch.ones(2, 12)), Layout.span(torch.ones(2, 8), start=12, chunk=1))
    with torch.no_grad():  # nothing earlier to read: exactly the softmax model
        torch.testing.assert_close(after(ids, layout=one_chunk).logits, before(ids, layout=one_chunk).logits, atol=1e-5, rtol=1e-5)
        gap = (after(ids, layout=two_chunks).logits - before(ids, layout=two_chunks).logits)[:, 12:].abs().max()
    assert gap > 1e-4  # the second chunk reads the first one linearly now


def test_default_feature_dim_fits_small_heads(r2lm_dir, tmp_path):
    convert_to_hybrid(r2lm_dir, tmp_path / "hyb", [3])
    assert R2LMForDiffusionLM.from_pretrained(tmp_path / "hyb").config.hybrid_feature_dim == 16  # = head_dim


@pytest.mark.parametrize(
    "layers,options,message",
    [
        ([0, 4], {}, r"hybrid_layers \[4\] out of range for a model with 4 layers"),
        ([0], {"feature_dim": 32}, "hybrid_feature_dim 32 is above head_dim 16"),
        ([1, 1], {}, "lists a layer twice"),
    ],
)
def test_bad_layers(r2lm_dir, tmp_path, layers, options, message):
    with pytest.raises(ValueError, match=message):
        convert_to_hybrid(r2lm_dir, tmp_path / "hyb", layers, **options)
    assert not (tmp_path / "hyb").exists()


def test_converting_a_layer_twice(r2lm_dir, tmp_path):
    convert_to_hybrid(r2lm_dir, tmp_path / "once", [0, 2], feature_dim=8)
    with pytest.raises(ValueError, match=r"layers \[2\] are already block-hybrid"):
        convert_to_hybrid(tmp_path / "once", tmp_path / "twice", [2, 3])
    assert not (tmp_path / "twice").exists()
    convert_to_hybrid(tmp_path / "once", tmp_path / "more", [3])  # adding a new layer keeps the feature dim
    assert R2LMForDiffusionLM.from_pretrained(tmp_path / "more").config.hybrid_layers == [0, 2, 3]


def test_checkpoint_that_does_not_match_its_config(r2lm_dir, tmp_path):
    state = load_file(r2lm_dir / "model.safetensors")
    state["model.layers.2.self_attn.k_proj.weight"] = state["model.layers.2.self_attn.k_proj.weight"][:16]
    save_file(state, r2lm_dir / "model.safetensors")
    dst = tmp_path / "hyb"
    dst.mkdir()  # empty: --overwrite may replace it, but only with a complete output
    with pytest.raises(ValueError, match=r"model.layers.2.self_attn.k_proj.weight has shape \(16, 64\)"):
        convert_to_hybrid(r2lm_dir, dst, [0], feature_dim=8, overwrite=True)
    assert list(dst.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["hyb", "src"]


def test_untied_feature_maps(r2lm_dir, tmp_path):
    assert main(["to-hybrid", str(r2lm_dir), str(tmp_path / "hyb"), "--layers", "0", "--untied-feature-maps"]) == 0
    model = R2LMForDiffusionLM.from_pretrained(tmp_path / "hyb")
    assert model.config.hybrid_tie_feature_maps is False
    assert model.model.layers[0].self_attn.linear_attention.key_hedgehog_weights is not None
    with pytest.raises(ValueError, match="already has hybrid layers with untied feature maps"):
        convert_to_hybrid(tmp_path / "hyb", tmp_path / "more", [2])  # tied is the default
    assert not (tmp_path / "more").exists()

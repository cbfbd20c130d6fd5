"""Invariant 1: a converted checkpoint computes exactly what transformers' own Qwen3 / Qwen2 / Llama computes."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from r2lm import R2LMForDiffusionLM
from r2lm.convert.from_hf import convert_from_hf
from tests.helpers.models import tiny_hf_config, tiny_r2lm


def _hf_model(arch, tmp_path, **overrides):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(arch, **overrides)).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a swapped or dropped tensor shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    src = tmp_path / f"hf-{arch}"
    model.save_pretrained(src)
    return model, src


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("sidecar_layers", [[], [0, 2]])
def test_converted_logits_equal_transformers(arch, sidecar_layers, tmp_path):
    hf, src = _hf_model(arch, tmp_path)
    dst = convert_from_hf(src, tmp_path / "r2lm", sidecar_layers=sidecar_layers, mask_token_id=5,
                          sidecar_d_state=16, sidecar_headdim=16)
    ours = R2LMForDiffusionLM.from_pretrained(dst).eval()
    assert ours.config.sidecar_layers == sidecar_layers
    ids = torch.randint(0, 96, (2, 37))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: positions must follow the mask, as in transformers' generate
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask, position_ids=positions).logits
        got = ours(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)


def test_rope_scaling_reaches_the_attention(tmp_path):
    """The llama3-scaled frequencies differ from default RoPE at long range; both models must agree on them."""
    hf, src = _hf_model("llama", tmp_path)
    ours = R2LMForDiffusionLM.from_pretrained(convert_from_hf(src, tmp_path / "r2lm", mask_token_id=5)).eval()
    assert ours.config.rope_parameters["rope_type"] == "llama3"
    torch.testing.assert_close(ours.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)
    ids = torch.randint(0, 96, (1, 200))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_partial_rotary_factor_is_ignored_as_transformers_does(arch, tmp_path):
    """transformers' Qwen3 / Llama rotate the whole head whatever partial_rotary_factor says (default RoPE);
    r2lm's rotary code honours the factor (LLaDA 2), so the conversion must drop it to compute the same."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    hf, src = _hf_model(arch, tmp_path, rope_parameters=rope)
    ours = R2LMForDiffusionLM.from_pretrained(convert_from_hf(src, tmp_path / "r2lm", mask_token_id=5)).eval()
    assert "partial_rotary_factor" not in ours.config.rope_parameters
    ids = torch.randint(0, 96, (1, 64))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=1e-5, rtol=1e-5)
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 256}
    _, src = _hf_model(arch, tmp_path / "yarn", rope_parameters=yarn)
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5 and rope_type 'yarn'"):
        convert_from_hf(src, tmp_path / "r2lm-yarn", mask_token_id=5)


def test_a_backbone_rotating_part_of_each_head_has_no_transformers_counterpart():

    from r2lm.convert.to_hf import transformers_backbone

    model = tiny_r2lm(sidecar_layers=[], rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="rotates part of each head .partial_rotary_factor 0.5."):
        transformers_backbone(model)

"""bf16 decoding on CPU (issue 33): what a GPU user runs (`from_pretrained(..., dtype=torch.bfloat16)` or
`model.to(torch.bfloat16)`), so a dtype mistake shows up without a GPU. The cache (prefill, denoise, commit) equals
recomputation within bf16 rounding, and both stay within bf16 rounding of the fp32 model.

Tolerances: tests/helpers/bf16.py. The two-rank bf16 training run is in tests/train/test_bf16_train_launch.py (slow)."""

import pytest
import torch

from r2lm import R2LMForDiffusionLM, generate
from tests.helpers.bf16 import assert_bf16_cache_equals_recompute, decode_inputs
from tests.helpers.models import MASK_ID, tiny_r2lm

MODELS = {
    "r2lm": dict(attention="causal", sidecar_layers=[1, 3]),
    "block_causal+sidecar": dict(attention="block_causal", sidecar_layers=[0]),
    "r2lm+hybrid": dict(attention="causal", sidecar_layers=[1], hybrid_layers=[0, 2], hybrid_feature_dim=8),
    "block_causal+hybrid": dict(attention="block_causal", sidecar_layers=[1], hybrid_layers=[0, 3], hybrid_feature_dim=8),
}

@pytest.mark.parametrize("name", MODELS)
def test_bf16_model_cache_equals_recompute(name):
    """model.to(torch.bfloat16): sidecars, block-hybrid states and the KV cache in a bf16 model."""
    reference = tiny_r2lm(open_gates=True, **MODELS[name])
    model = tiny_r2lm(open_gates=True, dtype=torch.bfloat16, **MODELS[name])
    assert_bf16_cache_equals_recompute(model, reference)


def test_bf16_load_of_an_fp32_checkpoint_decodes(tmp_path):
    """from_pretrained(dtype=torch.bfloat16) of an fp32 checkpoint (what a GPU user does): every weight in bf16,
    the cache equal to recomputation, and cached generation runs end to end."""
    reference = tiny_r2lm(open_gates=True, **MODELS["r2lm+hybrid"])
    reference.save_pretrained(tmp_path)
    model = R2LMForDiffusionLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert_bf16_cache_equals_recompute(model, reference)
    ids, mask, _, _ = decode_inputs()
    out = generate(model, ids, mask, max_new_tokens=16, block_size=8)
    new = out.sequences[:, ids.shape[1]:]
    assert new.shape == (3, 16) and not (new == MASK_ID).any()

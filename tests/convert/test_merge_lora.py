"""`python -m convert merge-lora SRC ADAPTER DST`: the merged checkpoint computes what base + adapter compute;
an adapter that does not fit the base (target names, shapes, rank) is refused with DST untouched."""

import json

import pytest
import torch
from peft import PeftModel

from r2lm import R2LMForDiffusionLM
from r2lm.convert.__main__ import main
from r2lm.convert.merge_lora import merge_lora
from r2lm.diffusion import block_noise, noised_dual_stream
from tests.helpers.checkpoints import damage_weights, make_adapter
from tests.helpers.models import make_model_dir, tiny_hf_config

HYBRID = dict(attention="block_causal", prediction="inplace", hybrid_layers=[0, 2], hybrid_feature_dim=8)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("merge")
    return make_model_dir(root / "base", **HYBRID)


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory):
    return make_adapter(base, tmp_path_factory.mktemp("adapter") / "lora")


def logits(model, config):
    x0 = torch.randint(0, config.mask_token_id, (2, 48), generator=torch.Generator().manual_seed(1))
    _, [(masked, _)] = block_noise(x0, config, generator=torch.Generator().manual_seed(2))
    ids, layout, _ = noised_dual_stream(x0, masked, config)
    with torch.no_grad():
        return model.eval()(ids, layout=layout).logits


def test_merged_checkpoint_equals_base_plus_adapter(base, adapter, tmp_path):
    assert main(["merge-lora", str(base), str(adapter), str(tmp_path / "merged")]) == 0
    merged = R2LMForDiffusionLM.from_pretrained(tmp_path / "merged")
    assert type(merged) is R2LMForDiffusionLM and merged.config.hybrid_layers == [0, 2]
    assert not any("lora" in k or "base_layer" in k for k in merged.state_dict())
    peft_model = PeftModel.from_pretrained(R2LMForDiffusionLM.from_pretrained(base), str(adapter))
    want = logits(peft_model, merged.config)
    torch.testing.assert_close(logits(merged, merged.config), want, atol=1e-5, rtol=1e-5)
    assert (logits(R2LMForDiffusionLM.from_pretrained(base), merged.config) - want).abs().max() > 1e-3
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    # --dtype, and --overwrite of an existing DST
    assert main(["merge-lora", str(base), str(adapter), str(tmp_path / "merged"), "--dtype", "bfloat16"]) == 2
    assert main(["merge-lora", str(base), str(adapter), str(tmp_path / "merged"), "--dtype", "bfloat16", "--overwrite"]) == 0
    assert R2LMForDiffusionLM.from_pretrained(tmp_path / "merged").dtype == torch.bfloat16


def edit_config(adapter, tmp_path, **changes):
    import shutil

    copy = tmp_path / "edited"
    shutil.copytree(adapter, copy)
    raw = json.loads((copy / "adapter_config.json").read_text())
    raw.update(changes)
    (copy / "adapter_config.json").write_text(json.dumps(raw))
    return copy


@pytest.mark.parametrize(
    "case,message",
    [
        ("unknown_target", r"does not fit .*Target modules \{'qkv'\} not found in the base model"),
        ("other_target", r"its weights name other modules than a LoRA on \['gate_proj'\].*missing 8.*unexpected 32"),
        ("rank", r"wrong shape, e\.g\. .*lora_A\.weight is \(4, 64\) but a rank-8 LoRA of this model needs \(8, 64\)"),
        ("other_model", r"wrong shape, e\.g\. .*q_proj\.lora_A\.weight is \(4, 32\) but a rank-4 LoRA of this model needs \(4, 64\)"),
        ("not_lora", "holds a 'IA3' adapter; merge-lora merges LoRA adapters"),
        ("no_adapter", "is not a peft adapter folder: it has no adapter_config.json"),
        ("not_r2lm", "is not an R2LM checkpoint"),
        ("unreadable_base", r"cannot read .*/truncated/model\.safetensors: "),
        ("tied_lm_head", r"puts a LoRA on lm_head of a model with tied embeddings"),
    ],
)
def test_bad_adapter_leaves_dst_untouched(base, adapter, tmp_path, case, message):
    src = base
    if case == "unknown_target":
        adapter = edit_config(adapter, tmp_path, target_modules=["qkv"])
    elif case == "other_target":
        adapter = edit_config(adapter, tmp_path, target_modules=["gate_proj"])
    elif case == "rank":
        adapter = edit_config(adapter, tmp_path, r=8)
    elif case == "other_model":
        other = make_model_dir(tmp_path / "small", hidden_size=32, intermediate_size=64, head_dim=8, **HYBRID)
        adapter = make_adapter(other, tmp_path / "small-lora")
    elif case == "not_lora":
        adapter = edit_config(adapter, tmp_path, peft_type="IA3")
    elif case == "no_adapter":
        adapter = base
    elif case == "not_r2lm":
        from transformers import Qwen3ForCausalLM

        Qwen3ForCausalLM(tiny_hf_config("qwen3")).save_pretrained(tmp_path / "qwen3")
        src = tmp_path / "qwen3"
    elif case == "unreadable_base":
        import shutil

        src = shutil.copytree(base, tmp_path / "truncated")
        damage_weights(src)
    elif case == "tied_lm_head":  # merged, B @ A would change embed_tokens too (they share the weight)
        src = make_model_dir(tmp_path / "tied", tie_word_embeddings=True, **HYBRID)
        adapter = make_adapter(src, tmp_path / "tied-lora", targets=("q_proj", "lm_head"))
    dst = tmp_path / "dst"
    with pytest.raises(ValueError, match=message):
        merge_lora(src, adapter, dst)
    assert not dst.exists() and not list(tmp_path.glob(".dst.*"))
    dst.mkdir()  # an existing (empty) DST, which --overwrite replaces only on success
    assert main(["merge-lora", str(src), str(adapter), str(dst), "--overwrite"]) == 2
    assert list(dst.iterdir()) == [] and not list(tmp_path.glob(".dst.*"))


def test_dst_must_differ_from_the_inputs(base, adapter):
    with pytest.raises(ValueError, match="is the source"):
        merge_lora(base, adapter, adapter, overwrite=True)

"""`python -m convert from-hf`: the mask token, atomic output, and bad input."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import tiny_hf_config, tiny_tokenizer
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from r2lm import R2LMForDiffusionLM
from r2lm.convert.__main__ import main
from r2lm.convert.from_hf import convert_from_hf


@pytest.fixture
def qwen3_dir(tmp_path):
    torch.manual_seed(0)
    tok = tiny_tokenizer()
    model = AutoModelForCausalLM.from_config(tiny_hf_config("qwen3", vocab_size=len(tok)))
    src = tmp_path / "qwen3"
    model.save_pretrained(src)
    tok.save_pretrained(src)
    return src


def _snapshot(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_adds_mask_token_to_tokenizer_embeddings_and_config(qwen3_dir, tmp_path):
    before = _snapshot(qwen3_dir)
    vocab = len(AutoTokenizer.from_pretrained(qwen3_dir))
    assert main(["from-hf", str(qwen3_dir), str(tmp_path / "out"), "--sidecar-layers", "1", "--headdim", "16", "--d-state", "8"]) == 0
    assert _snapshot(qwen3_dir) == before  # the source is never modified

    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    model = R2LMForDiffusionLM.from_pretrained(tmp_path / "out")
    mask_id = tok.convert_tokens_to_ids("<|mask|>")
    assert mask_id == vocab and tok.mask_token == "<|mask|>"
    assert model.config.mask_token_id == mask_id and model.config.vocab_size == vocab + 1
    emb = model.get_input_embeddings().weight
    torch.testing.assert_close(emb[mask_id], emb[:mask_id].mean(0))
    assert tok("a <|mask|> fox").input_ids.count(mask_id) == 1


def test_existing_mask_token_is_reused(qwen3_dir, tmp_path):
    convert_from_hf(qwen3_dir, tmp_path / "out", mask_token="<|pad|>")
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    model = R2LMForDiffusionLM.from_pretrained(tmp_path / "out")
    assert model.config.mask_token_id == tok.pad_token_id and model.config.vocab_size == len(tok)


def test_round_trip_is_bit_exact(qwen3_dir, tmp_path):
    convert_from_hf(qwen3_dir, tmp_path / "a", sidecar_layers=[0, 2], sidecar_headdim=16, sidecar_d_state=8)
    a = R2LMForDiffusionLM.from_pretrained(tmp_path / "a")
    with torch.no_grad():  # sidecar weights that differ from any initialisation
        for layer in (0, 2):
            a.model.layers[layer].sidecar.gate.fill_(0.7)
            a.model.layers[layer].sidecar.mixer.A_log.add_(0.5)
    a.save_pretrained(tmp_path / "b")
    b = R2LMForDiffusionLM.from_pretrained(tmp_path / "b")
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    assert b.config.to_diff_dict() | {"_name_or_path": ""} == a.config.to_diff_dict() | {"_name_or_path": ""}
    ids = torch.randint(0, 90, (1, 12))
    with torch.no_grad():
        assert torch.equal(a.eval()(ids).logits, b.eval()(ids).logits)


def test_existing_dst_needs_overwrite(qwen3_dir, tmp_path):
    dst = tmp_path / "out"
    convert_from_hf(qwen3_dir, dst)
    with pytest.raises(ValueError, match="already exists; pass --overwrite"):
        convert_from_hf(qwen3_dir, dst, sidecar_layers=[1], sidecar_headdim=16)
    assert R2LMForDiffusionLM.from_pretrained(dst).config.sidecar_layers == []
    convert_from_hf(qwen3_dir, dst, sidecar_layers=[1], sidecar_headdim=16, overwrite=True)  # an earlier output
    assert R2LMForDiffusionLM.from_pretrained(dst).config.sidecar_layers == [1]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporaries left


def test_unsupported_architecture(tmp_path):
    src = tmp_path / "gpt2"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported source architecture 'gpt2'"):
        convert_from_hf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_mismatched_checkpoint_leaves_no_dst(qwen3_dir, tmp_path):
    state = load_file(qwen3_dir / "model.safetensors")
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(state, qwen3_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj.weight has shape \(3, 3\)"):
        convert_from_hf(qwen3_dir, tmp_path / "out")
    assert list(tmp_path.iterdir()) == [qwen3_dir]


def test_corrupt_checkpoint(qwen3_dir, tmp_path):
    (qwen3_dir / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot read"):
        convert_from_hf(qwen3_dir, tmp_path / "out")


def test_bad_sidecar_layer_is_reported_by_the_cli(qwen3_dir, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "convert", "from-hf", str(qwen3_dir), str(tmp_path / "out"), "--sidecar-layers", "1,9"],
        capture_output=True, text=True,
    )
    assert result.returncode == 2
    assert "sidecar_layers [9] out of range for a model with 3 layers" in result.stderr
    assert not (tmp_path / "out").exists()


def test_help_lists_the_options():
    result = subprocess.run([sys.executable, "-m", "convert", "from-hf", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for option in ("--sidecar-layers", "--mask-token", "--d-state", "--overwrite"):
        assert option in result.stdout


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_to_hf_round_trip(arch, tmp_path):
    """from-hf then to-hf gives back a transformers model with the same logits (an R2LM without extra layers is
    its backbone); the mask row added by from-hf stays in the vocabulary."""
    from conftest import tiny_hf_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_hf_config(arch)).eval()
    hf.save_pretrained(tmp_path / "hf")
    convert_from_hf(tmp_path / "hf", tmp_path / "r2lm")
    assert main(["to-hf", str(tmp_path / "r2lm"), str(tmp_path / "back")]) == 0
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert back.config.model_type == arch
    ids = torch.randint(0, 96, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits[..., :96], hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_to_hf_refuses_extra_layers(tmp_path):
    from conftest import tiny_r2lm

    tiny_r2lm(sidecar_layers=[1]).save_pretrained(tmp_path / "r2lm")
    with pytest.raises(ValueError, match="no transformers counterpart"):
        from r2lm.convert.to_hf import convert_to_hf

        convert_to_hf(tmp_path / "r2lm", tmp_path / "out")
    assert not (tmp_path / "out").exists()

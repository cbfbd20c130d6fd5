"""The drafter r2lm ships for SmolLM2-135M-Instruct (r2lm/drafters/): it loads with its checksums verified, a
damaged copy is refused by name, and it is the one `Drafter.shipped` finds for SmolLM2 converted as the quickstart
converts it (with sidecars: verification runs without them), whose verified text is SmolLM2's greedy text."""

import json
import shutil

import pytest
import torch

from r2lm.drafter import SHIPPED, Drafter

FOLDER = SHIPPED / "smollm2-135m-instruct"


def test_it_is_small_in_bf16_and_names_its_target():
    files = sorted(p.name for p in FOLDER.iterdir())
    assert files == ["checksums.sha256", "config.json", "model.safetensors"]
    assert (FOLDER / "model.safetensors").stat().st_size <= 25 * 2**20
    config = json.loads((FOLDER / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and len(config["target_digest"]) == 16
    drafter = Drafter.from_pretrained(FOLDER)  # checked against checksums.sha256
    assert drafter.fuse.weight.dtype == torch.bfloat16 and drafter.config.target_vocab_size == 49153


@pytest.mark.parametrize("damage", ["weights", "config"])
def test_a_damaged_copy_is_refused_by_name(tmp_path, damage):
    copy = tmp_path / "drafter"
    shutil.copytree(FOLDER, copy)
    path = copy / ("model.safetensors" if damage == "weights" else "config.json")
    data = bytearray(path.read_bytes())
    data[-20] ^= 1  # one bit, inside the tensors' data / the config's text
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{path.name} is damaged: its sha256 differs"):
        Drafter.from_pretrained(copy)


@pytest.mark.slow
def test_it_is_found_for_smollm2_and_keeps_its_greedy_text(smollm2, smollm2_reference):
    """SmolLM2 from the offline GGUF, converted with sidecars on its top layers as the quickstart does."""
    from transformers import AutoTokenizer

    from r2lm import R2LMForDiffusionLM, generate

    model = R2LMForDiffusionLM.from_pretrained(smollm2).eval()
    drafter = Drafter.shipped(model)
    assert drafter is not None and drafter.config.target_digest == json.loads((FOLDER / "config.json").read_text())[
        "target_digest"]
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Name three primary colours."}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    greedy = smollm2_reference.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                        pad_token_id=tokenizer.eos_token_id)
    out = generate(model, ids, max_new_tokens=24, verify=True, drafter=drafter, eos_token_id=tokenizer.eos_token_id)
    assert torch.equal(out.sequences, greedy[:, : out.sequences.shape[1]])

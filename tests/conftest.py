import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from r2lm import R2LMConfig, R2LMForDiffusionLM

# Tiny models run faster on one thread, and a shared 2-core machine stalls multi-threaded tiny matmuls.
torch.set_num_threads(1)

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


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


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


def damage_weights(folder, damage: str = "truncated") -> str:
    """Damage `folder`'s model.safetensors as an interrupted copy ("truncated") or a lost file ("missing"); returns
    the start of the error every reader of it must give."""
    weights = folder / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:3000])
        return f"cannot read {weights}: "
    weights.unlink()
    return f"{folder} has no safetensors weights"

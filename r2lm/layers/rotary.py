"""Rotary position embeddings, including the scaled variants Llama 3 and Qwen use (via transformers' own
frequency functions, so the frequencies are exactly those of the source model)."""

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


class RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        inv_freq, self.attention_scaling = self.rope_init_fn(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # transformers' weight initialisation recomputes rotary buffers through these names after a meta-device load
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @property
    def rope_init_fn(self):
        if self.rope_type == "default":
            return self.compute_default_rope_parameters
        return ROPE_INIT_FUNCTIONS[self.rope_type]

    @staticmethod
    def compute_default_rope_parameters(config, **kwargs):
        dim = int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
        base = config.rope_parameters["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0

    @torch.no_grad()
    def forward(self, x: torch.Tensor, positions: torch.Tensor):
        """positions [B or 1, T] -> cos, sin [B or 1, T, head_dim] in x's dtype."""
        compute = torch.promote_types(x.dtype, torch.float32)  # fp32 for bf16/fp16 models, fp64 for fp64 ones
        freqs = positions[..., None].to(compute) * self.inv_freq.to(device=x.device, dtype=compute)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, d]; cos/sin [B, T, r] with r <= d: partial rotary (LLaDA 2) rotates the first r dims only."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        head, tail = x[..., :rot], x[..., rot:]
        return torch.cat([head * cos + rotate_half(head) * sin, tail], dim=-1)
    return x * cos + rotate_half(x) * sin

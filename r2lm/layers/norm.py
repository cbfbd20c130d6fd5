import torch
import torch.nn.functional as F
from torch import nn


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 upcast for the reduction, as transformers' norms do; float64 stays float64 (a float64 model is
    float64 throughout, which is what exactness tests compare against an oracle)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNorm(nn.Module):
    """RMSNorm in (at least) fp32, as Qwen3RMSNorm / LlamaRMSNorm (the weight multiplies after the cast back)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = at_least_float32(x)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class GatedRMSNorm(nn.Module):
    """Mamba2's output norm: RMSNorm(y * silu(z)) per group of channels (norm_before_gate=False)."""

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.variance_epsilon = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        y = at_least_float32(y) * F.silu(at_least_float32(z))
        groups = y.unflatten(-1, (-1, self.group_size)) if self.group_size != y.shape[-1] else y
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * groups.reshape(y.shape).to(dtype)

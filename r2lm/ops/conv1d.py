"""Depthwise causal 1-D convolution (Mamba's short conv), channels last."""

import torch
import torch.nn.functional as F

from r2lm.ops.kernels import optional_import


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None = None):
    """x [B, L, C], weight [C, K], bias [C]: out[t] = sum_k weight[:, k] * x[t - (K-1) + k] (+ bias), zero history."""
    length, kernel = x.shape[1], weight.shape[1]
    out = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=kernel - 1, groups=x.shape[2])
    out = out[..., :length].transpose(1, 2)
    return F.silu(out) if activation == "silu" else out


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None = None):
    """`causal_conv1d_fn` from the causal-conv1d package on CUDA when installed, else the reference."""
    if x.is_cuda and (fn := optional_import("causal_conv1d", "causal_conv1d_fn")) is not None:
        return fn(x.transpose(1, 2), weight, bias, activation=activation).transpose(1, 2)
    return causal_conv1d_ref(x, weight, bias, activation)

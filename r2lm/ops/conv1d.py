"""Depthwise causal 1-D convolution (Mamba's short conv), channels last, and its anti-causal mirror."""

import torch
import torch.nn.functional as F

from r2lm.ops.kernels import optional_import


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None = None,
                      reverse: bool = False):
    """x [B, L, C], weight [C, K], bias [C]: out[t] = sum_k weight[:, k] * x[t - (K-1) + k] (+ bias), zero history.

    `reverse`: the same filter run right to left, out[t] = sum_k weight[:, k] * x[t + (K-1) - k], i.e. the causal
    conv of the flipped sequence, flipped back; computed directly (a correlation with the flipped kernel)."""
    length, kernel = x.shape[1], weight.shape[1]
    w = weight.flip(-1) if reverse else weight
    out = F.conv1d(x.transpose(1, 2), w.unsqueeze(1), bias, padding=kernel - 1, groups=x.shape[2])
    out = (out[..., kernel - 1 :] if reverse else out[..., :length]).transpose(1, 2)
    return F.silu(out) if activation == "silu" else out


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None = None,
                  reverse: bool = False):
    """`causal_conv1d_fn` from the causal-conv1d package on CUDA when installed, else the reference."""
    if x.is_cuda and (fn := optional_import("causal_conv1d", "causal_conv1d_fn")) is not None:
        if reverse:  # the kernel is causal only
            return causal_conv1d(x.flip(1), weight, bias, activation).flip(1)
        return fn(x.transpose(1, 2), weight, bias, activation=activation).transpose(1, 2)
    return causal_conv1d_ref(x, weight, bias, activation, reverse)

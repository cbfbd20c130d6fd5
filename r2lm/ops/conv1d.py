"""Depthwise causal 1-D convolution (Mamba's short conv), channels last, and its anti-causal mirror."""

import torch
import torch.nn.functional as F

from r2lm.ops.kernels import optional_import


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None = None,
                      reverse: bool = False):
    """x [B, L, C], weight [C, K], bias [C]: out[t] = sum_k weight[:, k] * x[t - (K-1) + k] (+ bias), zero history.

    `reverse`: the same filter run right to left, out[t] = sum_k weight[:, k] * x[t + (K-1) - k], i.e. the causal
    conv of the flipped sequence, flipped back, computed directly.

    Written as K shifted copies of x (unfold) times the kernel, channels last: for the short windows of a decoder
    that is fewer operations than a grouped conv1d and its transposes, and the same arithmetic."""
    kernel = weight.shape[1]
    padded = F.pad(x, (0, 0, 0, kernel - 1) if reverse else (0, 0, kernel - 1, 0))
    windows = padded.unfold(1, kernel, 1)  # [B, L, C, K]: windows[:, t, :, j] = padded[:, t + j]
    out = (windows * (weight.flip(-1) if reverse else weight)).sum(-1)
    if bias is not None:
        out = out + bias
    return F.silu(out) if activation == "silu" else out


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None = None,
                  reverse: bool = False):
    """`causal_conv1d_fn` from the causal-conv1d package on CUDA when installed, else the reference."""
    if x.is_cuda and (fn := optional_import("causal_conv1d", "causal_conv1d_fn")) is not None:
        if reverse:  # the kernel is causal only
            return causal_conv1d(x.flip(1), weight, bias, activation).flip(1)
        return fn(x.transpose(1, 2), weight, bias, activation=activation).transpose(1, 2)
    return causal_conv1d_ref(x, weight, bias, activation, reverse)

"""Depthwise causal 1-D convolution (Mamba's short conv), channels last, and its anti-causal mirror."""

import torch
import torch.nn.functional as F

from r2lm.ops.kernels import optional_import, wants_fast_path


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
    """`causal_conv1d_fn` from the causal-conv1d package on CUDA when installed (r2lm.ops.kernels), else the
    reference. The package's kernel takes widths 2 to 4 only; other widths run the reference everywhere."""
    if (wants_fast_path(x) and 2 <= weight.shape[1] <= 4
            and (fn := optional_import("causal_conv1d", "causal_conv1d_fn")) is not None):
        if reverse:  # the kernel is causal only: convolve the flipped sequence, flip the result back
            x = x.flip(1)
        y = fn(kernel_layout(x), weight, bias, activation=activation).transpose(1, 2)
        return y.flip(1) if reverse else y
    return causal_conv1d_ref(x, weight, bias, activation, reverse)


def kernel_layout(x: torch.Tensor) -> torch.Tensor:
    """x [B, L, C] as the [B, C, L] tensor causal-conv1d's kernel accepts, copying only when it must.

    The kernel reads either a [B, C, L] tensor contiguous in L, or a channels-last one (the transpose of a
    [B, L, C] tensor contiguous in C) whose channel count and batch and position strides are multiples of 8; it
    rejects other channels-last strides. A slice of a wider projection (the mixer's conv input is one) has the
    projection's row stride, so it is copied unless that stride happens to be a multiple of 8."""
    channels = x.shape[2]
    if x.stride(2) == 1 and channels % 8 == 0 and x.stride(0) % 8 == 0 and x.stride(1) % 8 == 0:
        return x.transpose(1, 2)  # channels-last, as it is
    if channels % 8 == 0:
        return x.contiguous().transpose(1, 2)  # channels-last, strides C and L*C
    return x.transpose(1, 2).contiguous()  # [B, C, L], contiguous in L

"""Kernels. Each op has a pure-PyTorch reference (the CPU path and the test oracle) and, where a CUDA package
is installed (the `gpu` extra), a fast path chosen per call when the tensors are on CUDA."""

from r2lm.ops.attention import attention
from r2lm.ops.conv1d import causal_conv1d, causal_conv1d_ref
from r2lm.ops.ssd import ssd_chunk_scan_ref, ssd_recurrent_ref, ssd_scan, ssd_window_ref

__all__ = ["attention", "causal_conv1d", "causal_conv1d_ref", "ssd_chunk_scan_ref", "ssd_recurrent_ref", "ssd_scan",
           "ssd_window_ref"]

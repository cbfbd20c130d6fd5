"""Kernel dispatch: the optional CUDA packages are imported lazily, only for CUDA tensors; where a GPU and the
packages are present, kernels equal the PyTorch references (invariant 6)."""

import importlib.util
import subprocess
import sys

import pytest
import torch

from r2lm.ops import causal_conv1d, causal_conv1d_ref, kernels, ssd_chunk_scan_ref, ssd_scan

GPU_PACKAGES = ("mamba_ssm", "causal_conv1d", "flash_attn")


def test_importing_r2lm_imports_no_gpu_package():
    code = f"import sys, r2lm, r2lm.ops, r2lm.generation; print([m for m in sys.modules if m.split('.')[0] in {GPU_PACKAGES!r}])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_cpu_tensors_never_look_for_kernels(monkeypatch):
    def forbidden(*args):
        raise AssertionError("a CUDA package was looked up for CPU tensors")

    monkeypatch.setattr("r2lm.ops.ssd.optional_import", forbidden)
    monkeypatch.setattr("r2lm.ops.conv1d.optional_import", forbidden)
    x = torch.randn(1, 5, 2, 4)
    ssd_scan(x, torch.randn(1, 5, 2), -torch.ones(2), torch.randn(1, 5, 1, 3), torch.randn(1, 5, 1, 3), 4)
    causal_conv1d(torch.randn(1, 5, 3), torch.randn(3, 4), None)


def test_missing_package_means_no_fast_path():
    kernels.optional_import.cache_clear()
    assert kernels.optional_import("r2lm_no_such_package", "fn") is None


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_gpu
@pytest.mark.skipif(importlib.util.find_spec("mamba_ssm") is None, reason="needs the gpu extra (mamba-ssm)")
def test_ssd_kernel_matches_reference():
    g = torch.Generator(device="cuda").manual_seed(0)
    b, length, h, p, n = 2, 200, 8, 64, 64
    args = [torch.randn(b, length, h, p, device="cuda", generator=g), torch.randn(b, length, h, device="cuda", generator=g),
            -torch.rand(h, device="cuda", generator=g) - 0.5, torch.randn(b, length, 1, n, device="cuda", generator=g),
            torch.randn(b, length, 1, n, device="cuda", generator=g)]
    D, dt_bias = torch.randn(h, device="cuda", generator=g), torch.randn(h, device="cuda", generator=g)
    torch.testing.assert_close(ssd_scan(*args, 64, D=D, dt_bias=dt_bias), ssd_chunk_scan_ref(*args, 64, D=D, dt_bias=dt_bias),
                               atol=2e-3, rtol=2e-3)


@needs_gpu
@pytest.mark.skipif(importlib.util.find_spec("causal_conv1d") is None, reason="needs the gpu extra (causal-conv1d)")
def test_conv_kernel_matches_reference():
    x, w, bias = torch.randn(2, 100, 64, device="cuda"), torch.randn(64, 4, device="cuda"), torch.randn(64, device="cuda")
    torch.testing.assert_close(causal_conv1d(x, w, bias, "silu"), causal_conv1d_ref(x, w, bias, "silu"), atol=1e-4, rtol=1e-4)

"""r2lm's CUDA fast-path branches, run on CPU (issue 33): the code around mamba_ssm's and causal-conv1d's kernels
(argument order, the flips of the right-to-left scan, dt_bias + softplus, D, ngroups, chunking, layouts) against
the PyTorch references, forward and backward.

`r2lm.ops.kernels.force_fast_path()` sends CPU tensors down the branch CUDA tensors take. mamba_ssm's Triton
kernels then run for real in Triton's interpreter (TRITON_INTERPRET=1; float32 only: the interpreter mishandles
bf16). causal-conv1d's kernel is CUDA C++, so its extension module is replaced by `_CausalConv1dExtension`, which
enforces the extension's input checks (causal-conv1d 1.7.0, csrc/causal_conv1d.cpp) and computes with the
package's own `causal_conv1d_ref`; the package's Python side (its autograd Function and custom ops) runs as is.

scripts/env.sh installs triton, mamba-ssm and causal-conv1d without their CUDA builds; without them the module is
skipped. No state is passed to the kernels (r2lm's scans start from zero and return no final state), so
initial / final states have no branch to test.
"""

import contextlib
import importlib.util
import multiprocessing
import os
import sys
import types
import warnings
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from r2lm import Layout
from r2lm.layers import Mamba2Mixer
from r2lm.ops import causal_conv1d, causal_conv1d_ref, kernels, ssd_scan
from r2lm.ops.kernels import force_fast_path
from tests.helpers.models import MASK_ID, tiny_r2lm

SCAN = ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")
CONV = ("causal_conv1d", "causal_conv1d_fn")
MISSING = [name for name in ("triton", "mamba_ssm", "causal_conv1d") if importlib.util.find_spec(name) is None]


def _layout_checks(x, weight, bias, out, dout=None):
    """causal_conv1d_fwd / causal_conv1d_bwd's TORCH_CHECKs on shapes and layouts (csrc/causal_conv1d.cpp); `out`
    is the output (dx for the backward), which the kernels write with x's layout (contiguous channels or steps)."""
    def check(ok, message="causal_conv1d: layout check failed"):
        if not ok:
            raise RuntimeError(message)

    check(x.dtype in (torch.float32, torch.float16, torch.bfloat16), "x: float32, float16 or bfloat16")
    batch, dim, seqlen = x.shape
    width = weight.shape[-1]
    check(weight.shape == (dim, width), "weight must have shape (dim, width)")
    check(x.stride(2) == 1 or x.stride(1) == 1)
    channel_last = x.stride(1) == 1 and x.stride(2) > 1
    if dout is not None:  # the backward makes dout match x's layout before its checks
        dout = dout.transpose(-1, -2).contiguous().transpose(-1, -2) if channel_last else dout.contiguous()
    if channel_last:
        check(dim % 8 == 0, "causal_conv1d only supports channel dimension divisible by 8 for now")
        check(x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0,
              "causal_conv1d with channel last layout requires strides (x.stride(0) and x.stride(2)) to be multiples of 8")
        if dout is not None:
            check(dout.stride(2) % 8 == 0 and dout.stride(0) % 8 == 0,
                  "causal_conv1d with channel last layout requires strides (dout.stride(0) and dout.stride(2)) to be multiples of 8")
    check(out.stride(1) == 1 if channel_last else out.stride(2) == 1, "output in x's layout")
    check(2 <= width <= 4, "causal_conv1d only supports width between 2 and 4")
    if bias is not None:
        check(bias.dtype == weight.dtype and bias.stride(-1) == 1 and bias.shape == (dim,), "bias: weight's dtype, (dim,)")
    return dout


class _CausalConv1dExtension(types.ModuleType):
    """Stands in for the compiled `causal_conv1d_cuda`: the extension's checks, the package's reference values."""

    def __init__(self):
        super().__init__("causal_conv1d_cuda")

    @staticmethod
    def causal_conv1d_fwd(x, weight, bias, seq_idx, initial_states, out, final_states_out, silu_activation):
        assert seq_idx is None and initial_states is None and final_states_out is None  # r2lm passes none
        _layout_checks(x, weight, bias, out)
        from causal_conv1d.causal_conv1d_interface import causal_conv1d_ref as package_ref

        out.copy_(package_ref(x, weight, bias, activation="silu" if silu_activation else None))

    @staticmethod
    def causal_conv1d_bwd(x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx, dweight, dbias,
                          dinitial_states, silu_activation):
        assert seq_idx is None and initial_states is None and dfinal_states is None
        dout = _layout_checks(x, weight, bias, dx, dout)
        from causal_conv1d.causal_conv1d_interface import causal_conv1d_ref as package_ref

        # The gradients written out (a custom op's body runs below autograd): pre = b + sum_k w_k x[t - (K-1) + k]
        width = weight.shape[1]
        dpre = dout.float()
        if silu_activation:
            pre = package_ref(x, weight, bias).float()
            sig = torch.sigmoid(pre)
            dpre = dpre * sig * (1 + pre * (1 - sig))
        windows = torch.nn.functional.pad(x.float(), (width - 1, 0)).unfold(-1, width, 1)  # [B, C, L, K]
        dweight.copy_(torch.einsum("bclk,bcl->ck", windows, dpre))
        if dbias is not None:
            dbias.copy_(dpre.sum((0, 2)))
        later = torch.nn.functional.pad(dpre, (0, width - 1)).unfold(-1, width, 1)  # [B, C, L, K]: dpre[t + k]
        dx.copy_(torch.einsum("bclk,ck->bcl", later, weight.float().flip(-1)))


def _setup_interpreter():
    """Run once in the worker process: make the kernels importable and runnable on CPU.

    - TRITON_INTERPRET=1 is in the worker's environment from its start: triton reads it as its @jit decorators
      run, and torch._dynamo imports triton with torch's first compile-related import, long before any test;
    - mamba_ssm's package `__init__` imports its CUDA extension (selective_scan_cuda): its subpackages are loaded
      under a package module that skips it;
    - deterministic mode (MAMBA_DETERMINISTIC=1): the autotuner keeps one config instead of timing several;
    - `torch.cuda.device(None)` raises on a CPU build, and the backward asks for the GPU's SM count.
    """
    torch.set_num_threads(1)
    spec = importlib.util.find_spec("mamba_ssm")
    package = types.ModuleType("mamba_ssm")
    package.__path__, package.__spec__ = list(spec.submodule_search_locations), spec
    sys.modules["mamba_ssm"] = package
    sys.modules["causal_conv1d_cuda"] = _CausalConv1dExtension()
    torch.cuda.device = lambda index: contextlib.nullcontext()
    torch.cuda.get_device_properties = lambda device: types.SimpleNamespace(multi_processor_count=2)
    warnings.filterwarnings("ignore", "Deterministic mode")  # mamba_ssm's advice on GPU autotuning
    # A kernel that was asked for and could not be imported must fail a test, not fall back to the reference.
    warnings.filterwarnings("error", ".*cannot be imported", RuntimeWarning)
    scan, conv = kernels.optional_import(*SCAN), kernels.optional_import(*CONV)
    assert scan is not None and scan.__module__ == SCAN[0], scan
    assert conv is not None and conv.__module__ == "causal_conv1d.causal_conv1d_interface", conv


class _Worker:
    """A spawned process with the interpreter's environment that runs test bodies (module-level functions)."""

    def __init__(self):
        saved = dict(os.environ)
        os.environ.update(TRITON_INTERPRET="1", MAMBA_DETERMINISTIC="1")
        try:  # the process starts (and reads its environment) at the first submit
            self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_setup_interpreter)
            self.pool.submit(os.getpid).result(timeout=300)
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def run(self, fn, *args):
        return self.pool.submit(fn, *args).result(timeout=300)


@pytest.fixture(scope="module")
def interpreter():
    if MISSING:
        pytest.skip(f"{', '.join(MISSING)} not installed (scripts/env.sh installs them without CUDA builds)")
    worker = _Worker()
    yield worker
    worker.pool.shutdown()


def _scan_inputs(length, ngroups, batch=2, nheads=4, headdim=8, d_state=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, nheads, headdim, generator=g)
    dt = torch.randn(batch, length, nheads, generator=g)
    A = -torch.rand(nheads, generator=g) * 4 - 0.5
    B, C = (torch.randn(batch, length, ngroups, d_state, generator=g) for _ in range(2))
    D, dt_bias = torch.randn(nheads, generator=g), torch.randn(nheads, generator=g)
    return [x, dt, A, B, C, D, dt_bias]


def _values_and_grads(fn, inputs, seed=1):
    """fn's output and the gradients of a random projection of it with respect to every input."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return [out, *torch.autograd.grad((out * weight).sum(), leaves)]


def _fast_and_reference(fn):
    """fn() with the fast path forced, and fn() on the CPU reference."""
    want = fn()
    with force_fast_path():
        got = fn()
    return got, want


def _assert_close(got, want):
    for name, a, b in zip(["output", *(f"gradient {i}" for i in range(len(got) - 1))], got, want, strict=True):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4, msg=lambda m, name=name: f"{name}: {m}")


# ---------------------------------------------------------------------------------------------- SSD scan


def _ssd_case(length, ngroups, reverse, chunk=8):
    def scan(x, dt, A, B, C, D, dt_bias):
        return ssd_scan(x, dt, A, B, C, chunk, D=D, dt_bias=dt_bias, reverse=reverse)

    inputs = _scan_inputs(length, ngroups)
    _assert_close(*_fast_and_reference(lambda: _values_and_grads(scan, inputs)))


@pytest.mark.parametrize(
    "length, ngroups, reverse",
    [
        (8, 1, True),  # a sidecar window: one chunk (of 8), right to left
        (8, 2, True),
        (5, 1, False),  # shorter than a chunk
        (24, 1, False),  # chunks that divide the length
        (20, 2, False),  # and that do not
        (24, 2, True),
        (20, 1, True),
    ],
)
def test_ssd_kernel_branch_matches_reference(interpreter, length, ngroups, reverse):
    """ssd_scan's kernel branch equals the CPU reference: output and the gradients of x, dt, A, B, C, D, dt_bias."""
    interpreter.run(_ssd_case, length, ngroups, reverse)


# ---------------------------------------------------------------------------------------------- conv1d


def _conv_input(batch, length, channels, row, offset=0, seed=2):
    """x [batch, length, channels] as a column slice of a [batch, length, row] projection (row >= channels)."""
    wide = torch.randn(batch, length, row, generator=torch.Generator().manual_seed(seed))
    return wide[..., offset : offset + channels]


def _conv_case(channels, row, offset, reverse):
    x = _conv_input(2, 11, channels, row, offset)
    g = torch.Generator().manual_seed(3)
    inputs = [x, torch.randn(channels, 4, generator=g), torch.randn(channels, generator=g)]
    want = _values_and_grads(lambda x, w, b: causal_conv1d_ref(x, w, b, "silu", reverse=reverse), inputs)
    with force_fast_path():
        got = _values_and_grads(lambda x, w, b: causal_conv1d(x, w, b, "silu", reverse=reverse), inputs)
    _assert_close(got, want)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize(
    "channels, row, offset",
    [
        (16, 16, 0),  # contiguous
        (16, 36, 4),  # a slice of a projection whose row is not a multiple of 8 (the mixer's in_proj, nheads odd)
        (16, 40, 8),  # a slice of one whose row is
        (12, 12, 0),  # channels not a multiple of 8: only the [B, C, L] layout is accepted
    ],
)
def test_conv_kernel_branch_layouts_and_values(interpreter, channels, row, offset, reverse):
    """causal_conv1d's kernel branch hands the kernel a layout it accepts, in both directions, and equals the
    reference, forward and backward."""
    interpreter.run(_conv_case, channels, row, offset, reverse)


def _bad_layout_case():
    fn = kernels.optional_import(*CONV)
    x, weight = _conv_input(2, 11, 16, 36, 4), torch.randn(16, 4)
    with pytest.raises(RuntimeError, match="multiples of 8"):
        fn(x.transpose(1, 2), weight, None, activation="silu")
    torch.testing.assert_close(fn(x.contiguous().transpose(1, 2), weight, None).transpose(1, 2),
                               causal_conv1d_ref(x, weight, None))


def test_conv_extension_checks_reject_a_bad_layout(interpreter):
    """The stand-in extension rejects what causal-conv1d rejects: a projection's column slice handed over as it is,
    when the row is not a multiple of 8 (what r2lm's left-to-right conv did before issue 33)."""
    interpreter.run(_bad_layout_case)


# ---------------------------------------------------------------------------------------------- layers


def _mixer_case(reverse):
    torch.manual_seed(0)
    mixer = Mamba2Mixer(64, d_state=16, headdim=32, ngroups=2, chunk_size=8)
    u = torch.randn(2, 13, 64)

    def run():
        mixer.zero_grad()
        leaf = u.detach().requires_grad_()
        out = mixer(leaf, reverse=reverse)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
        return [out, leaf.grad, *(p.grad for p in mixer.parameters())]

    _assert_close(*_fast_and_reference(run))


@pytest.mark.parametrize("reverse", [False, True])
def test_mamba2_mixer_fast_path_matches_reference(interpreter, reverse):
    """The mixer as a whole, 4 heads of 32 (its in_proj row, 2*64 + 2*16 + 4 + 64 = 292 wide, is not a multiple of
    8), over a length that does not divide its chunk: output and the gradients of the input and every parameter."""
    interpreter.run(_mixer_case, reverse)


def _sidecar_case():
    sidecar = tiny_r2lm(open_gates=True, sidecar_layers=[1], sidecar_headdim=32).model.layers[1].sidecar
    h = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(5))
    windows = torch.tensor([[-1, -1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]])
    with torch.no_grad():
        sidecar.mixer.dt_bias.fill_(0.5)  # dt ~ 1: the state matters (initialised, dt ~ 0.01 and D x dominates)
        # compared: what the sidecar adds (next to h itself, a wrong scan would hide in the tolerance)
        _assert_close(*_fast_and_reference(lambda: [sidecar(h, slice(4, 12)) - h, sidecar(h, windows) - h]))


def test_sidecar_fast_path_matches_reference(interpreter):
    """The reverse sidecar on a decoding window (a slice) and on training windows (padded column indices)."""
    interpreter.run(_sidecar_case)


def _model_case():
    model = tiny_r2lm(open_gates=True, sidecar_layers=[0, 2])
    ids = torch.randint(0, MASK_ID, (2, 13), generator=torch.Generator().manual_seed(4))
    layout = Layout.cat(Layout.span(torch.ones(2, 5)), Layout.span(torch.ones(2, 8), start=5, noisy=True, chunk=1))
    with torch.no_grad():
        _assert_close(*_fast_and_reference(lambda: [model(ids, layout=layout).logits]))


def test_r2lm_forward_fast_path_matches_reference(interpreter):
    """A whole R2LM forward (sidecars on two layers, gates open) over a prompt and a noisy window."""
    interpreter.run(_model_case)


# ---------------------------------------------------------------------------------------------- a fast path lost


@pytest.mark.filterwarnings("default")
def test_installed_package_that_cannot_import_warns_once(tmp_path, monkeypatch):
    """A package that is installed but fails to import (as mamba-ssm does without its CUDA extension) is named,
    with its error and the cost, once; the op runs its reference."""
    package = tmp_path / "r2lm_broken_kernels"
    package.mkdir()
    (package / "__init__.py").write_text("import r2lm_broken_kernels_cuda\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    kernels.optional_import.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=r"r2lm_broken_kernels is installed.*r2lm_broken_kernels_cuda.*slower"):
            assert kernels.optional_import("r2lm_broken_kernels.ops", "scan") is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert kernels.optional_import("r2lm_broken_kernels.ops", "scan") is None  # said once
            assert kernels.optional_import("r2lm_not_installed", "scan") is None  # absent: the CPU case, no warning
    finally:
        kernels.optional_import.cache_clear()


@pytest.mark.filterwarnings("default")
@pytest.mark.skipif(importlib.util.find_spec("mamba_ssm") is None, reason="mamba-ssm not installed")
def test_mamba_ssm_without_its_cuda_extension_warns(monkeypatch):
    """The case issue 33 found: mamba-ssm installed without selective_scan_cuda. Asked for the kernel, ssd_scan
    says so once and returns the reference result."""
    if importlib.util.find_spec("selective_scan_cuda") is not None:
        pytest.skip("mamba-ssm has its CUDA extension here")
    for name in [m for m in sys.modules if m.split(".")[0] in ("mamba_ssm", "causal_conv1d", "causal_conv1d_cuda")]:
        monkeypatch.delitem(sys.modules, name)
    saved_modules = set(sys.modules)
    kernels.optional_import.cache_clear()
    inputs = _scan_inputs(8, 1)
    try:
        with force_fast_path():
            with pytest.warns(RuntimeWarning, match="mamba_ssm is installed.*selective_scan_cuda.*slower") as caught:
                got = ssd_scan(*inputs[:5], 8, D=inputs[5], dt_bias=inputs[6], reverse=True)
                ssd_scan(*inputs[:5], 8, D=inputs[5], dt_bias=inputs[6], reverse=True)
        assert len([w for w in caught if "mamba_ssm is installed" in str(w.message)]) == 1
        torch.testing.assert_close(got, ssd_scan(*inputs[:5], 8, D=inputs[5], dt_bias=inputs[6], reverse=True))
    finally:
        for name in set(sys.modules) - saved_modules:
            del sys.modules[name]
        kernels.optional_import.cache_clear()


def test_force_fast_path_is_scoped():
    x = torch.zeros(1)
    assert not kernels.wants_fast_path(x)
    with force_fast_path():
        assert kernels.wants_fast_path(x)
        with force_fast_path():
            pass
        assert kernels.wants_fast_path(x)
    assert not kernels.wants_fast_path(x)


def test_conv_widths_the_kernel_lacks_run_the_reference(monkeypatch):
    """causal-conv1d takes widths 2 to 4: a sidecar_d_conv of 5 must not reach it on a GPU."""
    def kernel_lookup(module, attr):
        raise AssertionError(f"{module}.{attr} looked up for a width the kernel rejects")

    monkeypatch.setattr("r2lm.ops.conv1d.optional_import", kernel_lookup)
    x, weight = torch.randn(1, 6, 8), torch.randn(8, 5)
    with force_fast_path():
        torch.testing.assert_close(causal_conv1d(x, weight, None), causal_conv1d_ref(x, weight, None))

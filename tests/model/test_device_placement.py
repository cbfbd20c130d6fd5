"""CPU analogues of a GPU-only failure: a tensor built on the CPU meeting activations on the GPU. On a CPU machine
every tensor is on the CPU, so such a mistake never shows; torch's "meta" device (shapes, no data) stands in for
the GPU here: mixing a CPU tensor into a meta computation raises just as mixing it into a CUDA one does.

Found by reading the CUDA-only branches (issue 33): Layout.cat built the windows of several slice windows (the
layout of a verification forward, or a prompt with two windows) on the CPU whatever the layout's device, and the
sidecar then indexed GPU activations with them."""

import pytest
import torch

from r2lm import Layout
from tests.helpers.models import tiny_r2lm


def noisy_span(start: int, width: int, chunk: int, device) -> Layout:
    """A window of `width` columns (Layout.span without its data-dependent padding check, which meta cannot run)."""
    return Layout(positions=torch.arange(start, start + width, device=device)[None],
                  chunks=torch.full((width,), chunk, device=device),
                  noisy=torch.ones(width, dtype=torch.bool, device=device), window_columns=slice(0, width))


def test_windows_of_a_cat_layout_are_on_its_device():
    layout = Layout.cat(noisy_span(0, 4, 0, "meta"), noisy_span(1, 4, 2, "meta"), noisy_span(2, 3, 4, "meta"))
    assert isinstance(layout.windows, torch.Tensor) and layout.windows.device.type == "meta"
    cpu = Layout.cat(noisy_span(0, 4, 0, "cpu"), noisy_span(1, 3, 2, "cpu"))  # the same windows, with their values
    assert cpu.windows.tolist() == [[0, 1, 2, 3], [-1, 4, 5, 6]]


def test_sidecar_reads_several_windows_off_the_cpu():
    sidecar = tiny_r2lm(open_gates=True, sidecar_layers=[1]).model.layers[1].sidecar.to("meta")
    layout = Layout.cat(noisy_span(0, 4, 0, "meta"), noisy_span(1, 4, 2, "meta"))
    h = torch.empty(2, layout.length, 64, device="meta")
    assert sidecar(h, layout.windows).shape == h.shape
    with pytest.raises(RuntimeError, match="device"):  # what a CPU index does to activations elsewhere
        sidecar(h, layout.windows.new_empty(layout.windows.shape, device="cpu").fill_(0))

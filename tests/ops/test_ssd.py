"""The chunked SSD scan against the step-by-step recurrence and against transformers' Mamba2Mixer."""

import pytest
import torch
from transformers import Mamba2Config
from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMamba2Mixer

from r2lm.layers import Mamba2Mixer
from r2lm.ops import causal_conv1d_ref, ssd_chunk_scan_ref, ssd_recurrent_ref


def _inputs(batch=2, length=23, nheads=4, headdim=8, ngroups=2, d_state=6):
    x = torch.randn(batch, length, nheads, headdim, dtype=torch.float64)
    dt = torch.randn(batch, length, nheads, dtype=torch.float64)
    A = -torch.rand(nheads, dtype=torch.float64) * 4 - 0.5
    B = torch.randn(batch, length, ngroups, d_state, dtype=torch.float64)
    C = torch.randn(batch, length, ngroups, d_state, dtype=torch.float64)
    D = torch.randn(nheads, dtype=torch.float64)
    dt_bias = torch.randn(nheads, dtype=torch.float64)
    return x, dt, A, B, C, D, dt_bias


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 23, 64])
def test_chunked_scan_equals_recurrence(chunk_size):
    x, dt, A, B, C, D, dt_bias = _inputs()
    expected = ssd_recurrent_ref(x, dt, A, B, C, D=D, dt_bias=dt_bias)
    got = ssd_chunk_scan_ref(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias)
    assert got.dtype == x.dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-5, rtol=1e-5)


def test_scan_is_causal():
    x, dt, A, B, C, D, dt_bias = _inputs(length=16)
    base = ssd_chunk_scan_ref(x, dt, A, B, C, 4, D=D, dt_bias=dt_bias)
    x2 = x.clone()
    x2[:, 9] += 1.0
    moved = (ssd_chunk_scan_ref(x2, dt, A, B, C, 4, D=D, dt_bias=dt_bias) - base).abs().amax(dim=(0, 2, 3))
    assert torch.all(moved[:9] == 0) and torch.all(moved[9:] > 0)


def test_causal_conv1d_ref_matches_definition():
    x, w, b = torch.randn(2, 9, 5), torch.randn(5, 4), torch.randn(5)
    out = causal_conv1d_ref(x, w, b)
    padded = torch.nn.functional.pad(x, (0, 0, 3, 0))
    expected = torch.stack([(padded[:, t : t + 4] * w.T).sum(1) + b for t in range(9)], dim=1)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("length,chunk_size", [(16, 8), (21, 8), (5, 16)])
def test_mixer_matches_transformers_mamba2(length, chunk_size):
    hidden, d_state, headdim, ngroups = 32, 16, 8, 2
    hf_config = Mamba2Config(
        hidden_size=hidden, state_size=d_state, expand=2, head_dim=headdim, num_heads=2 * hidden // headdim,
        n_groups=ngroups, chunk_size=chunk_size, conv_kernel=4, use_conv_bias=True, use_bias=False,
        layer_norm_epsilon=1e-6, num_hidden_layers=1,
    )
    hf = HFMamba2Mixer(hf_config, layer_idx=0).eval()
    ours = Mamba2Mixer(hidden, d_state=d_state, expand=2, headdim=headdim, ngroups=ngroups, chunk_size=chunk_size)
    with torch.no_grad():  # random non-default SSM parameters, shared by name
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=True)
    u = torch.randn(3, length, hidden)
    with torch.no_grad():
        torch.testing.assert_close(ours(u), hf(u), atol=1e-5, rtol=1e-4)

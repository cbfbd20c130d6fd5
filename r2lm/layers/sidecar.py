"""The reverse Mamba sidecar (R2LM, docs/design.md 1.1): compressed right-side context for the active window.

    u = RMSNorm(h[window]);  r = Mamba2_reverse(u);  h[window] += tanh(gate) * r

r_i summarises the window inputs at positions >= i: the mixer runs right to left (its conv anti-causal, its scan
from the window's end), which is `flip(Mamba2(flip(u)))` computed without the flips. The sidecar only ever
touches window (noisy) positions, so clean tokens, and therefore every cached key and value, stay a function of
tokens to their left: that is what keeps the KV cache exact. The gate starts at 0, so a freshly converted model
is bit-identical to its backbone.
"""

import torch
from torch import nn

from r2lm.layers.mamba2 import Mamba2Mixer
from r2lm.layers.norm import RMSNorm


class ReverseSidecar(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mixer = Mamba2Mixer(
            config.hidden_size,
            d_state=config.sidecar_d_state,
            d_conv=config.sidecar_d_conv,
            expand=config.sidecar_expand,
            headdim=config.sidecar_headdim,
            ngroups=config.sidecar_ngroups,
            chunk_size=config.sidecar_chunk_size,
            eps=config.rms_norm_eps,
        )
        self.gate = nn.Parameter(torch.zeros(1))

    def scan(self, u: torch.Tensor) -> torch.Tensor:
        """Right-to-left mixer over u [N, L, d]: output i depends on u[i:] only."""
        return self.mixer(self.norm(u), reverse=True)

    def forward(self, h: torch.Tensor, windows: torch.Tensor | slice) -> torch.Tensor:
        """Add the gated reverse scan of each window to h [B, T, d].

        windows: a slice of columns (one window, the decoding case), or [W, Lw] column indices of each window's
        tokens in order, right-aligned and padded with -1 on the left (training layouts). A right-to-left scan
        never carries the padding into the real tokens on its right."""
        gate = torch.tanh(self.gate).to(h.dtype)
        if isinstance(windows, slice):
            u = h[:, windows]
            out = u + gate * self.scan(u)
            if u.shape[1] == h.shape[1]:
                return out
            return h.slice_scatter(out, dim=1, start=windows.start, end=windows.stop)
        batch, _, dim = h.shape
        columns = windows.clamp(min=0)
        u = h[:, columns].reshape(batch * windows.shape[0], windows.shape[1], dim)
        # padding adds an exact zero (to column 0) rather than being selected out: no boolean indexing, so no host
        # synchronisation (verified decoding reads several windows per forward)
        r = torch.where((windows >= 0)[..., None], self.scan(u).view(batch, *windows.shape, dim), 0.0)
        return h.index_add(1, columns.flatten(), (gate * r).flatten(1, 2))

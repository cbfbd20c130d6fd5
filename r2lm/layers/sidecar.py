"""The reverse Mamba sidecar (R2LM, DESIGN 1.1): compressed right-side context for the active window.

    u = RMSNorm(h[window]);  r = flip(Mamba2(flip(u)));  h[window] += tanh(gate) * r

r_i summarises the window inputs at positions >= i (the conv becomes anti-causal after the flip). The sidecar
only ever touches window (noisy) positions, so clean tokens, and therefore every cached key and value, stay a
function of tokens to their left: that is what keeps the KV cache exact. The gate starts at 0, so a freshly
converted model is bit-identical to its backbone.
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
        return self.mixer(self.norm(u).flip(1)).flip(1)

    def forward(self, h: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        """Add the gated reverse scan of each window to h [B, T, d].

        windows [W, Lw]: column indices of each window's tokens in order, right-aligned and padded with -1 on
        the left. After the flip the padding comes last, where a causal scan cannot carry it into real tokens."""
        batch, _, dim = h.shape
        real = windows >= 0
        u = h[:, windows.clamp(min=0)].reshape(batch * windows.shape[0], windows.shape[1], dim)
        r = self.scan(u).view(batch, *windows.shape, dim)[:, real]
        return h.index_add(1, windows[real], torch.tanh(self.gate).to(r.dtype) * r)

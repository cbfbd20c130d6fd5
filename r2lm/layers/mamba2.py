"""Mamba2 mixer (SSD), with the parameter names of mamba_ssm's `Mamba2` and transformers' `Mamba2Mixer`."""

import math

import torch
from torch import nn
from transformers import initialization as init

from r2lm.layers.norm import GatedRMSNorm
from r2lm.ops import causal_conv1d, ssd_scan


class Mamba2Mixer(nn.Module):
    """in_proj -> (z, xBC, dt); depthwise causal conv + SiLU on xBC; SSD scan; gated RMSNorm with z; out_proj."""

    def __init__(self, hidden_size, d_state=64, d_conv=4, expand=2, headdim=64, ngroups=1, chunk_size=64, eps=1e-6):
        super().__init__()
        self.d_inner = expand * hidden_size
        self.d_state, self.headdim, self.ngroups, self.chunk_size = d_state, headdim, ngroups, chunk_size
        self.nheads = self.d_inner // headdim
        self.conv_dim = self.d_inner + 2 * ngroups * d_state
        self.in_proj = nn.Linear(hidden_size, self.d_inner + self.conv_dim + self.nheads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, d_conv, groups=self.conv_dim, padding=d_conv - 1)
        self.dt_bias = nn.Parameter(torch.empty(self.nheads))
        self.A_log = nn.Parameter(torch.empty(self.nheads))
        self.D = nn.Parameter(torch.empty(self.nheads))
        self.norm = GatedRMSNorm(self.d_inner, group_size=self.d_inner // ngroups, eps=eps)
        self.out_proj = nn.Linear(self.d_inner, hidden_size, bias=False)
        if self.A_log.device.type != "meta":
            self.reset_ssm_parameters()

    @torch.no_grad()
    def reset_ssm_parameters(self, dt_min=1e-3, dt_max=1e-1, dt_floor=1e-4, a_range=(1.0, 16.0)):
        """mamba_ssm's initialisation: A ~ U[1, 16], dt log-uniform in [dt_min, dt_max] stored as softplus^-1, D = 1.

        Through transformers' init functions, so parameters already loaded from a checkpoint are left alone."""
        init.copy_(self.A_log, torch.log(torch.empty(self.nheads).uniform_(*a_range)))
        dt = torch.exp(torch.rand(self.nheads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_floor)
        init.copy_(self.dt_bias, dt + torch.log(-torch.expm1(-dt)))
        init.ones_(self.D)

    def forward(self, u: torch.Tensor, reverse: bool = False) -> torch.Tensor:
        """u [B, L, hidden] -> [B, L, hidden], causal in L; with `reverse`, anti-causal: the mixer run right to
        left (what `self(u.flip(1)).flip(1)` computes, without the two copies)."""
        batch, length, _ = u.shape
        z, xbc, dt = self.in_proj(u).split([self.d_inner, self.conv_dim, self.nheads], dim=-1)
        xbc = causal_conv1d(xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias, activation="silu", reverse=reverse)
        x, B, C = xbc.split([self.d_inner, self.ngroups * self.d_state, self.ngroups * self.d_state], dim=-1)
        y = ssd_scan(
            x.view(batch, length, self.nheads, self.headdim),
            dt,
            -torch.exp(self.A_log.float()),
            B.view(batch, length, self.ngroups, self.d_state),
            C.view(batch, length, self.ngroups, self.d_state),
            self.chunk_size,
            D=self.D,
            dt_bias=self.dt_bias,
            reverse=reverse,
        )
        return self.out_proj(self.norm(y.reshape(batch, length, self.d_inner), z))

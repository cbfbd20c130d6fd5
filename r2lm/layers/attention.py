import torch
from torch import nn

from r2lm.layers.hybrid import BlockHybridAttention
from r2lm.layers.norm import RMSNorm
from r2lm.layers.rotary import apply_rotary
from r2lm.ops import attention
from r2lm.ops.flex import flex_attention


class Attention(nn.Module):
    """GQA softmax attention with RoPE; optional q/k RMSNorm over head_dim (Qwen3) and q/k/v bias (Qwen2).

    The masks come from the layout (see r2lm.layout). A softmax layer with a cache writes this forward's keys and
    values into the cache's scratch columns and attends over everything cached so far plus them. A block-hybrid
    layer (`hybrid_layers`) keeps no keys: it reads earlier chunks through its linear state (S, Z) and folds a
    commit's keys into it."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        d = config.hidden_size
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.linear_attention = BlockHybridAttention(config) if layer_idx in config.hybrid_layers else None

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries [B, heads, T, head_dim] and keys, values [B, kv_heads, T, head_dim], RoPE applied."""
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # one rotation for queries and keys together: the same elementwise arithmetic, half the operations
        qk = apply_rotary(torch.cat([q, k], dim=2).transpose(1, 2), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k, v.transpose(1, 2)

    def forward(self, x, plan, cache=None):
        """(output [B, T, hidden], attention-transfer MSE or None)."""
        q, k, v = self.project(x, plan.cos, plan.sin)
        mse = None
        if self.linear_attention is not None:
            state = cache.state(self.layer_idx) if cache is not None else None
            parts = plan.hybrid if plan.hybrid is not None else (plan.own, plan.earlier)
            out, delta = self.linear_attention(
                q, k, v, self.scaling, parts, plan.valid, state, fold=plan.commit if cache is not None else 0
            )
            if delta is not None:
                cache.fold(self.layer_idx, *delta)
            if plan.transfer:  # the softmax teacher goes on; the hybrid student is only scored
                with torch.no_grad():
                    teacher = _softmax(q, k, v, plan, self.scaling)
                mse = _masked_mse(out, teacher, plan.valid)
                out = teacher
        else:
            if cache is not None:
                k, v = cache.update(self.layer_idx, k, v, plan.columns, plan.keys)
            out = _softmax(q, k, v, plan, self.scaling)
        return self.o_proj(out.transpose(1, 2).flatten(2)), mse


def _softmax(q, k, v, plan, scale):
    """Softmax attention as the plan says: over the layout's BlockMask (flex_attention) or a dense / causal mask."""
    if plan.block_mask is not None:
        return flex_attention(q, k, v, plan.block_mask, scale)
    return attention(q, k, v, plan.mask, scale, is_causal=plan.is_causal)


def _masked_mse(student, teacher, valid):
    """Mean squared error over real positions ([B, H, T, d] outputs; valid [B, T] or None)."""
    err = (student.float() - teacher.float()).pow(2)
    if valid is None:
        return err.mean()
    keep = valid[:, None, :, None].to(err.dtype)
    return (err * keep).sum() / (keep.sum() * err.shape[1] * err.shape[3]).clamp_min(1)

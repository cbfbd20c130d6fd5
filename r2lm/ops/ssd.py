"""Mamba2 structured state-space duality (SSD) scan.

Per head h with scalar decay A_h < 0, for t = 0..L-1 (state [headdim, d_state], zero at t = -1):

    dt_t    = softplus(dt_raw_t + dt_bias)
    state_t = exp(dt_t * A) * state_{t-1} + dt_t * x_t B_t^T
    y_t     = state_t C_t + D * x_t

`ssd_recurrent_ref` runs it step by step (the oracle); `ssd_chunk_scan_ref` is the chunked form (quadratic
inside a chunk, a recurrence over chunk states between chunks) that runs fast on CPU; `ssd_window_ref` is the
one-chunk case written out (a sidecar window is rarely longer than a chunk: no padding, no chunk states), in
either direction; `ssd_scan` picks mamba_ssm's Triton kernel for CUDA tensors when it is installed.

`reverse=True` runs the recurrence right to left (t = L-1 .. 0, state zero at t = L): the scan of the flipped
sequence, flipped back. The reverse sidecar computes it directly instead of flipping its inputs and outputs.

Shapes: x [B, L, H, P], dt [B, L, H], A [H], B and C [B, L, G, N] with G dividing H, D [H].
"""

import torch
import torch.nn.functional as F

from r2lm.ops.kernels import optional_import, wants_fast_path


def _discretise(dt, dt_bias):
    return F.softplus(dt.float() + dt_bias.float())


def _heads(t, nheads):
    """[B, L, G, N] -> [B, L, H, N]: each group of B/C serves nheads / G consecutive heads."""
    return t.repeat_interleave(nheads // t.shape[2], dim=2)


def ssd_recurrent_ref(x, dt, A, B, C, D=None, dt_bias=None):
    """Step-by-step recurrence in fp32: the definition, used as the test oracle."""
    batch, length, nheads, _ = x.shape
    dt = _discretise(dt, dt_bias if dt_bias is not None else torch.zeros_like(A))
    B, C = _heads(B.float(), nheads), _heads(C.float(), nheads)
    state = x.new_zeros(batch, nheads, x.shape[3], B.shape[3], dtype=torch.float32)
    ys = []
    for t in range(length):
        decay = torch.exp(dt[:, t] * A.float())  # [B, H]
        inp = (dt[:, t, :, None] * x[:, t].float())[..., None] * B[:, t, :, None, :]
        state = decay[..., None, None] * state + inp
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y.to(x.dtype)


def _segsum(x):
    """x [..., T] -> [..., T, T] with out[i, j] = x[j+1] + ... + x[i] for i >= j and -inf above the diagonal.

    Summing masked copies (rather than subtracting cumulative sums) keeps it exact for long chunks."""
    T = x.shape[-1]
    x = x[..., None].expand(*x.shape, T)
    x = torch.cumsum(x.masked_fill(_upper(T, 0, x.device), 0), dim=-2)  # keep k > j only
    return x.masked_fill(_upper(T, 1, x.device), float("-inf"))


def ssd_chunk_scan_ref(x, dt, A, B, C, chunk_size, D=None, dt_bias=None):
    """Chunked SSD in fp32, any length (the tail is zero-padded: dt = 0 there, so it neither decays nor feeds)."""
    batch, length, nheads, headdim = x.shape
    dtype = x.dtype
    chunk_size = min(chunk_size, length)  # any chunk size gives the same result; padding a short window is waste
    dt = _discretise(dt, dt_bias if dt_bias is not None else torch.zeros_like(A))
    x, B, C = x.float(), B.float(), C.float()
    pad = (-length) % chunk_size
    if pad:
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
    nchunks = x.shape[1] // chunk_size
    # [B, c, s, H or G, ...]: chunk c, step s inside it
    x, B, C = (t.reshape(batch, nchunks, chunk_size, t.shape[2], -1) for t in (x, B, C))
    dt = dt.reshape(batch, nchunks, chunk_size, nheads)
    xdt = x * dt[..., None]
    dA = (dt * A.float()).permute(0, 3, 1, 2)  # [B, H, c, s]
    dA_cumsum = torch.cumsum(dA, dim=-1)

    # 1. Inside each chunk: y_l = sum_{s <= l} (C_l . B_s) exp(dA_{s+1} + ... + dA_l) dt_s x_s
    #    (C . B is computed once per group and shared by the group's heads)
    decay = torch.exp(_segsum(dA)).permute(0, 2, 1, 3, 4)  # [B, c, H, l, s]
    groups = torch.einsum("bclgn,bcsgn->bcgls", C, B)
    scores = groups.repeat_interleave(nheads // groups.shape[2], dim=2) * decay
    y = torch.einsum("bchls,bcshp->bclhp", scores, xdt)

    if nchunks > 1:  # a sequence of one chunk (a sidecar window) has no state to carry
        per_head = nheads // B.shape[3]
        y = y + _carried(B.repeat_interleave(per_head, dim=3), C.repeat_interleave(per_head, dim=3), xdt, dA_cumsum)
    y = y.reshape(batch, nchunks * chunk_size, nheads, headdim)[:, :length]
    if D is not None:
        y = y + x.reshape(batch, -1, nheads, headdim)[:, :length] * D.float()[:, None]
    return y.to(dtype)


def _carried(B, C, xdt, dA_cumsum):
    """What each chunk receives from the chunks before it (B, C per head: [B, c, s, H, N])."""
    # 2. The state each chunk leaves behind, from its own inputs only.
    decay_to_end = torch.exp(dA_cumsum[..., -1:] - dA_cumsum)  # [B, H, c, s]
    chunk_states = torch.einsum("bcshn,bhcs,bcshp->bchpn", B, decay_to_end, xdt)

    # 3. Carry states across chunks: the state entering chunk c sums chunk states c' < c, decayed.
    chunk_states = torch.cat([torch.zeros_like(chunk_states[:, :1]), chunk_states], dim=1)
    chunk_decay = torch.exp(_segsum(F.pad(dA_cumsum[..., -1], (1, 0))))  # [B, H, c+1, c+1]
    entering = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, chunk_states)[:, :-1]

    # 4. What the entering state contributes at each step.
    return torch.einsum("bclhn,bchpn,bhcl->bclhp", C, entering, torch.exp(dA_cumsum))


def ssd_window_ref(x, dt, A, B, C, D=None, dt_bias=None, reverse: bool = False):
    """The whole sequence as one chunk, in fp32: y = (decay * C B^T) (dt x) + D x, with

        forward  decay[i, j] = exp(dA_{j+1} + ... + dA_i)   for j <= i
        reverse  decay[i, j] = exp(dA_i + ... + dA_{j-1})   for j >= i

    Fewer operations than the chunked form (what matters for a 16-token window on a CPU) and no padding; meant for
    lengths up to a chunk (it is quadratic in the length)."""
    batch, length, nheads, headdim = x.shape
    dt = _discretise(dt, dt_bias if dt_bias is not None else torch.zeros_like(A))  # [B, L, H]
    dA = (dt * A.float()).transpose(1, 2)  # [B, H, L]
    decay = torch.exp(_reverse_segsum(dA) if reverse else _segsum(dA))  # [B, H, L, L]
    groups = B.shape[2]
    CB = C.float().transpose(1, 2) @ B.float().permute(0, 2, 3, 1)  # [B, G, L, L], shared by the heads of a group
    scores = (decay.view(batch, groups, nheads // groups, length, length) * CB[:, :, None]).flatten(1, 2)
    y = (scores @ (x.float() * dt[..., None]).transpose(1, 2)).transpose(1, 2)  # [B, L, H, P]
    if D is not None:
        y = torch.addcmul(y, x.float(), D.float()[:, None])
    return y.to(x.dtype)


def _reverse_segsum(x):
    """x [..., T] -> [..., T, T] with out[i, j] = x[i] + ... + x[j-1] for j >= i (0 on the diagonal), -inf below.

    Like _segsum, each entry sums its own segment (no difference of long cumulative sums)."""
    T = x.shape[-1]
    before = _upper(T, 1, x.device).T  # k < i: not in row i's segments
    sums = x[..., None, :].expand(*x.shape[:-1], T, T).masked_fill(before, 0).cumsum(-1)  # [i, j] = x[i..j]
    return F.pad(sums[..., :-1], (1, 0)).masked_fill(before, float("-inf"))


_UPPER: dict = {}


def _upper(T: int, diagonal: int, device) -> torch.Tensor:
    """Bool [T, T], True on and above the `diagonal`-th diagonal (built once per size: masks of every forward)."""
    key = (T, diagonal, str(device))
    if key not in _UPPER:
        _UPPER[key] = torch.ones(T, T, dtype=torch.bool, device=device).triu(diagonal)
    return _UPPER[key]


def ssd_scan(x, dt, A, B, C, chunk_size, D=None, dt_bias=None, reverse: bool = False):
    """SSD scan: mamba_ssm's `mamba_chunk_scan_combined` on CUDA when installed (r2lm.ops.kernels), else
    `ssd_window_ref` for a sequence that fits in one chunk and `ssd_chunk_scan_ref` for a longer one."""
    if wants_fast_path(x) and (fn := optional_import("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")):
        if reverse:  # the kernel scans left to right only: scan the flipped sequence, flip the result back
            x, dt, B, C = (t.flip(1) for t in (x, dt, B, C))
        y = fn(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=True)
        return y.flip(1) if reverse else y
    if x.shape[1] <= chunk_size:
        return ssd_window_ref(x, dt, A, B, C, D=D, dt_bias=dt_bias, reverse=reverse)
    if reverse:
        flipped = ssd_chunk_scan_ref(x.flip(1), dt.flip(1), A, B.flip(1), C.flip(1), chunk_size, D=D, dt_bias=dt_bias)
        return flipped.flip(1)
    return ssd_chunk_scan_ref(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias)

"""y = x W^T + b with a CPU decode fast path; `torch.nn.functional.linear` is the reference.

A decode forward multiplies a few rows (the tokens of a step, times the batch) by every weight of the model. On a
CPU that is memory-bound: the weights are read once whatever the number of rows, so a step of 4 tokens should cost
about what a step of 1 costs -- the premise of every parallel decoder. MKL's sgemm, as `F.linear` calls it
(x @ W^T with x of few rows), is far from that: measured with `python -m eval.linear_cost` on this project's
2-core AVX-512 machines, a forward's products with SmolLM2-135M's weights take about 38 ms at 1 row and 55-80 ms
at 2-8 rows. The same product computed the other way round, (W @ x^T)^T, comes near memory bandwidth: about
20-25 ms for 1-4 rows, 30-45 ms for 5-8; from 12 rows on the two cost about the same. A single row is read as two
(one row dispatches to gemv, the slow path). On a 2-core AVX2 AMD EPYC, with ~3x less memory bandwidth, the
fast path takes 66-69 ms for 1-4 rows against F.linear's 68 at 1 row and 116-124 at 2-4; at 12 rows (past
FEW_ROWS) it would run at 0.92x F.linear's speed.

Only without autograd (training keeps `F.linear`, and with it DeepSpeed ZeRO-3's patched linear) or autocast,
float32 on CPU and at most FEW_ROWS rows, where it was measured faster. A weight of at most SMALL_WEIGHT elements
takes it only at 2 to SMALL_WEIGHT_ROWS rows. Such a weight may stay in the cache (every weight of a tiny model such
as QUICKSTART_TINY's), where F.linear's kernel is the faster one: the fast path costs 2.8x at one row, 1.15x at 2-4,
1.3-1.6x at 5-8 (192 x 576, AVX2 EPYC). Among a real model's weights it streams from memory like the others:
SmolLM2-135M's k_proj and v_proj (192 x 576) took 123 us at 4 rows through F.linear in a verify=True forward,
77 us at one row, and about 60 us at 2-4 rows through the fast path, so verify=True with lookup drafts took 4% less
time over 8 prompts; at one row and at 5-8 the two are within 5%. The sums are the same products in another order:
equal to `F.linear` up to float rounding, as any two sgemm blockings are.

The fast path returns (W @ x^T)^T as it is, a column-major view, not a row-major copy: copying
a few columns of many rows into rows is a strided gather that costs far more than its size suggests (measured on
the AVX2 machine: 37 us for 1536 x 4 values, 0.45-0.87 ms for a 4-row lm_head output, against 4 and 30 us for a
contiguous copy), and the operations that read the output take its strides. Without that copy, AR decoding of
SmolLM2 (4 prompts, 64 tokens each) took 5.5% less time there, verify=True with lookup drafts 2% less.

An input that is such a view (the MLP's act(gate) * up, elementwise on two of them) is copied into rows before
its product, the copy the output skipped but of the smaller side (4 x 1536 values, ~20-40 us): W @ x^T with x^T
row-major makes MKL's sgemm take 2.2x as long as with x^T column-major (AVX2 EPYC, SmolLM2's down_proj at 4
rows: 735-766 against 340-345 us; 360-377 us copy included), about 12 ms of a 4-row SmolLM2 forward.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

FEW_ROWS = 8  # eval.linear_cost: from 12 rows on both orders cost about the same, or F.linear less
SMALL_WEIGHT = 1 << 18  # 1 MiB of float32
SMALL_WEIGHT_ROWS = 4  # the most rows at which a small weight takes the fast path (from 2 on)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if (torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") or x.device.type != "cpu"
            or any(t.dtype != torch.float32 for t in (x, weight) + (() if bias is None else (bias,)))
            or not 0 < rows <= FEW_ROWS
            or (weight.numel() <= SMALL_WEIGHT and not 2 <= rows <= SMALL_WEIGHT_ROWS)):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    # rows in memory (x^T column-major): another fast path's output, a column-major view, would make x^T row-major,
    # and MKL's product with a row-major narrow right-hand side takes 2.2x as long (see the docstring)
    flat = torch.cat([flat, flat]) if rows == 1 else flat.contiguous()
    out = torch.mm(weight, flat.t()).t()[:rows]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])  # a view of the transposed product: see the docstring

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
float32 on CPU, at most FEW_ROWS rows and weights of more than SMALL_WEIGHT elements, where it was measured faster: a small
weight stays in the cache (the README main job's 1M-parameter model: every weight), where F.linear's kernel is
the faster one and the fast path's extra operations cost more than its product (3x at one row). The sums are the
same products in another order: equal to `F.linear` up to float rounding, as any two sgemm blockings are.

The fast path returns (W @ x^T)^T as it is, a column-major view, not a row-major copy: copying
a few columns of many rows into rows is a strided gather that costs far more than its size suggests (measured on
the AVX2 machine: 37 us for 1536 x 4 values, 0.45-0.87 ms for a 4-row lm_head output, against 4 and 30 us for a
contiguous copy), and the operations that read the output take its strides. Without that copy, AR decoding of
SmolLM2 (4 prompts, 64 tokens each) took 5.5% less time there, verify=True with lookup drafts 2% less.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

FEW_ROWS = 8  # eval.linear_cost: from 12 rows on both orders cost about the same, or F.linear less
SMALL_WEIGHT = 1 << 18  # 1 MiB of float32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if (torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") or x.device.type != "cpu"
            or any(t.dtype != torch.float32 for t in (x, weight) + (() if bias is None else (bias,)))
            or not 0 < rows <= FEW_ROWS or weight.numel() <= SMALL_WEIGHT):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:
        flat = torch.cat([flat, flat])
    out = torch.mm(weight, flat.t()).t()[:rows]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])  # a view of the transposed product: see the docstring

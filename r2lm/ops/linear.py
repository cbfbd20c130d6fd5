"""y = x W^T + b for decoding on a CPU: `torch.nn.functional.linear` (the reference), or the same product computed
the other way round, (W @ x^T)^T, wherever that measured faster on the machine at hand.

A decode forward multiplies a few rows (the tokens of a step, times the batch) by every weight of the model. On a
CPU that is memory-bound: the weights are read once whatever the number of rows, so a step of 4 tokens should cost
about what a step of 1 costs -- the premise of every parallel decoder. Whether BLAS gets near that depends on the
machine: on some, x @ W^T with few rows runs far below memory bandwidth while W @ x^T streams the weight at full
speed; on others it is the other way round (docs/results.md, "Few-row matrix products on a CPU"). So no
constant decides: each shape class (rows, the weight's shape, torch's thread count) is measured at its first uses
in this process, inside the forwards that use it (where its weight streams from memory as it will from then on,
rather than sitting in a cache as it would in a loop over one weight): TRIALS calls time each order, alternating,
and the faster median wins, the transposed order only by a margin (MARGIN). Until a class is decided, every call
returns the reference's product, so what a forward computes never depends on a timing in progress. `decisions()`
reports the choices and their timings (`python -m eval.linear_cost` prints them; the decision is also logged at
debug level).

The transposed order applies only without autograd (training keeps `F.linear`, and with it DeepSpeed ZeRO-3's
patched linear) or autocast, to float32 on CPU and at most FEW_ROWS rows. Its sums are the same products in another
order: equal to `F.linear` up to float rounding, as any two sgemm blockings are.

It returns (W @ x^T)^T as it is, a column-major view: copying a few columns of many rows into rows is a strided
gather that costs more than its size suggests, and the operations that read the output take its strides. An input
that is such a view (the MLP's act(gate) * up, elementwise on two of them) is copied into rows before its product:
W @ x^T with x^T row-major is a slow layout for MKL's sgemm.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time

import torch
from torch.nn import functional as F

logger = logging.getLogger(__name__)

FEW_ROWS = 16  # above this many rows sgemm's blocking is efficient either way: the reference, unmeasured
TRIALS = 8  # timed calls of each order per shape class
MARGIN = 0.95  # the transposed order is chosen only if its median time is below MARGIN x the reference's

_trials: dict[tuple, tuple[list[float], list[float]]] = {}  # class -> (transposed times, reference times)
_chosen: dict[tuple, bool] = {}  # class -> the transposed order is faster
_forced: bool | None = None  # forced(): True / False for every eligible call, None: measured


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if (torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") or x.device.type != "cpu"
            or any(t.dtype != torch.float32 for t in (x, weight) + (() if bias is None else (bias,)))
            or not 0 < rows <= FEW_ROWS):
        return F.linear(x, weight, bias)
    if _forced is not None:
        return transposed(x, weight, bias) if _forced else F.linear(x, weight, bias)
    key = (rows, *weight.shape, torch.get_num_threads())
    chosen = _chosen.get(key)
    if chosen is None:
        if torch.compiler.is_compiling():  # no timing inside a traced graph
            return F.linear(x, weight, bias)
        return _trial(key, x, weight, bias)
    return transposed(x, weight, bias) if chosen else F.linear(x, weight, bias)


def transposed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear's product computed as (W @ x^T)^T, returned as that column-major view (see the module docstring)."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    # rows in memory (x^T column-major): another call's output, a column-major view, would make x^T row-major.
    # A single row is read as two: one row would dispatch to gemv, which is not the kernel measured here.
    flat = torch.cat([flat, flat]) if rows == 1 else flat.contiguous()
    out = torch.mm(weight, flat.t()).t()[:rows]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _trial(key: tuple, x, weight, bias) -> torch.Tensor:
    """One call of an undecided class: time one order (each in its turn, with the weight as the forward left it);
    return the reference's product either way."""
    fast, reference = _trials.setdefault(key, ([], []))
    start = time.perf_counter()
    if len(fast) < len(reference):
        transposed(x, weight, bias)
        fast.append(time.perf_counter() - start)
        out = F.linear(x, weight, bias)
    else:
        out = F.linear(x, weight, bias)
        reference.append(time.perf_counter() - start)
    if len(fast) == TRIALS:
        _chosen[key] = statistics.median(fast) < MARGIN * statistics.median(reference)
        logger.debug("linear %s rows x %s: transposed %.1f us, F.linear %.1f us (medians of %d): %s", key[0],
                     tuple(key[1:3]), 1e6 * statistics.median(fast), 1e6 * statistics.median(reference), TRIALS,
                     "transposed" if _chosen[key] else "F.linear")
    return out


def decisions() -> list[dict]:
    """Every shape class decided in this process: rows, weight shape, threads, both medians (us), the order used."""
    out = []
    for key, chosen in sorted(_chosen.items()):
        fast, reference = _trials[key]
        out.append({"rows": key[0], "weight": list(key[1:3]), "threads": key[3],
                    "transposed_us": round(1e6 * statistics.median(fast), 1),
                    "f_linear_us": round(1e6 * statistics.median(reference), 1),
                    "order": "transposed" if chosen else "F.linear"})
    return out


def forget() -> None:
    """Drop every measurement and decision (the next calls measure again)."""
    _trials.clear()
    _chosen.clear()


@contextlib.contextmanager
def forced(order: str):
    """Within the block every eligible call takes `order` ("transposed" or "reference") without measuring: for
    tests of either path, and for benchmarks that time one order."""
    global _forced
    if order not in ("transposed", "reference"):
        raise ValueError(f"order must be 'transposed' or 'reference', got {order!r}")
    previous, _forced = _forced, order == "transposed"
    try:
        yield
    finally:
        _forced = previous

"""y = x W^T + b for decoding on a CPU: `torch.nn.functional.linear` (the reference), the same product computed the
other way round, (W @ x^T)^T, or r2lm's few-row kernel (r2lm/ops/few_rows.py, where this machine has a build of it),
wherever one measured faster on the machine at hand.

A decode forward multiplies a few rows (the tokens of a step, times the batch) by every weight of the model. On a
CPU that is memory-bound: the weights are read once whatever the number of rows, so a step of 4 tokens should cost
about what a step of 1 costs -- the premise of every parallel decoder. Whether BLAS gets near that depends on the
machine: on some, x @ W^T with few rows runs far below memory bandwidth while W @ x^T streams the weight at full
speed; on others it is the other way round (docs/results.md, "Few-row matrix products on a CPU"). So no
constant decides: each shape class (rows, the weight's shape, torch's thread count) is measured at its first uses
in this process, inside the forwards that use it (where its weight streams from memory as it will from then on,
rather than sitting in a cache as it would in a loop over one weight): TRIALS calls time each order, in turn, and
the fastest median wins, an order other than the reference only by a margin (MARGIN). Until a class is decided, every call
returns the reference's product, so what a forward computes never depends on a timing in progress. `decisions()`
reports the choices and their timings (`python -m eval.linear_cost` prints them; the decision is also logged at
debug level).

The other orders apply only without autograd (training keeps `F.linear`, and with it DeepSpeed ZeRO-3's
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

from r2lm.ops.few_rows import kernel

logger = logging.getLogger(__name__)

FEW_ROWS = 16  # above this many rows sgemm's blocking is efficient either way: the reference, unmeasured
TRIALS = 8  # timed calls of each order per shape class
MARGIN = 0.95  # an order other than the reference is chosen only if its median time is below MARGIN x the reference's
REFERENCE = "F.linear"

_trials: dict[tuple, dict[str, list[float]]] = {}  # class -> order -> times
_chosen: dict[tuple, str] = {}  # class -> the order used
_forced: str | None = None  # forced(): the order of every eligible call; None: measured


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if (torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") or x.device.type != "cpu"
            or any(t.dtype != torch.float32 for t in (x, weight) + (() if bias is None else (bias,)))
            or not 0 < rows <= FEW_ROWS):
        return F.linear(x, weight, bias)
    if _forced is not None:
        return ORDERS[_forced](x, weight, bias)
    key = (rows, *weight.shape, torch.get_num_threads())
    chosen = _chosen.get(key)
    if chosen is None:
        if torch.compiler.is_compiling():  # no timing inside a traced graph
            return F.linear(x, weight, bias)
        return _trial(key, x, weight, bias)
    return ORDERS[chosen](x, weight, bias)


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


def few_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear's product by r2lm's few-row kernel (r2lm/ops/few_rows.py; it must be built)."""
    out = kernel().few_rows(x.reshape(-1, x.shape[-1]).contiguous(), weight.contiguous())
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


ORDERS = {REFERENCE: F.linear, "transposed": transposed, "kernel": few_rows}


def _orders() -> list[str]:
    """The orders measured on this machine: the kernel only where it is built."""
    return [REFERENCE, "transposed"] + (["kernel"] if kernel() is not None else [])


def _trial(key: tuple, x, weight, bias) -> torch.Tensor:
    """One call of an undecided class: time the order with the fewest timings so far (with the weight as the
    forward left it); return the reference's product whatever was timed."""
    times = _trials.setdefault(key, {order: [] for order in _orders()})
    order = min(times, key=lambda o: len(times[o]))
    start = time.perf_counter()
    out = ORDERS[order](x, weight, bias)
    times[order].append(time.perf_counter() - start)
    if order != REFERENCE:
        out = F.linear(x, weight, bias)
    if all(len(t) == TRIALS for t in times.values()):
        medians = {o: statistics.median(t) for o, t in times.items()}
        best = min(medians, key=medians.get)
        _chosen[key] = best if best == REFERENCE or medians[best] < MARGIN * medians[REFERENCE] else REFERENCE
        logger.debug("linear %s rows x %s: %s (medians of %d: %s)", key[0], tuple(key[1:3]), _chosen[key], TRIALS,
                     ", ".join(f"{o} {1e6 * m:.1f} us" for o, m in medians.items()))
    return out


def undecided() -> int:
    """Shape classes still being timed (their products run every order in turn: a forward costs more until then)."""
    return sum(key not in _chosen for key in _trials)


def decisions() -> list[dict]:
    """Every shape class decided in this process: rows, weight shape, threads, each order's median (us), the order
    used."""
    out = []
    for key, chosen in sorted(_chosen.items()):
        out.append({"rows": key[0], "weight": list(key[1:3]), "threads": key[3],
                    "us": {o: round(1e6 * statistics.median(t), 1) for o, t in _trials[key].items()},
                    "order": chosen})
    return out


def forget() -> None:
    """Drop every measurement and decision (the next calls measure again)."""
    _trials.clear()
    _chosen.clear()


@contextlib.contextmanager
def forced(order: str):
    """Within the block every eligible call takes `order` ("reference", "transposed" or "kernel") without measuring:
    for tests of each path, and for benchmarks that time one order."""
    global _forced
    order = REFERENCE if order == "reference" else order
    if order not in ORDERS:
        raise ValueError(f"order must be 'reference', 'transposed' or 'kernel', got {order!r}")
    if order == "kernel" and kernel() is None:
        raise ValueError("the few-row kernel is not built on this machine: python -m r2lm.ops.few_rows")
    previous, _forced = _forced, order
    try:
        yield
    finally:
        _forced = previous

"""y = x W^T + b for decoding on a CPU, applied to a model from outside: `install(model)` makes its `nn.Linear`
layers multiply through a `Tuner`, which takes `torch.nn.functional.linear` (the reference), the same product
computed the other way round, (W @ x^T)^T, or r2lm's few-row kernel (r2lm/ops/few_rows.py, where this machine has
a build of it), wherever one measured faster on the machine at hand. A model nobody installed it on is plain
PyTorch: its products are `F.linear`'s, whatever ran before in the process.

A decode forward multiplies a few rows (the tokens of a step, times the batch) by every weight of the model. On a
CPU that is memory-bound: the weights are read once whatever the number of rows, so a step of 4 tokens should cost
about what a step of 1 costs -- the premise of every parallel decoder. Whether BLAS gets near that depends on the
machine: on some, x @ W^T with few rows runs far below memory bandwidth while W @ x^T streams the weight at full
speed; on others it is the other way round (docs/results.md, "Few-row matrix products on a CPU"). So no
constant decides: a Tuner measures each shape class (rows, the weight's shape, torch's thread count) at its first
uses, inside the forwards that use it (where its weight streams from memory as it will from then on, rather than
sitting in a cache as it would in a loop over one weight): TRIALS calls time each order, in turn, and the fastest
median wins, an order other than the reference only by a margin (MARGIN). A weight larger than the CPU's last-level
cache streams from memory however often it is multiplied, so its class takes all its timed calls at its first use
(the lm_head, used once a forward, would otherwise stay undecided for len(orders) x TRIALS forwards). Until a class
is decided, every call returns the reference's product, so what a forward computes never depends on a timing in
progress; once decided, a class keeps its order. `Tuner.save` / `Tuner.load` keep the decisions across processes
(a file made on another machine, torch or kernel build is refused), so two processes with the same decisions
compute the same bits. `Tuner(order=...)` takes one order everywhere without measuring (tests of each path,
benchmarks of one order).

The other orders apply only without autograd (training keeps `F.linear`, and with it DeepSpeed ZeRO-3's patched
linear) or autocast, to float32 on CPU and at most FEW_ROWS rows. Their sums are the same products in another
order: equal to `F.linear` up to float rounding, as any two sgemm blockings are.

It returns (W @ x^T)^T as it is, a column-major view: copying a few columns of many rows into rows is a strided
gather that costs more than its size suggests, and the operations that read the output take its strides. An input
that is such a view (the MLP's act(gate) * up, elementwise on two of them) is copied into rows before its product:
W @ x^T with x^T row-major is a slow layout for MKL's sgemm.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from r2lm.ops.few_rows import build_name, kernel

logger = logging.getLogger(__name__)

FEW_ROWS = 16  # above this many rows sgemm's blocking is efficient either way: the reference, unmeasured
TRIALS = 8  # timed calls of each order per shape class
MARGIN = 0.95  # an order other than the reference is chosen only if its median time is below MARGIN x the reference's
REFERENCE = "F.linear"


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


@torch.library.custom_op("r2lm::few_rows", mutates_args=())
def few_rows_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The kernel as a torch operator: torch.compile keeps it in its graph, where a plain call would break the graph
    at every product (and a decode step would run as many small compiled pieces)."""
    return kernel().few_rows(x, weight)


@few_rows_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def few_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear's product by r2lm's few-row kernel (r2lm/ops/few_rows.py; it must be built): called directly, or as
    an operator inside torch.compile (eager calls skip the operator's dispatch)."""
    product = few_rows_op if torch.compiler.is_compiling() else kernel().few_rows
    out = product(x.reshape(-1, x.shape[-1]).contiguous(), weight.contiguous())
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


ORDERS = {REFERENCE: F.linear, "transposed": transposed, "kernel": few_rows}


@functools.cache
def last_level_cache(folder: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """Bytes of this CPU's largest cache, as Linux describes it (0 where unknown: every class is then timed a call
    at a time)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    sizes = []
    for entry in folder.glob("index*/size"):
        try:
            text = entry.read_text().strip()
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text))
        except (OSError, ValueError):
            continue
    return max(sizes, default=0)


def machine() -> str:
    """What decisions hold for: this CPU (model and flags), torch's version and the kernel's source (the kernel's
    build name digests exactly these)."""
    return build_name()


def _order_named(order: str) -> str:
    order = REFERENCE if order == "reference" else order
    if order not in ORDERS:
        raise ValueError(f"order must be 'reference', 'transposed' or 'kernel', got {order!r}")
    if order == "kernel" and kernel() is None:
        raise ValueError("the few-row kernel is not built on this machine: python -m r2lm.ops.few_rows")
    return order


class Tuner:
    """Which order each shape class of few-row products takes in this process (the module docstring): decided by
    timing at first use, loaded from a file, or one `order` for every eligible call."""

    def __init__(self, order: str | None = None):
        self.order = None if order is None else _order_named(order)
        self.trials: dict[tuple, dict[str, list[float]]] = {}  # class -> order -> times
        self.chosen: dict[tuple, str] = {}  # class -> the order used
        self.timed = 0  # products timed so far (read every decode step: a count, not a sum over the classes)
        self.threads = torch.get_num_threads()  # torch's thread count, as the last eager call saw it

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
        if (torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") or x.device.type != "cpu"
                or any(t.dtype != torch.float32 for t in (x, weight) + (() if bias is None else (bias,)))
                or not 0 < rows <= FEW_ROWS):
            return F.linear(x, weight, bias)
        if self.order is not None:
            return ORDERS[self.order](x, weight, bias)
        # (torch.get_num_threads breaks a torch.compile graph: a compiled step reads the count eager calls last saw)
        if not torch.compiler.is_compiling():
            self.threads = torch.get_num_threads()
        key = (rows, *weight.shape, self.threads)
        chosen = self.chosen.get(key)
        if chosen is None:
            if torch.compiler.is_compiling():  # no timing inside a traced graph
                return F.linear(x, weight, bias)
            return self._trial(key, x, weight, bias)
        return ORDERS[chosen](x, weight, bias)

    def _trial(self, key: tuple, x, weight, bias) -> torch.Tensor:
        """One call of an undecided class: time the order with the fewest timings so far (with the weight as the
        forward left it), or every timing the class still needs if its weight outgrows the last-level cache; return
        the reference's product whatever was timed."""
        orders = [REFERENCE, "transposed"] + (["kernel"] if kernel() is not None else [])
        times = self.trials.setdefault(key, {order: [] for order in orders})
        cache = last_level_cache()
        streamed = 0 < cache < weight.numel() * weight.element_size()
        out = None
        for _ in range(sum(TRIALS - len(t) for t in times.values()) if streamed else 1):
            order = min(times, key=lambda o: len(times[o]))
            start = time.perf_counter()
            product = ORDERS[order](x, weight, bias)
            times[order].append(time.perf_counter() - start)
            self.timed += 1
            out = product if order == REFERENCE else out
        if out is None:
            out = F.linear(x, weight, bias)
        if all(len(t) == TRIALS for t in times.values()):
            medians = {o: statistics.median(t) for o, t in times.items()}
            best = min(medians, key=medians.get)
            self.chosen[key] = best if best == REFERENCE or medians[best] < MARGIN * medians[REFERENCE] else REFERENCE
            logger.debug("linear %s rows x %s: %s (medians of %d: %s)", key[0], tuple(key[1:3]), self.chosen[key],
                         TRIALS, ", ".join(f"{o} {1e6 * m:.1f} us" for o, m in medians.items()))
        return out

    def __deepcopy__(self, memo) -> Tuner:
        return self  # decisions describe the machine, not a model: a copied model (without_sidecars) shares them

    def timings(self) -> int:
        """Products timed so far: each a call of a class that was undecided then (a forward that adds none ran only
        decided orders)."""
        return self.timed

    def undecided(self) -> int:
        """Shape classes still being timed (their products run every order in turn: a forward costs more until
        then)."""
        return sum(key not in self.chosen for key in self.trials)

    def decisions(self) -> list[dict]:
        """Every shape class decided: rows, weight shape, threads, the order used, and each order's median (us)
        where it was timed here."""
        return [{"rows": key[0], "weight": list(key[1:3]), "threads": key[3], "order": chosen,
                 "us": {o: round(1e6 * statistics.median(t), 1) for o, t in self.trials.get(key, {}).items()}}
                for key, chosen in sorted(self.chosen.items())]

    def save(self, path: str | Path) -> None:
        """Write the decisions (JSON, replaced whole: a reader never sees half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        scratch.write_text(json.dumps({"machine": machine(), "decisions": self.decisions()}, indent=1) + "\n")
        scratch.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> Tuner:
        """A tuner that takes the decisions saved in `path` (classes it does not name are measured as usual)."""
        try:
            saved = json.loads(Path(path).read_text())
            made_on = saved["machine"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is not a file of r2lm.ops.linear decisions: {e}") from e
        if made_on != machine():  # first: another machine's orders (its kernel, say) need not exist here
            raise ValueError(f"{path} holds product-order decisions made on another machine, torch or kernel build "
                             f"({made_on}; this one is {machine()}): measure them here instead")
        try:
            decided = {(d["rows"], *d["weight"], d["threads"]): _order_named(d["order"]) for d in saved["decisions"]}
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is not a file of r2lm.ops.linear decisions: {e}") from e
        tuner = cls()
        tuner.chosen.update(decided)
        return tuner


class TunedLinear(nn.Linear):
    """An nn.Linear whose products go through `tuner` (same parameters, state dict and isinstance): what `install`
    turns a model's nn.Linear layers into."""

    tuner: Tuner

    def forward(self, x):
        return self.tuner(x, self.weight, self.bias)


def install(model: nn.Module, tuner: Tuner | None = None) -> Tuner:
    """Make every nn.Linear of `model` multiply through `tuner` (a new Tuner if None; one already installed is
    replaced), and return it: the same object the layers, their parameters and every reference to them keep.
    Modules that multiply by a weight they do not own as a layer say so by a `product` attribute, which takes the
    tuner too (r2lm.drafter.Drafter's head over its target's rows). Pass one tuner to a target and its drafter:
    they share decisions."""
    tuner = Tuner() if tuner is None else tuner
    for module in model.modules():
        if type(module) in (nn.Linear, TunedLinear):
            module.__class__ = TunedLinear  # a layer keeps its identity: hooks, tied weights, optimizer state
            module.tuner = tuner
        elif hasattr(module, "product"):
            module.product = tuner
    return tuner


def uninstall(model: nn.Module) -> None:
    """Back to plain PyTorch: every layer `install` changed is an nn.Linear again."""
    for module in model.modules():
        if type(module) is TunedLinear:
            del module.tuner
            module.__class__ = nn.Linear
        elif isinstance(getattr(module, "product", None), Tuner):
            module.product = F.linear


def tuner_of(model: nn.Module) -> Tuner | None:
    """The tuner installed on `model` (None: its products are F.linear's)."""
    return next((m.tuner for m in model.modules() if type(m) is TunedLinear), None)

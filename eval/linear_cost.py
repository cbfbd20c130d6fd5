"""What a decode step's matrix products cost on a CPU, in each order an r2lm.ops.linear tuner chooses among, and
which it chose: `torch.nn.functional.linear` (x @ W^T), the transposed order ((W @ x^T)^T), r2lm's few-row kernel
(where this machine has a build of it: python -m r2lm.ops.few_rows), and a tuner once it has measured each shape
class ("r2lm"), side by side in one run, for every row count a decode step multiplies by.

    python -m eval.linear_cost [--config CHECKPOINT] [--rows 1 2 3 4 6 8 12 16 24 32] [--repeats 7] [--threads 2]
        [--out docs/results]

The weights are those of one forward of an R2LM of SmolLM2-135M's shape (30 layers, hidden 576, MLP 1536, 9/3
heads of 64, vocab 49152; sidecars on its last 6 layers, as eval/parallel_bench's SmolLM2 models), or of the
R2LM checkpoint --config names: random, float32, all distinct tensors (about 590 MB for SmolLM2), so they stream
from memory as a real step's do rather than sit in a cache. Each input is contiguous. For each row count (the
tokens a forward reads, times the batch), the time of multiplying those rows by every weight: the median over
--repeats of passes interleaved between them. The tuner's passes start after the passes that decide its orders
(it measures each class at its first uses). Prints a table with the machine and the decisions,
writes linear_cost.json and linear_cost.png to --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from eval.machine import describe, label, linear_orders
from r2lm import R2LMConfig, R2LMForDiffusionLM
from r2lm.ops.few_rows import kernel
from r2lm.ops.linear import FEW_ROWS, Tuner, few_rows, transposed

REPO = Path(__file__).resolve().parents[1]

logger = logging.getLogger("eval.linear_cost")

SMOLLM2 = dict(vocab_size=49153, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, mask_token_id=49152, sidecar_layers=[24, 25, 26, 27, 28, 29])


def step_weights(config: R2LMConfig) -> list[torch.Tensor]:
    """Every linear weight one forward multiplies by (the LM head's is the tied embedding's shape)."""
    with torch.device("meta"):
        model = R2LMForDiffusionLM(config)
    return [torch.randn(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)]


@torch.no_grad()
def time_products(weights: list[torch.Tensor], rows: int, repeats: int, tuner: Tuner) -> dict:
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    shapes = {(rows, *w.shape) for w in weights}

    def decided():
        return {(d["rows"], *d["weight"]) for d in tuner.decisions() if d["threads"] == torch.get_num_threads()}

    for _ in range(100):  # r2lm's first passes measure both orders of each class, then it decides
        if rows > FEW_ROWS or shapes <= decided():
            break
        for w in weights:
            tuner(inputs[w.shape[1]], w)

    kinds = {"F.linear": F.linear, "transposed": transposed, **({"kernel": few_rows} if kernel() else {}),
             "r2lm": tuner}
    times = {k: [] for k in kinds}
    for _ in range(repeats + 1):  # the first pass warms up
        for name, fn in kinds.items():
            start = time.perf_counter()
            for w in weights:
                fn(inputs[w.shape[1]], w)
            times[name].append(time.perf_counter() - start)
    ms = {k: 1000 * statistics.median(v[1:]) for k, v in times.items()}
    return {"ms": ms, "speedup": ms["F.linear"] / ms["r2lm"]}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [int(r) for r in results["rows"]]
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for kind, style in (("F.linear", "o-"), ("transposed", "^--"), ("kernel", "v--"), ("r2lm", "s-")):
        if kind not in results["rows"][str(rows[0])]["ms"]:
            continue
        ax.plot(rows, [results["rows"][str(r)]["ms"][kind] for r in rows], style, label=kind)
    ax.axvline(results["few_rows"], color="#999", linestyle=":", label="FEW_ROWS (measured up to)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows (tokens per forward x batch)")
    ax.set_ylabel("ms per forward's products")
    ax.set_title(f"{results['model']}'s weights, {results['threads']} threads of {label(results.get('machine'))}",
                 fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, help="an R2LM checkpoint folder whose weight shapes to time "
                        "(default: SmolLM2-135M's)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 24, 32])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results", help="folder for the JSON and PNG")
    args = parser.parse_args(argv)
    if min(args.rows) < 1 or args.repeats < 1:
        parser.error("--rows and --repeats must be positive")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    config = R2LMConfig.from_pretrained(args.config) if args.config else R2LMConfig(**SMOLLM2)
    model = str(args.config) if args.config else "SmolLM2-135M"
    weights = step_weights(config)
    logger.info("%d weights, %.0f MB", len(weights), sum(w.numel() for w in weights) * 4 / 1e6)
    results = {"model": model, "machine": describe(), "threads": args.threads, "repeats": args.repeats,
               "few_rows": FEW_ROWS, "rows": {}}
    tuner = Tuner()
    for rows in args.rows:
        results["rows"][str(rows)] = time_products(weights, rows, args.repeats, tuner)
        logger.info("%d rows: %s", rows, results["rows"][str(rows)])
    results["orders"] = linear_orders(tuner)
    print(f"\none forward's matrix products, {model}'s weights, {args.threads} threads, {label(results['machine'])} "
          f"(r2lm measures both orders up to {FEW_ROWS} rows)")
    kinds = list(next(iter(results["rows"].values()))["ms"])
    print("".join(f"{'rows':>5}" if i < 0 else f"{k + ' ms':>15}" for i, k in enumerate(["", *kinds], -1)) +
          f"{'speedup':>9}  r2lm's orders")
    for rows, cell in results["rows"].items():
        orders = results["orders"].get(rows, {"F.linear": ["all"]})
        chosen = "; ".join(f"{order}: {', '.join(shapes)}" for order, shapes in orders.items() if shapes)
        print(f"{rows:>5}" + "".join(f"{cell['ms'][k]:>15.1f}" for k in kinds) + f"{cell['speedup']:>9.2f}  {chosen}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "linear_cost.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.out / "linear_cost.png")
    logger.info("wrote %s and %s", args.out / "linear_cost.json", args.out / "linear_cost.png")
    return results


if __name__ == "__main__":
    main()

"""Forward+backward throughput of one backbone with and without reverse Mamba sidecars (docs/design.md 1.1, 2.1).

Times a `block`-objective training step, `compute_loss("block", model, x0).loss.backward()`: the dual-stream layout
`[noisy windows ; clean stream]` with the sidecars running over every window. Both variants share the backbone
weights, the batch and the noise, so the only difference is the sidecar work. Issue target: sidecar overhead
<= 15% of step time at 1024 tokens.

    python -m eval.bench_forward                      # defaults: lengths 256 and 1024, a few minutes on 2 cores
    python -m eval.bench_forward --quick              # tiny smoke run (seconds)
    python -m eval.bench_forward --profile-sidecar    # plus a per-part timing of one sidecar (norm, in_proj, ...)

Steps run interleaved (base, sidecar, sidecar, base, ...) and each variant reports its median, so background load
(other jobs on the machine) hits both variants alike; compare the ratio, not absolute tokens/s, across runs.
Heavy load still skews the wall ratio (threads wait for descheduled peers after every op, and the sidecar adds
many small ops): results whose samples vary more than 1.25x are flagged, and on a busy machine the cpu-time
overhead of a `--threads 1` run is the robust number.
Writes results.json and throughput.png to --out.

    python -m eval.bench_forward --scaling [--threads 1]   # attention at length: sdpa vs flex, hybrid vs softmax

`--scaling` times the same block-objective step (fwd+bwd, batch 1) at seq_len 512 / 1024 / 2048 / 4096 (dual stream:
2L - block_size columns) on a tiny model whose cost is its attention (hidden 64, 3 layers, 4 heads / 2 KV heads,
sidecar on layer 1), for three variants: `sdpa` (R2LM, SDPA over the dense mask), `flex` (R2LM, attn_implementation
flex_attention: on CPU, SDPA over the BlockMask's packed tiles) and `hybrid` (R2LM with every layer block-hybrid:
the chunked, linear-time form). Each (variant, length) runs in its own subprocess; its peak memory is that process's
max RSS (resource.getrusage) minus its RSS after the model is built and a short warm-up step has run, so it counts
everything the step allocates (torch's CPU allocator returns memory to malloc, which tracemalloc does not see).
Issue targets (CPU): flex >= 2x faster than sdpa at 2048 with <= 1/4 of its peak memory; hybrid <= 1.2x the
all-softmax model (flex) at 2048; hybrid time and memory grow <= 5x from 1024 to 4096. On a shared machine the
figures are indicative: compare the ratios, and prefer the cpu-time columns of a --threads 1 run.
Writes scaling.json and scaling.png to --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
from pathlib import Path

import torch

from eval.common import git_state
from eval.forward_overhead import (
    DEFAULT_MODEL,
    NOISY_SPREAD,
    QUICK_MODEL,
    TARGET_PCT,
    VARIANTS,
    bench_length,
    build_models,
    profile_sidecar,
)
from eval.forward_report import plot, report, scaling_plot, scaling_table, scaling_verdicts
from eval.forward_scaling import SCALING_MODEL, SCALING_TARGETS, SCALING_VARIANTS, run_scaling, scaling_worker

logger = logging.getLogger("bench_forward")


def run_meta(threads: int, load_start: tuple) -> dict:
    """Where and on what the figures were measured: versions, threads, the commit, the machine's load."""
    return {"torch": torch.__version__, "threads": threads, "cpus": os.cpu_count(), "platform": platform.platform(),
            "git": git_state(), "loadavg_start": load_start, "loadavg_end": os.getloadavg()}


def scaling_main(args) -> dict:
    load_start = os.getloadavg()
    summary = run_scaling(args)
    summary["meta"] = {**run_meta(args.threads or torch.get_num_threads(), load_start), "model": SCALING_MODEL,
                       "variants": {k: {"attn_implementation": a, "all_hybrid": h} for k, (a, h) in SCALING_VARIANTS.items()},
                       "memory": "max RSS of a subprocess per configuration minus its RSS after build + warm-up step",
                       "targets": SCALING_TARGETS}
    summary["verdicts"] = scaling_verdicts(summary)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scaling.json").write_text(json.dumps(summary, indent=2))
    scaling_plot(summary, args.out / "scaling.png")
    print(scaling_table(summary))
    print("\n".join(summary["verdicts"]))
    print(f"\nwrote {args.out / 'scaling.json'} and {args.out / 'scaling.png'} "
          f"(load average {load_start[0]:.1f} -> {os.getloadavg()[0]:.1f})")
    return summary


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="sequence lengths of x0 (default 256 1024)")
    p.add_argument(
        "--batch",
        type=int,
        nargs="+",
        default=None,
        help="batch size per length, or one for all (default 4 for 256, 2 for 1024)",
    )
    p.add_argument("--reps", type=int, default=None, help="timed steps per variant and length (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant and length")
    p.add_argument(
        "--sidecar-layers",
        type=int,
        nargs="+",
        default=None,
        help="layers with a sidecar (default every 4th layer from 1: a quarter of the layers)",
    )
    p.add_argument(
        "--gate", type=float, default=0.5, help="value of each sidecar gate (opened so nothing short-circuits)"
    )
    p.add_argument(
        "--causal",
        action="store_true",
        help="also time a clean causal forward+backward (the 'ar' loss; no windows, so no sidecar work)",
    )
    p.add_argument(
        "--profile-sidecar",
        action="store_true",
        help="also time each part of one sidecar (norm, in_proj, conv, SSD scan, gated norm, out_proj)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny model, L=128, 2 reps: a smoke run in seconds")
    p.add_argument("--scaling", action="store_true", help="attention at length: sdpa vs flex, all-hybrid vs softmax")
    p.add_argument("--worker", nargs=2, metavar=("VARIANT", "SEQ_LEN"), help=argparse.SUPPRESS)
    p.add_argument(
        "--out", type=Path, default=Path("runs/bench_forward"), help="folder for results.json and throughput.png"
    )
    args = p.parse_args(argv)
    if args.scaling or args.worker:
        args.lengths = args.lengths or ([256, 512] if args.quick else [512, 1024, 2048, 4096])
        args.reps = args.reps or (1 if args.quick else 3)
        return args
    args.lengths = args.lengths or ([128] if args.quick else [256, 1024])
    if args.batch is None:
        args.batch = [2 if args.quick else (4 if n <= 256 else 2) for n in args.lengths]
    elif len(args.batch) == 1:
        args.batch = args.batch * len(args.lengths)
    if len(args.batch) != len(args.lengths):
        p.error(f"--batch takes one value or one per length ({len(args.lengths)})")
    args.reps = args.reps or (2 if args.quick else 5)
    return args


def main(argv=None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        print(json.dumps(scaling_worker(args.worker[0], int(args.worker[1]), args.reps, args.seed)))
        return {}
    if args.scaling:
        return scaling_main(args)
    from tqdm import tqdm

    fields = QUICK_MODEL if args.quick else DEFAULT_MODEL
    n_layers = fields["num_hidden_layers"]
    sidecar_layers = args.sidecar_layers or list(range(1, n_layers, 4))
    models = build_models(fields, sidecar_layers, args.gate, args.seed)
    n_base, n_side = (sum(p.numel() for p in models[v].parameters()) for v in VARIANTS)
    param_pct = 100 * (n_side / n_base - 1)
    logger.info(
        "backbone %.1fM params; sidecars on layers %s add %.2f%% params; %d torch threads, %s CPUs",
        n_base / 1e6,
        sidecar_layers,
        param_pct,
        torch.get_num_threads(),
        os.cpu_count(),
    )

    objectives = ["block"] + (["ar"] if args.causal else [])
    load_start = os.getloadavg()
    results = []
    with tqdm(total=len(objectives) * len(args.lengths) * 2 * args.reps, desc="timed steps", unit="step") as bar:
        for objective in objectives:
            for seq_len, batch in zip(args.lengths, args.batch, strict=True):
                bar.set_postfix_str(f"{objective} L={seq_len}")
                r = bench_length(models, objective, seq_len, batch, args.warmup, args.reps, args.seed, bar)
                logger.info(
                    "%s L=%d: base %.0f tok/s, sidecar %.0f tok/s, overhead %+.1f%% (cpu time %+.1f%%)",
                    objective,
                    seq_len,
                    r["variants"]["base"]["tokens_per_s"],
                    r["variants"]["sidecar"]["tokens_per_s"],
                    r["overhead_pct"],
                    r["cpu_overhead_pct"],
                )
                if r["spread"] > NOISY_SPREAD:
                    logger.warning(
                        "L=%d: step times vary %.1fx between samples (background load, load average %.1f): "
                        "trust the cpu-time overhead of a --threads 1 run over this wall ratio",
                        seq_len,
                        r["spread"],
                        os.getloadavg()[0],
                    )
                results.append(r)
    summary = {
        "meta": {
            **run_meta(torch.get_num_threads(), load_start),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        },
        "model": {
            "config": dict(fields, mask_token_id=fields["vocab_size"] - 1),
            "sidecar_layers": sidecar_layers,
            "sidecar_config": {k: v for k, v in models["sidecar"].config.to_dict().items() if k.startswith("sidecar_")},
            "gate": args.gate,
            "params_base": n_base,
            "params_sidecar": n_side,
            "param_overhead_pct": param_pct,
        },
        "target_overhead_pct": TARGET_PCT,
        "results": results,
    }
    at_1024 = [r for r in results if r["objective"] == "block" and r["seq_len"] == 1024]
    if at_1024:
        summary["meets_target"] = at_1024[0]["overhead_pct"] <= TARGET_PCT

    if args.profile_sidecar:
        seq_len, batch = args.lengths[-1], args.batch[-1]
        logger.info("profiling one sidecar at L=%d, batch %d", seq_len, batch)
        prof = profile_sidecar(models["sidecar"], seq_len, batch, max(args.reps, 3), args.seed)
        summary["sidecar_profile"] = prof

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(summary, indent=2))
    plot(summary, args.out / "throughput.png")
    print(report(summary))
    print(
        f"\nwrote {args.out / 'results.json'} and {args.out / 'throughput.png'} "
        f"(load average {load_start[0]:.1f} -> {os.getloadavg()[0]:.1f})"
    )
    return summary


if __name__ == "__main__":
    main()

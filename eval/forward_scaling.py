"""Attention at length, measured (`python -m eval.bench_forward --scaling`; its --help names the variants and the
issue's targets): the block-objective training step of a tiny model whose cost is its attention, at each length
and in each variant (SDPA over the dense mask, flex attention, every layer block-hybrid), each (variant, length)
in a subprocess of its own so that its peak memory is its own. eval/forward_report.py renders the figures."""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys

import torch

from eval.common import REPO
from eval.forward_overhead import step
from r2lm.configuration_r2lm import R2LMConfig
from r2lm.modeling_r2lm import R2LMForDiffusionLM

logger = logging.getLogger(__name__)

# --scaling: a model whose cost is its attention (the tiny all-hybrid setting), batch 1
SCALING_MODEL = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    block_size=32,
    max_position_embeddings=8192,
    sidecar_d_state=16,
    sidecar_headdim=16,
    hybrid_feature_dim=16,
)
SCALING_VARIANTS = {  # name: (attn_implementation, every layer block-hybrid)
    "sdpa": ("sdpa", False),
    "flex": ("flex_attention", False),
    "hybrid": ("sdpa", True),
}
SCALING_TARGETS = dict(flex_speedup_2048=2.0, flex_memory_ratio_2048=0.25, hybrid_vs_softmax_2048=1.2, hybrid_growth=5.0)


def scaling_model(variant: str, seed: int):
    """The R2LM of --scaling (sidecar on layer 1, gate open) as `variant` runs it."""
    implementation, hybrid = SCALING_VARIANTS[variant]
    fields = dict(SCALING_MODEL, mask_token_id=SCALING_MODEL["vocab_size"] - 1, sidecar_layers=[1])
    if hybrid:
        fields["hybrid_layers"] = list(range(fields["num_hidden_layers"]))
    torch.manual_seed(seed)
    model = R2LMForDiffusionLM._from_config(R2LMConfig(**fields), attn_implementation=implementation).train()
    with torch.no_grad():
        model.model.layers[1].sidecar.gate.fill_(0.5)
    return model


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def scaling_worker(variant: str, seq_len: int, reps: int, seed: int) -> dict:
    """One (variant, length) in this process: median step times and the peak memory above the warmed-up baseline."""
    import resource

    model = scaling_model(variant, seed)
    vocab = model.config.vocab_size
    warm = torch.randint(0, vocab - 1, (1, 4 * model.config.block_size), generator=torch.Generator().manual_seed(seed))
    step(model, warm, "block", seed)  # first-call costs (thread pools, kernels) out of the baseline
    model.zero_grad(set_to_none=True)
    baseline = _rss_mb()
    x0 = torch.randint(0, vocab - 1, (1, seq_len), generator=torch.Generator().manual_seed(seed))
    walls, cpus = [], []
    for _ in range(reps + 1):  # the first step is not timed (it sizes the allocator for this length)
        wall, cpu, loss = step(model, x0, "block", seed)
        walls.append(wall)
        cpus.append(cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
    return {"variant": variant, "seq_len": seq_len, "columns": 2 * seq_len - model.config.block_size,
            "median_step_s": statistics.median(walls[1:]), "median_cpu_s": statistics.median(cpus[1:]),
            "wall_s": walls[1:], "peak_mb": peak - baseline, "baseline_mb": baseline, "loss": loss}


def run_scaling(args) -> dict:
    import subprocess

    results = []
    for seq_len in args.lengths:
        for variant in SCALING_VARIANTS:
            cmd = [sys.executable, "-m", "eval.bench_forward", "--worker", variant, str(seq_len), "--reps",
                   str(args.reps), "--seed", str(args.seed)] + (["--threads", str(args.threads)] if args.threads else [])
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
            if out.returncode:
                raise RuntimeError(f"{variant} at L={seq_len} failed:\n{out.stderr[-3000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            logger.info("L=%d %s: %.2f s (cpu %.2f s), peak +%.0f MB", seq_len, variant, r["median_step_s"],
                        r["median_cpu_s"], r["peak_mb"])
            results.append(r)
    return {"results": results, "ratios": scaling_ratios(results)}


def scaling_ratios(results: list[dict]) -> dict:
    """Per length: flex against sdpa (time, cpu time, memory) and hybrid against the all-softmax model (flex)."""
    by = {(r["variant"], r["seq_len"]): r for r in results}
    out = {}
    for seq_len in sorted({r["seq_len"] for r in results}):
        sdpa, flex, hybrid = (by[(v, seq_len)] for v in SCALING_VARIANTS)
        out[seq_len] = {
            "flex_speedup": sdpa["median_step_s"] / flex["median_step_s"],
            "flex_cpu_speedup": sdpa["median_cpu_s"] / flex["median_cpu_s"],
            "flex_memory_ratio": flex["peak_mb"] / sdpa["peak_mb"],
            "hybrid_vs_softmax": hybrid["median_step_s"] / flex["median_step_s"],
            "hybrid_vs_softmax_cpu": hybrid["median_cpu_s"] / flex["median_cpu_s"],
        }
    lengths = sorted(out)
    if 1024 in lengths and 4096 in lengths:
        h1, h4 = by[("hybrid", 1024)], by[("hybrid", 4096)]
        out["hybrid_growth_1024_4096"] = {"time": h4["median_step_s"] / h1["median_step_s"],
                                          "cpu_time": h4["median_cpu_s"] / h1["median_cpu_s"],
                                          "memory": h4["peak_mb"] / h1["peak_mb"]}
    return out


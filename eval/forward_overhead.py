"""What reverse Mamba sidecars add to a training step, measured (docs/design.md 1.1, 2.1): one backbone with and
without sidecars, sharing weights, batch and noise, timed step by step in ABBA order; and one sidecar timed part by
part. `python -m eval.bench_forward` runs it (its --help says how to read the figures); eval/forward_report.py
renders the figures.

`step`, one training step minus the optimiser, is also what eval/forward_scaling.py times at length."""

from __future__ import annotations

import statistics
import time

import torch

from r2lm.configuration_r2lm import R2LMConfig
from r2lm.diffusion import compute_loss
from r2lm.modeling_r2lm import R2LMForDiffusionLM

TARGET_PCT = 15.0  # from the issue: sidecar overhead at most 15% of step time at 1024
VARIANTS = ("base", "sidecar")
NOISY_SPREAD = 1.25  # slowest / fastest step of one variant beyond which a result is flagged as noisy

# A Qwen3-style backbone of ~32M parameters: small enough for 1024-token training steps on a CPU.
DEFAULT_MODEL = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    qk_norm=True,
    block_size=32,
    max_position_embeddings=4096,
)
QUICK_MODEL = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    qk_norm=True,
    block_size=32,
    max_position_embeddings=4096,
)


def build_models(fields: dict, sidecar_layers: list[int], gate: float, seed: int):
    """The backbone, and the same backbone (loaded weights) with sidecars whose gates are open."""
    fields = dict(fields, mask_token_id=fields["vocab_size"] - 1)
    torch.manual_seed(seed)
    base = R2LMForDiffusionLM(R2LMConfig(**fields)).train()
    torch.manual_seed(seed + 1)
    side = R2LMForDiffusionLM(R2LMConfig(**fields, sidecar_layers=sidecar_layers)).train()
    missing, unexpected = side.load_state_dict(base.state_dict(), strict=False)
    if unexpected or any(".sidecar." not in k for k in missing):
        raise RuntimeError(f"backbone weights did not transfer: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():  # a zero gate would still run the scan, but open it so nothing is optimised away
        for layer in side.model.layers:
            if layer.sidecar is not None:
                layer.sidecar.gate.fill_(gate)
    return {"base": base, "sidecar": side}


def step(model, x0: torch.Tensor, objective: str, seed: int):
    """One training step minus the optimiser: loss forward + backward. Returns (wall s, process CPU s, loss)."""
    model.zero_grad(set_to_none=True)
    generator = torch.Generator().manual_seed(seed)  # same masks for both variants
    wall, cpu = time.perf_counter(), time.process_time()
    loss = compute_loss(objective, model, x0, generator=generator).loss
    loss.backward()
    return time.perf_counter() - wall, time.process_time() - cpu, loss.item()


def bench_length(models, objective: str, seq_len: int, batch: int, warmup: int, reps: int, seed: int, progress):
    vocab = models["base"].config.vocab_size
    x0 = torch.randint(0, vocab - 1, (batch, seq_len), generator=torch.Generator().manual_seed(seed))  # no [MASK]
    for _ in range(warmup):  # allocator and oneDNN primitive caches for these shapes
        for name in VARIANTS:
            step(models[name], x0, objective, seed)
    samples = {name: {"wall_s": [], "cpu_s": [], "loss": None} for name in VARIANTS}
    for rep in range(reps):
        # ABBA order: a load change that drifts linearly over time lands on both variants equally.
        for name in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
            wall, cpu, loss = step(models[name], x0, objective, seed)
            samples[name]["wall_s"].append(wall)
            samples[name]["cpu_s"].append(cpu)
            samples[name]["loss"] = loss
            progress.update(1)
    tokens = batch * seq_len
    out = {"objective": objective, "seq_len": seq_len, "batch": batch, "tokens": tokens, "variants": {}}
    for name, s in samples.items():
        med = statistics.median(s["wall_s"])
        out["variants"][name] = dict(
            median_step_s=med, tokens_per_s=tokens / med, median_cpu_s=statistics.median(s["cpu_s"]), **s
        )
    v = out["variants"]
    out["overhead_pct"] = 100 * (v["sidecar"]["median_step_s"] / v["base"]["median_step_s"] - 1)
    # CPU time of this process barely moves with other jobs' load at one thread (with more, threads that wait
    # for a descheduled peer spin and bill it): a cross-check on the wall-clock ratio.
    out["cpu_overhead_pct"] = 100 * (v["sidecar"]["median_cpu_s"] / v["base"]["median_cpu_s"] - 1)
    # Slowest / fastest sample: above ~1.25 the machine was shared and the wall ratio is not to be trusted.
    out["spread"] = max(max(s["wall_s"]) / min(s["wall_s"]) for s in samples.values())
    return out


def _timed(fn, reps: int) -> float:
    """Median wall ms of fn() (forward + backward of one part)."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def profile_sidecar(side_model, seq_len: int, batch: int, reps: int, seed: int) -> dict:
    """Forward+backward ms of each part of one sidecar on the block objective's window batch, parts in isolation.

    Shapes are those of a real step: every window of every row scanned as one [batch * windows, window, d] batch."""
    from r2lm.layout import dual_stream
    from r2lm.ops import causal_conv1d, ssd_scan

    cfg = side_model.config
    layer = next(layer for layer in side_model.model.layers if layer.sidecar is not None)
    sc, mx = layer.sidecar, layer.sidecar.mixer
    x0 = torch.zeros(batch, seq_len, dtype=torch.long)
    inputs, layout, _ = dual_stream(x0, x0, cfg.block_size, cfg.prediction)
    windows = layout.windows
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, inputs.shape[1], cfg.hidden_size, generator=g)
    n, lw = batch * windows.shape[0], windows.shape[1]

    def leaf(t):
        return t.detach().clone().requires_grad_(True)

    # Realistic intermediate values, each part then timed on its own leaf inputs.
    with torch.no_grad():
        u = h[:, windows.clamp(min=0)].reshape(n, lw, -1)
        un = sc.norm(u)
        z, xbc, dt = mx.in_proj(un).split([mx.d_inner, mx.conv_dim, mx.nheads], dim=-1)
        xbc = causal_conv1d(xbc, mx.conv1d.weight.squeeze(1), mx.conv1d.bias, activation="silu", reverse=True)
        x, B, C = xbc.split([mx.d_inner, mx.ngroups * mx.d_state, mx.ngroups * mx.d_state], dim=-1)

    def ssd():
        xs, dts, Bs, Cs = leaf(x.view(n, lw, mx.nheads, mx.headdim)), leaf(dt), leaf(B), leaf(C)
        shape = (n, lw, mx.ngroups, mx.d_state)
        return lambda: (
            ssd_scan(
                xs,
                dts,
                -torch.exp(mx.A_log.float()),
                Bs.view(shape),
                Cs.view(shape),
                mx.chunk_size,
                D=mx.D,
                dt_bias=mx.dt_bias,
                reverse=True,
            )
            .sum()
            .backward()
        )

    yv = torch.randn(n, lw, mx.d_inner, generator=g)
    hl, ul, unl, xbcl, yl, zl = leaf(h), leaf(u), leaf(un), leaf(xbc), leaf(yv), leaf(z)
    parts = {
        "norm (RMSNorm)": lambda: sc.norm(ul).sum().backward(),
        "in_proj": lambda: mx.in_proj(unl).sum().backward(),
        "conv1d+silu": lambda: (
            causal_conv1d(xbcl, mx.conv1d.weight.squeeze(1), mx.conv1d.bias, "silu", reverse=True).sum().backward()
        ),
        f"ssd scan (chunk_size {mx.chunk_size}, window {lw})": ssd(),
        "gated RMSNorm": lambda: mx.norm(yl, zl).sum().backward(),
        "out_proj": lambda: mx.out_proj(yl).sum().backward(),
    }
    ms = {k: _timed(fn, reps) for k, fn in parts.items()}
    whole = _timed(lambda: sc(hl, windows).sum().backward(), reps)
    ms["gather+index_add (whole sidecar minus parts)"] = whole - sum(ms.values())
    return {
        "seq_len": seq_len,
        "batch": batch,
        "window_batch": n,
        "window_len": lw,
        "whole_sidecar_ms": whole,
        "parts_ms": ms,
        "sidecars_per_model": len(cfg.sidecar_layers),
    }

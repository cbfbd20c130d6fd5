"""Decode throughput and cache memory: block-hybrid (a third of the layers) vs all-softmax, by context length.

    python -m eval.hybrid_bench [--contexts 512 2048 8192] [--out runs/hybrid_bench]

The same backbone weights twice: as is, and with every third layer swapped to block-hybrid attention (as
`python -m convert to-hybrid` does). Both run the decode loop of generate() (denoise steps against the cache,
one commit per block) after an untimed prefill, with a fixed unmasking schedule (`tokens_per_step`), so both
take the same steps and the comparison is pure speed. Speed needs no training; quality does (attention transfer).

Cache memory per request is what the cache allocates: keys and values of the softmax layers for the whole
context, and the fixed-size (S, Z) state of the hybrid layers. Prints a table, writes results.json and a PNG.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from r2lm import R2LMConfig, R2LMForDiffusionLM

logger = logging.getLogger("eval.hybrid_bench")


def build_models(args) -> dict[str, R2LMForDiffusionLM]:
    fields = dict(
        vocab_size=4096, hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256), head_dim=64,
        qk_norm=True, max_position_embeddings=max(args.contexts) + args.new_tokens + 1, attention="block_causal",
        prediction="inplace", mask_token_id=4095, block_size=args.block_size,
    )
    torch.manual_seed(0)
    softmax = R2LMForDiffusionLM(R2LMConfig(**fields)).eval()
    hybrid_layers = list(range(0, args.layers, 3))
    hybrid = R2LMForDiffusionLM(R2LMConfig(**fields, hybrid_layers=hybrid_layers, hybrid_feature_dim=args.feature_dim)).eval()
    hybrid.load_state_dict(softmax.state_dict(), strict=False)  # same backbone; the feature maps are new
    return {"softmax": softmax, "hybrid": hybrid}


@torch.no_grad()
def decode(model, prompts, args) -> tuple[float, object]:
    """Prefill (untimed), then the decode loop generate() runs, timed: per block, block_size / tokens_per_step
    denoise steps that each unmask the `tokens_per_step` leftmost masks with the argmax, then one commit."""
    batch, mask_id, b, k = prompts.shape[0], model.config.mask_token_id, args.block_size, args.tokens_per_step
    cache = model.new_cache(batch, prompts.shape[1] + args.new_tokens)
    model.prefill(prompts, cache)
    start = time.perf_counter()
    for _ in range(args.new_tokens // b):
        block = torch.full((batch, b), mask_id)
        for j in range(0, b, k):
            logits = model.denoise(block, cache)
            block[:, j : j + k] = logits[:, j : j + k].argmax(-1)
        model.commit(block, cache)
    return time.perf_counter() - start, cache


def measure(model, prompts, args) -> dict:
    runs = [decode(model, prompts, args) for _ in range(args.repeats)]
    seconds = sorted(r[0] for r in runs)[len(runs) // 2]
    cache, batch = runs[-1][1], prompts.shape[0]
    per_request = sum(cache.layer_bytes(i) for i in range(model.config.num_hidden_layers)) / batch
    hybrid_bytes = sum(cache.layer_bytes(i) for i in model.config.hybrid_layers) / batch
    return {"seconds": seconds, "tokens_per_s": batch * (args.new_tokens // args.block_size) * args.block_size / seconds,
            "cache_mib_per_request": per_request / 2**20, "hybrid_layer_mib_per_request": hybrid_bytes / 2**20}


def plot(results, path: Path, contexts) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, memory) = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("softmax", "hybrid"):
        rows = [next(r for r in results if r["variant"] == name and r["context"] == c) for c in contexts]
        speed.plot(contexts, [r["tokens_per_s"] for r in rows], marker="o", label=name)
        memory.plot(contexts, [r["cache_mib_per_request"] for r in rows], marker="o", label=f"{name}: whole cache")
    hybrid_rows = [next(r for r in results if r["variant"] == "hybrid" and r["context"] == c) for c in contexts]
    memory.plot(contexts, [r["hybrid_layer_mib_per_request"] for r in hybrid_rows], marker="x", ls="--",
                label="hybrid layers' state")
    speed.set(title="decode throughput", xlabel="context tokens", ylabel="tokens / s", xscale="log")
    memory.set(title="cache memory per request", xlabel="context tokens", ylabel="MiB", xscale="log")
    for ax in (speed, memory):
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--tokens-per-step", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--feature-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/hybrid_bench"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)

    models = build_models(args)
    g = torch.Generator().manual_seed(0)
    warm = argparse.Namespace(**{**vars(args), "new_tokens": args.block_size, "repeats": 1})
    for model in models.values():  # first-call costs out of the measurements
        measure(model, torch.randint(0, 4000, (1, 16), generator=g), warm)
    results = []
    for context in tqdm(args.contexts, desc="contexts"):
        prompts = torch.randint(0, 4000, (args.batch, context), generator=g)
        for name, model in models.items():
            results.append({"variant": name, "context": context, **measure(model, prompts, args)})

    print(f"\n{'context':>7} {'variant':>8} {'tok/s':>8} {'cache MiB/req':>14} {'hybrid-layer MiB/req':>21} {'speedup':>8}")
    for r in results:
        base = next(x for x in results if x["variant"] == "softmax" and x["context"] == r["context"])
        r["speedup_vs_softmax"] = r["tokens_per_s"] / base["tokens_per_s"]
        print(f"{r['context']:>7} {r['variant']:>8} {r['tokens_per_s']:>8.1f} {r['cache_mib_per_request']:>14.2f} "
              f"{r['hybrid_layer_mib_per_request']:>21.3f} {r['speedup_vs_softmax']:>8.2f}")
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    settings["hybrid_layers"] = models["hybrid"].config.hybrid_layers
    (args.out / "results.json").write_text(json.dumps({"settings": settings, "results": results}, indent=2))
    plot(results, args.out / "hybrid_bench.png", args.contexts)
    print(f"\nwrote {args.out / 'results.json'} and {args.out / 'hybrid_bench.png'}")


if __name__ == "__main__":
    main()

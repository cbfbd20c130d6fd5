"""Decoding throughput: AR vs bidirectional dLLM (no cache, approximate dual cache) vs R2LM (exact cache).

    python -m eval.throughput --model R2LM_CKPT [--ar AR_CKPT] [--bidirectional BIDIR_CKPT] [--causal CKPT] [--out DIR]

One run, the same prompts (real held-out text) for every variant, at every batch size x prompt length (and, for
the diffusion variants, accepted and oracle tokens per step at each --diagnostic-thresholds value: see
r2lm.generation.ParallelismMeter):

    ar        block size 1 with the KV cache: one forward per token
    bidir     bidirectional attention, no cache: the whole canvas every step (LLaDA)
    bidir+dc  bidirectional, Fast-dLLM's approximate dual cache
    r2lm      the R2LM checkpoint, exact KV cache, threshold decoding
    causal    (with --causal) a causal dLLM without sidecars, exact KV cache

Without --ar the AR variant is the R2LM's backbone (sidecars removed); without --bidirectional the bidirectional
variants reuse that backbone with attention switched to bidirectional: their speed per step is right, their
tokens per step are not those of a trained bidirectional dLLM. Parallel decoding only means something on
trained models; give trained checkpoints.

Each generation is set up for --new-tokens (the canvas a bidirectional model re-encodes is prompt + new tokens)
and timed from the call to the moment --measure-tokens tokens per row are committed (prefill included), then
ended by a stopping criterion: the no-cache baseline at batch 32 x 2048 would otherwise take hours on a CPU. tokens/s counts the
committed tokens of all rows. Prints a table, writes results.json and throughput.png to --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer, MaxLengthCriteria

from r2lm import R2LMForDiffusionLM, generate
from r2lm.convert.to_hf import without_sidecars
from r2lm.generation import ParallelismMeter
from r2lm.ops.linear import Tuner, install

logger = logging.getLogger("eval.throughput")
VARIANTS = ("ar", "bidir", "bidir+dc", "r2lm", "causal")


TUNER = Tuner()  # r2lm.ops.linear's product orders: one set of decisions for every model this benchmark loads


def load(path: str) -> R2LMForDiffusionLM:
    model = R2LMForDiffusionLM.from_pretrained(path).eval()
    install(model, TUNER)
    return model


def load_variants(args) -> dict:
    r2lm = load(args.model)
    if args.ar:
        ar = load(args.ar)
    else:
        ar = without_sidecars(r2lm)
    if args.bidirectional:
        bidir = load(args.bidirectional)
    else:
        bidir = copy.deepcopy(ar)
        bidir.config.attention = "bidirectional"
    models = {"ar": ar, "bidir": bidir, "bidir+dc": bidir, "r2lm": r2lm}
    if args.causal:
        models["causal"] = load(args.causal)
    return models


def variant_options(name: str, args) -> dict:
    if name == "ar":
        return dict(block_size=1)
    options = dict(block_size=args.block_size, threshold=args.threshold)
    if name == "bidir+dc":
        options["approximate_cache"] = "dual"
    return options


def read_text(path: Path) -> str:
    """A text file, or the "text" fields of a .jsonl file, as one string."""
    if path.suffix == ".jsonl":
        return "\n\n".join(json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines())
    return path.read_text(encoding="utf-8")


def make_prompts(tokenizer, text_file: Path, batch: int, length: int) -> torch.Tensor:
    """`batch` prompts of exactly `length` tokens, cut from consecutive stretches of real text."""
    ids = tokenizer(read_text(text_file), return_tensors="pt").input_ids[0]
    need = batch * length
    if ids.numel() < need:
        ids = ids.repeat(need // ids.numel() + 1)
    return ids[:need].view(batch, length)


def run_one(model, prompts, args, options: dict) -> dict:
    """Median over --repeats of the time to commit --measure-tokens tokens per row (prefill included): the
    generation is set up for --new-tokens and ended by a stopping criterion once every row holds --measure-tokens
    committed tokens (checked after each block, so the span is a whole number of blocks), with the forwards (nfe,
    prefill included) and denoising steps that took."""
    stop = MaxLengthCriteria(prompts.shape[1] + args.measure_tokens)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        out = generate(model, prompts, max_new_tokens=args.new_tokens, eos_token_id=[], stopping_criteria=[stop],
                       **options)
        times.append(time.perf_counter() - start)
    committed = out.new_tokens // prompts.shape[0]
    seconds = sorted(times)[len(times) // 2]
    row = {"seconds": seconds, "tokens_per_s": prompts.shape[0] * committed / seconds, "measured_tokens": committed,
           "nfe": out.nfe, "steps": out.steps, "tokens_per_step": out.tokens_per_step, "tpf": {}}
    if "threshold" in options:  # untimed: accepted and oracle tokens per step at each diagnostic threshold
        for threshold in args.diagnostic_thresholds:
            meter = ParallelismMeter()
            diag = generate(model, prompts, max_new_tokens=args.new_tokens, eos_token_id=[], stopping_criteria=[stop],
                            step_callback=meter, **{**options, "threshold": threshold})
            row["tpf"][f"{threshold:g}"] = meter.summary(diag.sequences[:, prompts.shape[1] :])
    return row


def plot(results: list[dict], path: Path, batches, lengths) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    present = [v for v in VARIANTS if any(r["variant"] == v for r in results)]
    for ax, batch in zip(axes[0], batches, strict=True):
        for name in present:
            ys = [next((r["tokens_per_s"] for r in results if r["variant"] == name and r["batch"] == batch
                        and r["prompt"] == length), float("nan")) for length in lengths]
            ax.plot(lengths, ys, marker="o", label=name)
        ax.set(title=f"batch {batch}", xlabel="prompt tokens", ylabel="generated tokens / s", xscale="log", yscale="log")
        ax.set_xticks(lengths, [str(x) for x in lengths])
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="trained R2LM checkpoint (model + tokenizer)")
    parser.add_argument("--ar", help="trained AR checkpoint of the same backbone (default: the R2LM's backbone)")
    parser.add_argument("--bidirectional", help="trained bidirectional checkpoint of the same backbone")
    parser.add_argument("--causal", help="trained causal dLLM checkpoint (no sidecars): an extra variant")
    parser.add_argument("--text", type=Path, default=Path("runs/quickstart/corpus/heldout.txt"), help="prompt text")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--new-tokens", type=int, default=256, help="generation length each request is set up for")
    parser.add_argument("--measure-tokens", type=int, default=32, help="committed tokens per row to time")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--threshold", type=float, default=0.9, help="confidence threshold of the timed runs")
    parser.add_argument("--diagnostic-thresholds", type=float, nargs="*", default=[0.5, 0.7, 0.9],
                        help="thresholds at which accepted and oracle tokens per step are measured (untimed)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per cell (median), after one warmup")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, help="default: all available")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=Path("runs/throughput"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    models = load_variants(args)
    args.variants = args.variants or [v for v in VARIANTS if v in models]
    warm = make_prompts(tokenizer, args.text, 1, 16)
    for name in args.variants:  # first-call costs (allocator, kernels) out of the measurements
        generate(models[name], warm, max_new_tokens=8, eos_token_id=[], **variant_options(name, args))

    cells = [(b, p, v) for b in args.batch_sizes for p in args.prompt_lengths for v in args.variants]
    results = []
    for batch, length, name in tqdm(cells, desc="throughput"):
        prompts = make_prompts(tokenizer, args.text, batch, length)
        row = run_one(models[name], prompts, args, variant_options(name, args))
        results.append({"variant": name, "batch": batch, "prompt": length, **row})
        logger.info("%s batch %d prompt %d: %.1f tokens/s", name, batch, length, row["tokens_per_s"])

    def speed(name, batch, length):
        return next(r["tokens_per_s"] for r in results if (r["variant"], r["batch"], r["prompt"]) == (name, batch, length))

    print(f"\nover the first {args.measure_tokens} committed tokens per row (nfe: forwards, prefill included)")
    print(f"{'batch':>5} {'prompt':>6} {'variant':>9} {'tok/s':>9} {'nfe':>6} {'tok/step':>8} {'x bidir':>8} {'x ar':>6}")
    for r in results:
        vs = {other: r["tokens_per_s"] / speed(other, r["batch"], r["prompt"]) if other in args.variants else float("nan")
              for other in ("bidir", "ar")}
        r["speedup_vs_bidir"], r["speedup_vs_ar"] = vs["bidir"], vs["ar"]
        print(f"{r['batch']:>5} {r['prompt']:>6} {r['variant']:>9} {r['tokens_per_s']:>9.1f} {r['nfe']:>6} "
              f"{r['tokens_per_step']:>8.2f} {vs['bidir']:>8.2f} {vs['ar']:>6.2f}")
    if args.diagnostic_thresholds:
        print("\naccepted / oracle tokens per step (oracle: proposals already equal to the final token) by threshold")
        print(f"{'batch':>5} {'prompt':>6} {'variant':>9} " + " ".join(f"{'t=' + format(t, 'g'):>13}" for t in args.diagnostic_thresholds))
        for r in results:
            if r["tpf"]:
                cells = " ".join(f"{v['accepted_tpf']:>6.2f}/{v['oracle_tpf']:<6.2f}" for v in r["tpf"].values())
                print(f"{r['batch']:>5} {r['prompt']:>6} {r['variant']:>9} {cells}")
    meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    meta["bidirectional_weights"] = "trained" if args.bidirectional else "R2LM backbone, attention switched"
    (args.out / "results.json").write_text(json.dumps({"settings": meta, "results": results}, indent=2))
    plot(results, args.out / "throughput.png", args.batch_sizes, args.prompt_lengths)
    print(f"\nwrote {args.out / 'results.json'} and {args.out / 'throughput.png'}")


if __name__ == "__main__":
    main()

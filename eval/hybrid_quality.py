"""Quality of block-hybrid conversion, end to end on a small trained model (docs/design.md 1.2 and 7; issue 5).

    python -m eval.hybrid_quality [--out runs/hybrid_quality] [--base-steps 1500] [--stage1-steps 400]
                                  [--stage2-steps 300] [--untied-feature-maps] [--launcher python|deepspeed] [--fresh]

Every model is built by the project's own programs, as a user would (each step is skipped when its output is
already there; --fresh starts over):

1. text: Python's pydoc topics (scripts/make_corpus.py); a tiny random Qwen3 + BPE tokenizer (scripts/make_tiny_base.py,
   6 layers); `convert from-hf --attention block_causal --prediction inplace`; then block-diffusion training with
   train/pretrain.py (configs/train/tiny_cpu.yaml, --base-steps): the trained, unconverted model;
2. `convert to-hybrid --layers 0,3` (every third layer; tied feature maps unless --untied-feature-maps): the
   converted model before stage 1;
3. stage 1, attention transfer (configs/train/tiny_hybrid_stage1.yaml): per-layer held-out MSE before / after
   from the run's attention_transfer.json;
4. stage 2, LoRA under the block loss (configs/train/tiny_hybrid_stage2.yaml), then `convert merge-lora`;
5. control: the same LoRA run on the unconverted model, so that "after stage 2" can be read against what the
   extra training alone buys.

All models are then scored on the same held-out sequences with the same noise (seeded per batch and repeat):
the block-diffusion loss of train/pretrain.py's evaluation, with paired differences to the unconverted model
(mean and standard error over held-out batches). Prints a table, writes results.json and hybrid_quality.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
logger = logging.getLogger("eval.hybrid_quality")

TARGET_MSE_REDUCTION = 10.0  # the issue: per-layer MSE at least 10x below its value at initialisation
TARGET_LOSS_GAP = 0.05  # the issue: after stage 2, within 5% of the unconverted model's held-out loss
NO_CONTEXT = "unconverted, windows blind to earlier blocks"


# ---------------------------------------------------------------------------------------------- building


def run(cmd: list[str], log: Path, what: str, threads: int) -> None:
    """A subprocess in the repository root; its output goes to `log`; a failure stops the script."""
    logger.info("%s: %s", what, " ".join(cmd))
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    with log.open("a") as f:
        done = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed (exit {done.returncode}); see {log}")
    logger.info("%s: done in %.0f s", what, time.perf_counter() - start)


def train_cmd(args, config: str, overrides: list[str]) -> list[str]:
    script = ["train/pretrain.py", "--config", config, *overrides]
    if args.launcher == "deepspeed":
        deepspeed = str(Path(sys.executable).parent / "deepspeed")
        return [deepspeed, "--num_gpus", str(args.ranks), "--master_port", str(args.port), *script]
    return [sys.executable, *script]


def build(args) -> dict[str, Path]:
    """Every model of the comparison, built by the project's programs; returns name -> checkpoint folder."""
    out, log = args.out, args.out / "build.log"
    corpus, cache = out / "corpus", out / "datasets-cache"
    common = [f"data.train={corpus / 'train.txt'}", f"data.heldout={corpus / 'heldout.txt'}", f"data.cache_dir={cache}",
              "wandb.mode=disabled", f"seed={args.seed}"]
    steps = [
        (corpus / "heldout.txt", "corpus", [sys.executable, "scripts/make_corpus.py", str(corpus)]),
        (corpus / "SPLIT", "larger held-out split", None),
        (out / "base" / "config.json", "tiny Qwen3 base",
         [sys.executable, "scripts/make_tiny_base.py", str(out / "base"), "--text", str(corpus / "train.txt"),
          "--layers", str(args.layers), "--seed", str(args.seed)]),
        (out / "r2lm" / "config.json", "from-hf (block_causal, inplace)",
         [sys.executable, "-m", "convert", "from-hf", str(out / "base"), str(out / "r2lm"), "--attention", "block_causal",
          "--prediction", "inplace", "--block-size", str(args.block_size)]),
        (out / "trained" / "final" / "config.json", "block-diffusion training of the base",
         train_cmd(args, "configs/train/tiny_cpu.yaml", [f"model={out / 'r2lm'}", f"output_dir={out / 'trained'}",
                                                         f"steps={args.base_steps}", "eval_every=500", "save_every=500",
                                                         "warmup_steps=50", "log_every=50", *common])),
        (out / "hybrid" / "config.json", "to-hybrid",
         [sys.executable, "-m", "convert", "to-hybrid", str(out / "trained" / "final"), str(out / "hybrid"),
          "--layers", ",".join(map(str, hybrid_layers(args.layers))),
          *(["--untied-feature-maps"] if args.untied_feature_maps else [])]),
        (out / "stage1" / "final" / "config.json", "stage 1: attention transfer",
         train_cmd(args, "configs/train/tiny_hybrid_stage1.yaml", [f"model={out / 'hybrid'}", f"output_dir={out / 'stage1'}",
                                                                   f"steps={args.stage1_steps}", *common])),
        (out / "stage2" / "final" / "adapter_config.json", "stage 2: LoRA",
         train_cmd(args, "configs/train/tiny_hybrid_stage2.yaml", [f"model={out / 'stage1' / 'final'}",
                                                                   f"output_dir={out / 'stage2'}", f"steps={args.stage2_steps}",
                                                                   *common])),
        (out / "merged" / "config.json", "merge-lora",
         [sys.executable, "-m", "convert", "merge-lora", str(out / "stage1" / "final"), str(out / "stage2" / "final"),
          str(out / "merged")]),
        (out / "control" / "final" / "adapter_config.json", "control: the same LoRA on the unconverted model",
         train_cmd(args, "configs/train/tiny_hybrid_stage2.yaml", [f"model={out / 'trained' / 'final'}",
                                                                   f"output_dir={out / 'control'}", f"steps={args.stage2_steps}",
                                                                   *common])),
        (out / "control_merged" / "config.json", "merge-lora (control)",
         [sys.executable, "-m", "convert", "merge-lora", str(out / "trained" / "final"), str(out / "control" / "final"),
          str(out / "control_merged")]),
    ]
    for done_marker, what, cmd in tqdm(steps, desc="build", unit="step"):
        if done_marker.exists():
            logger.info("%s: already built (%s)", what, done_marker.parent)
            continue
        if cmd is None:
            enlarge_heldout(corpus, args.heldout_every)
            continue
        run(cmd, log, what, args.threads)
    return {
        "unconverted": out / "trained" / "final",
        "converted, before stage 1": out / "hybrid",
        "after stage 1": out / "stage1" / "final",
        "after stage 2 (merged)": out / "merged",
        "control: unconverted + same LoRA": out / "control_merged",
    }


def enlarge_heldout(corpus: Path, every: int) -> None:
    """make_corpus.py holds out every 20th pydoc topic: about 5 KB, 10 sequences, too few to compare losses
    within a few percent. Move every `every`-th training paragraph to the held-out file as well (before any model
    has seen the training file), so the comparison rests on ten times more text."""
    split = lambda path: [p for p in path.read_text().split("\n\n") if p.strip()]  # noqa: E731
    train, heldout = split(corpus / "train.txt"), split(corpus / "heldout.txt")
    moved = train[every - 1 :: every]
    kept = [p for i, p in enumerate(train) if i % every != every - 1]
    (corpus / "train.txt").write_text("\n\n".join(p.strip() for p in kept) + "\n")
    (corpus / "heldout.txt").write_text("\n\n".join(p.strip() for p in heldout + moved) + "\n")
    (corpus / "SPLIT").write_text(f"every {every}th training paragraph moved to heldout.txt\n")
    logger.info("held-out split: %d paragraphs (%d moved from the %d training ones)", len(heldout) + len(moved), len(moved), len(train))


def hybrid_layers(n: int) -> list[int]:
    """Every third layer, starting at 0: a third of the layers (LLaDA-Hybrid spreads its 6 of 20 the same way)."""
    return list(range(0, n, 3))


# ---------------------------------------------------------------------------------------------- scoring


def heldout_batches(args):
    """The held-out set packed exactly as train/pretrain.py packs it: [(x0 [B, L]), ...] and the EOS id."""
    from transformers import AutoTokenizer

    from r2lm import R2LMConfig
    from r2lm.text import eos_id_of
    from train.config import load_config
    from train.data import build_data

    model = args.out / "trained" / "final"
    cfg = load_config(REPO / "configs/train/tiny_hybrid_stage2.yaml", [
        f"model={model}", f"output_dir={args.out / 'score'}", f"data.train={args.out / 'corpus' / 'train.txt'}",
        f"data.heldout={args.out / 'corpus' / 'heldout.txt'}", f"data.cache_dir={args.out / 'datasets-cache'}",
        f"micro_batch_size={args.score_batch}", "eval_batches=1000000"])
    tokenizer = AutoTokenizer.from_pretrained(model)
    eos = eos_id_of(tokenizer, R2LMConfig.from_pretrained(model))
    data = build_data(cfg, tokenizer, eos, 0, 1, first_on_node=True, barrier=lambda: None)
    return [data.heldout.batch(idx) for _, idx, _ in data.heldout.plan(0)], eos


class WithoutEarlierBlocks:
    """A model whose windows do not see the clean stream: each predicts from its own noisy block only. Scored like
    the others, it measures how much the model uses the earlier blocks at all, the scale a conversion gap (which
    only changes how earlier blocks are read) is to be read against."""

    def __init__(self, model):
        self.model = model

    def __call__(self, input_ids, layout, **kwargs):
        from r2lm import Layout

        later = layout.chunks + int(layout.chunks.max()) + 1  # clean chunks after every window: never "earlier"
        chunks = torch.where(layout.noisy, layout.chunks, later)
        return self.model(input_ids, layout=Layout(layout.positions, chunks, layout.noisy, layout.valid), **kwargs)


@torch.no_grad()
def score(model_dir: Path, batches, eos: int, repeats: int, eval_seed: int, without_context: bool = False) -> list[float]:
    """Block-diffusion loss of every (held-out batch, noise draw): the same units, in the same order, for every model."""
    from r2lm import R2LMForDiffusionLM
    from r2lm.diffusion import compute_loss, noise_seed

    model = R2LMForDiffusionLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = model.config
    if without_context:
        model = WithoutEarlierBlocks(model)
    units = []
    for k, x0 in enumerate(tqdm(batches, desc=model_dir.name, unit="batch", leave=False)):
        for r in range(repeats):
            generator = torch.Generator().manual_seed(noise_seed(eval_seed, k, r))
            units.append(float(compute_loss("block", model, x0, separator_id=eos, generator=generator, config=config).loss))
    return units


def summarize(losses: dict[str, list[float]]) -> list[dict]:
    """Mean loss per model, and its paired difference to the unconverted model with the standard error over units
    (every unit has the same number of tokens: full packed sequences, same block masks' eligibility)."""
    reference = losses["unconverted"]
    context = sum(losses[NO_CONTEXT]) / len(reference) - sum(reference) / len(reference)
    rows = []
    for name, units in losses.items():
        diffs = [a - b for a, b in zip(units, reference, strict=True)]
        n = len(diffs)
        mean = sum(units) / n
        gap = sum(diffs) / n
        se = math.sqrt(sum((d - gap) ** 2 for d in diffs) / max(n - 1, 1) / n)
        rows.append({"model": name, "heldout_block_loss": mean, "gap_vs_unconverted": gap, "gap_se": se,
                     "relative_gap": gap / (sum(reference) / n), "context_benefit_kept": 1 - gap / context})
    return rows


def plot(rows, transfer, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mse, loss) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1, 2]})
    layers = sorted(transfer["layers"], key=int)
    x = range(len(layers))
    mse.bar([i - 0.2 for i in x], [transfer["layers"][k]["before"] for k in layers], width=0.4, label="before stage 1")
    mse.bar([i + 0.2 for i in x], [transfer["layers"][k]["after"] for k in layers], width=0.4, label="after stage 1")
    mse.set(yscale="log", title="attention-transfer MSE (held out)", xlabel="hybrid layer", ylabel="MSE")
    mse.set_xticks(list(x), layers)
    mse.legend()
    names = [r["model"] for r in rows]
    values = [r["heldout_block_loss"] for r in rows]
    bars = loss.barh(range(len(rows)), values, xerr=[r["gap_se"] for r in rows], color="tab:gray")
    bars[0].set_color("tab:green")
    bars[names.index(NO_CONTEXT)].set_color("tab:orange")
    reference = values[0]
    loss.axvline(reference, color="tab:green", lw=1)
    loss.axvline(reference * (1 + TARGET_LOSS_GAP), color="tab:red", ls="--", lw=1, label="unconverted + 5%")
    loss.set_yticks(range(len(rows)), names)
    loss.invert_yaxis()
    loss.set(title="held-out block-diffusion loss (same batches, same noise)", xlabel="loss (nats / token)",
             xlim=(min(values) * 0.95, max(values) * 1.03))
    loss.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "hybrid_quality", help="work and result folder")
    parser.add_argument("--layers", type=int, default=6, help="layers of the tiny base (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=16, help="diffusion block size (default: %(default)s)")
    parser.add_argument("--base-steps", type=int, default=1500, help="block-diffusion training steps of the base")
    parser.add_argument("--untied-feature-maps", action="store_true",
                        help="separate query and key feature maps (LoLCATs) instead of tied ones (LLaDA-Hybrid)")
    parser.add_argument("--stage1-steps", type=int, default=400, help="attention-transfer steps")
    parser.add_argument("--stage2-steps", type=int, default=300, help="LoRA steps (stage 2 and the control)")
    parser.add_argument("--repeats", type=int, default=4, help="noise draws per held-out batch when scoring")
    parser.add_argument("--score-batch", type=int, default=4, help="sequences per held-out batch when scoring")
    parser.add_argument("--heldout-every", type=int, default=10,
                        help="move every N-th training paragraph to the held-out file (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default: %(default)s; "
                        "tiny models on a shared machine run fastest on one)")
    parser.add_argument("--eval-seed", type=int, default=1234, help="noise seed of the scoring")
    parser.add_argument("--seed", type=int, default=0, help="seed of the base model and of every training run")
    parser.add_argument("--launcher", choices=("python", "deepspeed"), default="python",
                        help="python: one process; deepspeed: --ranks CPU ranks (default: %(default)s)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--port", type=int, default=29631)
    parser.add_argument("--fresh", action="store_true", help="delete --out first and rebuild everything")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if args.fresh and args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)

    models = build(args)
    transfer = json.loads((args.out / "stage1" / "attention_transfer.json").read_text())
    batches, eos = heldout_batches(args)
    logger.info("scoring %d models on %d held-out batches of %s tokens, %d noise draws each", len(models), len(batches),
                tuple(batches[0].shape), args.repeats)
    losses = {name: score(path, batches, eos, args.repeats, args.eval_seed) for name, path in tqdm(models.items(), desc="score")}
    losses[NO_CONTEXT] = score(models["unconverted"], batches, eos, args.repeats, args.eval_seed, without_context=True)
    rows = summarize(losses)

    print("\nattention transfer (stage 1), held-out per-layer MSE of the hybrid output against the layer's softmax:")
    print(f"{'layer':>5} {'before':>11} {'after':>11} {'reduction':>10}  target >= {TARGET_MSE_REDUCTION:g}x")
    for layer in sorted(transfer["layers"], key=int):
        e = transfer["layers"][layer]
        print(f"{layer:>5} {e['before']:>11.4e} {e['after']:>11.4e} {e['reduction']:>9.1f}x  "
              f"{'met' if e['reduction'] >= TARGET_MSE_REDUCTION else 'NOT met'}")
    tokens = sum(int(b.numel()) for b in batches)
    print(f"\nheld-out block-diffusion loss ({len(batches)} batches, {tokens} tokens, x {args.repeats} noise draws; "
          "same noise for every model):")
    print(f"{'model':<44} {'loss':>7} {'gap vs unconverted':>21} {'relative':>9} {'context benefit kept':>21}")
    for r in rows:
        print(f"{r['model']:<44} {r['heldout_block_loss']:>7.4f} {r['gap_vs_unconverted']:>+12.4f} +- {r['gap_se']:.4f} "
              f"{100 * r['relative_gap']:>+8.2f}% {100 * r['context_benefit_kept']:>20.1f}%")
    print("(context benefit kept: 1 - gap / (loss blind to earlier blocks - unconverted loss); 100% = unconverted)")
    stage2 = next(r for r in rows if r["model"] == "after stage 2 (merged)")
    met = stage2["relative_gap"] <= TARGET_LOSS_GAP
    print(f"target: after stage 2 within {100 * TARGET_LOSS_GAP:g}% of the unconverted model: {'met' if met else 'NOT met'}")

    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    settings["hybrid_layers"] = transfer["hybrid_layers"]
    result = {"settings": settings, "models": {k: str(v) for k, v in models.items()}, "attention_transfer": transfer,
              "losses": rows, "per_unit_losses": losses,
              "targets": {"mse_reduction": TARGET_MSE_REDUCTION, "loss_gap": TARGET_LOSS_GAP,
                          "mse_met": all(e["reduction"] >= TARGET_MSE_REDUCTION for e in transfer["layers"].values()),
                          "loss_met": met}}
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    plot(rows, transfer, args.out / "hybrid_quality.png")
    print(f"\nwrote {args.out / 'results.json'} and {args.out / 'hybrid_quality.png'}")


if __name__ == "__main__":
    main()

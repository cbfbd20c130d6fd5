"""What a process's first call costs: `r2lm-generate` in fresh processes, AR against verified decoding, with nothing
kept from earlier runs, with the verification costs kept (`--verify-costs`), and with them and the product orders
kept (`--linear-decisions`), side by side in one run.

    python -m eval.first_call --checkpoint TARGET [--batch-sizes 1 8] [--max-new-tokens 64] [--runs 2]
        [--out docs/results]

A verified call decides every step from what its forwards cost on this machine (r2lm.generation.costs): the first one
in a process measures every width the policy may take, and an r2lm.ops.linear tuner times the product orders of every
row count those widths multiply. A user who runs the CLI once per request pays both every time unless the files keep
them. Decoders: AR (`--block-size 1`), prompt lookup (`--verify --verify-draft lookup --block-size 8`), and the
drafter r2lm ships for the checkpoint's model with lookup beside it (`--drafter`), where one ships. Each batch size's
files are made by untimed processes first (one per decoder, in turn, into the same two files). Each cell: the generate
call's seconds as r2lm-generate prints them (not the process's start or the model's load), the median over --runs
processes; × AR: AR's seconds in the same state over the cell's (AR keeps no costs: in the first two states it runs
the same flags, twice measured). The prompts: the chat demo's, through the chat template, cycled to the batch size;
every decoder's text is compared with AR's. Prints a table with the machine, writes first_call.json and first_call.png
to --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from eval.machine import describe, label, name_of
from r2lm.drafter import Drafter
from r2lm.modeling_r2lm import R2LMForDiffusionLM
from scripts.chat_demo import PROMPTS

REPO = Path(__file__).resolve().parents[1]
STATES = ("nothing kept", "costs kept", "costs + orders kept")
SPEED = re.compile(r"\[(\d+) tokens in ([0-9.]+) s")

logger = logging.getLogger("eval.first_call")


def decoders(checkpoint: Path) -> dict[str, list[str]]:
    """Each decoder's r2lm-generate flags; the shipped drafter only where r2lm ships one for the model."""
    out = {"AR": ["--block-size", "1"], "lookup": ["--verify", "--verify-draft", "lookup", "--block-size", "8"]}
    if Drafter.shipped(R2LMForDiffusionLM.from_pretrained(checkpoint)) is not None:
        out["lookup+drafter"] = ["--drafter"]
    return out


def kept_flags(state: str, verified: bool, files: Path) -> list[str]:
    """The flags that keep what earlier runs measured, in `state` (AR has no costs to keep)."""
    flags = []
    if state != "nothing kept" and verified:
        flags += ["--verify-costs", str(files / "costs.json")]
    if state == "costs + orders kept":
        flags += ["--linear-decisions", str(files / "orders.json")]
    return flags


def call(checkpoint: Path, prompts: list[str], max_new_tokens: int, flags: list[str]) -> tuple[float, str]:
    """One r2lm-generate process: (the generate call's seconds, its text)."""
    argv = [sys.executable, "-m", "r2lm.cli.generate", str(checkpoint), "--chat", "--max-new-tokens",
            str(max_new_tokens), *[arg for p in prompts for arg in ("--prompt", p)], *flags]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"r2lm-generate {' '.join(flags)} failed ({done.returncode}): {done.stderr[-2000:]}")
    found = SPEED.search(done.stderr)
    if found is None:
        raise RuntimeError(f"r2lm-generate printed no speed line: {done.stderr[-2000:]}")
    return float(found.group(2)), done.stdout


def batch_cells(checkpoint: Path, flags: dict[str, list[str]], batch: int, max_new_tokens: int, runs: int) -> dict:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    cells, texts = {}, {}
    with tempfile.TemporaryDirectory(prefix="first_call_") as scratch:
        files = Path(scratch)
        for name, own in flags.items():  # untimed: what the kept states load
            call(checkpoint, prompts, max_new_tokens, own + kept_flags("costs + orders kept", name != "AR", files))
        for state in STATES:
            for name, own in flags.items():
                seconds = []
                for _ in range(runs):
                    took, text = call(checkpoint, prompts, max_new_tokens, own + kept_flags(state, name != "AR", files))
                    seconds.append(took)
                    texts.setdefault(name, text)
                cells.setdefault(state, {})[name] = statistics.median(seconds)
                logger.info("batch %d, %s, %s: %s s", batch, state, name, seconds)
    ratios = {state: {name: row["AR"] / s for name, s in row.items()} for state, row in cells.items()}
    return {"seconds": cells, "x_ar": ratios, "same_text": {name: text == texts["AR"] for name, text in texts.items()}}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = list(results["batches"])
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.4), squeeze=False)
    for ax, batch in zip(axes[0], batches, strict=True):
        seconds = results["batches"][batch]["seconds"]
        names = list(seconds[STATES[0]])
        width = 0.8 / len(STATES)
        for i, state in enumerate(STATES):
            ax.bar([j + i * width for j in range(len(names))], [seconds[state][n] for n in names], width, label=state)
        ax.set_xticks([j + width for j in range(len(names))], names, fontsize=8)
        ax.set_ylabel("seconds of the first call")
        ax.set_title(f"batch {batch}", fontsize=9)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{results['model']}, {results['max_new_tokens']} tokens, {label(results['machine'])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True, help="an R2LM checkpoint folder (model + tokenizer)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=2, help="processes per cell (their median is the cell)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results", help="folder for the JSON and PNG")
    args = parser.parse_args(argv)
    if min(args.batch_sizes) < 1 or args.runs < 1 or args.max_new_tokens < 1:
        parser.error("--batch-sizes, --runs and --max-new-tokens must be positive")
    if not (args.checkpoint / "config.json").is_file():
        parser.error(f"--checkpoint {args.checkpoint}: no checkpoint folder there (no config.json)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    results = {"model": name_of(args.checkpoint), "machine": describe(), "max_new_tokens": args.max_new_tokens,
               "runs": args.runs, "batches": {}}
    flags = decoders(args.checkpoint)  # (loads the model once: whether a drafter ships for it)
    for batch in args.batch_sizes:
        results["batches"][str(batch)] = batch_cells(args.checkpoint, flags, batch, args.max_new_tokens, args.runs)
    print(f"\nthe first call of a process (seconds of the generate call, median of {args.runs} processes; x AR in the "
          f"same state), {args.max_new_tokens} tokens, {label(results['machine'])}")
    for batch, cell in results["batches"].items():
        names = list(cell["seconds"][STATES[0]])
        print(f"\n{'batch ' + batch:<20}" + "".join(f"{n:>24}" for n in names))
        for state in STATES:
            print(f"{state:<20}" + "".join(f"{cell['seconds'][state][n]:>10.2f} s ({cell['x_ar'][state][n]:.2f}x)"
                                           .rjust(24) for n in names))
        same = cell["same_text"].items()
        print("same text as AR: " + ", ".join(f"{n} {'yes' if ok else 'NO'}" for n, ok in same))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "first_call.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.out / "first_call.png")
    logger.info("wrote %s and %s", args.out / "first_call.json", args.out / "first_call.png")
    return results


if __name__ == "__main__":
    main()

"""Inputs of the training tests: a small repetitive English corpus, fast overrides of the tiny model's training
configuration, an in-process training run, and teacher records of a target's own greedy text (the drafter's data).
tests/project/test_helpers.py checks that the inputs really are what the tests assume."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch

from r2lm import R2LMForDiffusionLM, generate

from .models import make_model_dir

WORDS = ("the quick brown fox jumps over the lazy dog", "a diffusion model decodes many tokens at once")


def corpus_paragraphs(n: int, seed: int = 0) -> list[str]:
    """n short paragraphs of the two phrases the tiny tokenizer knows, in a seeded order (easy to learn)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5))) + f" number {i % 10}" for i in range(n)]


def write_corpus(folder: Path, n_train: int = 400, n_heldout: int = 40) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    train, heldout = folder / "train.txt", folder / "heldout.txt"
    train.write_text("\n\n".join(corpus_paragraphs(n_train, seed=0)) + "\n")
    heldout.write_text("\n\n".join(corpus_paragraphs(n_heldout, seed=1)) + "\n")
    return train, heldout


def base_overrides(model: Path, out: Path, train: Path, heldout: Path | None, cache: Path) -> list[str]:
    """A fast configuration of the tiny model: 64-token sequences, a few steps, fp32, wandb off."""
    items = [
        f"model={model}", f"output_dir={out}", f"data.train={train}", f"data.cache_dir={cache}",
        "seq_len=64", "micro_batch_size=4", "grad_accum=2", "steps=6", "lr=3.0e-3", "warmup_steps=2",
        "log_every=1", "eval_every=3", "eval_batches=2", "save_every=3", "wandb.mode=disabled",
        "deepspeed=configs/deepspeed/zero2.json",
    ]
    if heldout is not None:
        items.append(f"data.heldout={heldout}")
    return items


def training_inputs(root: Path, **model_overrides) -> tuple[Path, Path, Path, Path]:
    """A tiny model and corpus under `root`: (root, model, train, heldout)."""
    model = make_model_dir(root / "model", **model_overrides)
    train, heldout = write_corpus(root / "corpus")
    return root, model, train, heldout


def run_overrides(inputs, out: Path, *extra: str) -> list[str]:
    """base_overrides for the model and corpus of `training_inputs`, plus `extra`."""
    root, model, train, heldout = inputs
    return base_overrides(model, out, train, heldout, root / "cache") + list(extra)


def run_inprocess(overrides: list[str]):
    """One training run in this process (world size 1, DeepSpeed initialised once per process)."""
    from train.config import load_config
    from train.pretrain import train

    # One thread: on a small shared CI machine an OpenMP team of 2 stalls on every tiny matmul whenever another
    # process holds a core (15 ms per op instead of 0.1 ms); restored afterwards for the other tests.
    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        return train(load_config(None, overrides))
    finally:
        torch.set_num_threads(threads)
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = omp


def teacher_records(model_dir, path, n, seed, ids=None):
    """n records as train/teacher_data.py writes them: a random prompt continued greedily by the target."""
    model = R2LMForDiffusionLM.from_pretrained(model_dir).eval()
    g = torch.Generator().manual_seed(seed)
    with path.open("w") as f:
        for i in range(n):
            prompt = torch.randint(3, model.config.vocab_size - 1, (1, int(torch.randint(4, 12, (1,), generator=g))),
                                   generator=g)
            out = generate(model, prompt, max_new_tokens=24, block_size=1, eos_token_id=[]).sequences[0].tolist()
            record = {"index": i, "text": "", "prompt_tokens": prompt.shape[1], "new_tokens": 24, "finished": False,
                      "ids": out}
            if ids is not None:
                record["id"] = ids[i]
            f.write(json.dumps(record) + "\n")
    return path


def drafter_overrides(inputs, out, *extra):
    """Fast overrides of an objective=drafter run: `inputs` is (root, target model, train records, held-out records)."""
    root, model, train, heldout = inputs
    return [f"model={model}", f"output_dir={out}", f"data.train={train}", f"data.heldout={heldout}",
            "objective=drafter", "seq_len=48", "micro_batch_size=4", "grad_accum=2", "steps=6", "lr=3.0e-3",
            "warmup_steps=2", "log_every=1", "eval_every=3", "eval_batches=2", "save_every=3", "wandb.mode=disabled",
            "deepspeed=configs/deepspeed/zero2.json", "drafter.block_size=4", "drafter.blocks=6",
            "drafter.draft_vocab_size=64", *extra]

"""Builders shared by the training tests (test_train_*.py, test_data.py): a tiny R2LM checkpoint folder, a small
repetitive English corpus, and an in-process training run. The tests on these builders themselves check that
the inputs really are what the other tests assume."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

from conftest import tiny_r2lm, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]

WORDS = ("the quick brown fox jumps over the lazy dog", "a diffusion model decodes many tokens at once")


def make_model_dir(path: Path, **overrides) -> Path:
    """A tiny random R2LM (sidecars on layers 1 and 3, block size 8) with a real BPE tokenizer, saved as a folder."""
    tokenizer = tiny_tokenizer()  # byte-level: 256 bytes + merges + specials
    tokenizer.add_special_tokens({"mask_token": "<|mask|>"})  # as convert from-hf does
    overrides.setdefault("sidecar_layers", [1, 3])
    model = tiny_r2lm(seed=0, vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id, **overrides)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)


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
    import torch

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(args: list[str], timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """A subprocess in the repository root with it on PYTHONPATH (r2lm is not installed in the test venv)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled", **(env or {})}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(key, None)  # an in-process run of this pytest process set them for itself
    return subprocess.run(args, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def test_corpus_is_tokenised_into_known_words(tmp_path):
    tok = tiny_tokenizer()  # byte level (its 92-token budget is below the 256-byte alphabet): one id per character
    texts = corpus_paragraphs(3)
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    assert [len(x) for x in ids] == [len(t) for t in texts]
    assert tok.batch_decode(ids) == texts


def test_model_dir_loads(tmp_path):
    from r2lm import R2LMForDiffusionLM

    folder = make_model_dir(tmp_path / "m")
    model = R2LMForDiffusionLM.from_pretrained(folder)
    assert model.config.sidecar_layers == [1, 3] and model.config.eos_token_id == 0
    assert (folder / "tokenizer.json").is_file()

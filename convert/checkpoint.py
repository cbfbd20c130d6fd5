"""Checkpoint I/O shared by the converters: reading safetensors folders, writing output folders atomically."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

logger = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json",
)
TOKENIZER_GLOBS = ("tokenization_*.py", "*.tiktoken")


def read_config(src: Path) -> dict:
    path = Path(src) / "config.json"
    if not path.is_file():
        raise ValueError(f"{src} is not a checkpoint folder: it has no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err


def read_state_dict(src: Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors checkpoint folder, single file or sharded (model.safetensors.index.json)."""
    src = Path(src)
    index = src / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (src / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{src} has no safetensors weights (model.safetensors or model.safetensors.index.json)")
    state = {}
    for name in files:
        try:
            state.update(load_file(src / name))
        except Exception as err:
            raise ValueError(f"cannot read {src / name}: {err}") from err
    return state


def check_destination(src, dst, overwrite: bool) -> tuple[Path, Path]:
    """(src, dst) as paths, after refusing a DST that is SRC or that exists without --overwrite."""
    src, dst = Path(src), Path(dst)
    if dst.resolve() == src.resolve():
        raise ValueError("DST must differ from SRC: the source checkpoint is never modified")
    if dst.exists() and not overwrite:
        raise ValueError(f"{dst} already exists; pass --overwrite to replace it")
    return src, dst


def has_tokenizer(src: Path) -> bool:
    return any((Path(src) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    """The tokenizer files of `src`, verbatim (remote-code tokenizers included: nothing is loaded or run)."""
    src, dst = Path(src), Path(dst)
    names = {n for n in TOKENIZER_FILES if (src / n).is_file()}
    for pattern in TOKENIZER_GLOBS:
        names |= {p.name for p in src.glob(pattern) if p.is_file()}
    for name in sorted(names):
        shutil.copy(src / name, dst / name)


def write_checkpoint(model, dst: Path, src: Path, overwrite: bool = False, tokenizer=None) -> None:
    """`model.save_pretrained` into `dst`, atomically, with `tokenizer` (default: the tokenizer files of `src`, if
    any) and `src`'s generation_config.json (if any)."""
    src = Path(src)
    with atomic_output_dir(dst, overwrite) as tmp:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        else:
            copy_tokenizer_files(src, tmp)
        if (src / "generation_config.json").is_file():
            shutil.copy(src / "generation_config.json", tmp / "generation_config.json")


@contextlib.contextmanager
def atomic_output_dir(dst: Path, overwrite: bool = False):
    """Yield a temporary folder beside `dst`; on success rename it to `dst`, on failure remove it.

    Readers never see a half-written `dst`: it either does not exist, is the old folder, or is complete."""
    dst = Path(dst)
    if dst.exists() and not overwrite:
        raise ValueError(f"{dst} already exists; pass --overwrite to replace it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the result should look like any other folder
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.rename(dst, old)
        os.rename(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, dst)
    logger.info("wrote %s", dst)

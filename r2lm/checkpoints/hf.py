"""Reading HF-format checkpoint folders: config.json, safetensors weights (single file or sharded), tokenizer files.

Nothing here loads or runs code from the folder: the weights are read as tensors and checked for NaN / inf, and
the tokenizer files are only found and copied.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

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


def weight_files(src: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (sharded: the ones its index names); [] when it has none."""
    src = Path(src)
    index = src / "model.safetensors.index.json"
    if index.is_file():
        try:
            return [src / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{index} is not a safetensors index (a JSON weight_map): {err!r}") from None
    return [src / "model.safetensors"] if (src / "model.safetensors").is_file() else []


def read_state_dict(src: Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors checkpoint folder, single file or sharded (model.safetensors.index.json)."""
    state = {}
    for path in check_weights(src):
        state.update(read_tensors(path))
    check_finite(state, src)
    return state


def check_weights(src: Path) -> list[Path]:
    """The weight files of a checkpoint folder, each opened: a missing, truncated or padded file (safetensors
    checks that the tensors its header lists cover the file exactly) is refused with a ValueError before anything
    is loaded, for readers that load through transformers (whose errors name neither the file nor the problem)."""
    files = weight_files(src)
    if not files:
        raise ValueError(f"{src} has no safetensors weights (model.safetensors or model.safetensors.index.json)")
    for path in files:
        with _opened(path):
            pass
    return files


def read_tensors(path: Path, names=None) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file (only those in `names`, if given). Raises ValueError naming the file."""
    with _opened(path) as f:
        return {name: f.get_tensor(name) for name in f.offset_keys() if names is None or name in names}


@contextlib.contextmanager
def _opened(path: Path):
    """A safetensors file opened for reading, its failures (missing file, corrupt header or data) as ValueError."""
    try:
        with safe_open(path, framework="pt") as f:
            yield f
    except Exception as err:
        raise ValueError(f"cannot read {path}: {err}") from err


def check_finite(tensors: dict[str, torch.Tensor], source) -> None:
    """Refuse NaN / inf weights (a diverged or corrupt checkpoint), naming the tensors.

    A sum per tensor is one cheap pass (30x faster than isfinite().all() in fp32); it is non-finite when an element
    is, or when the sum overflows, which the exact check then rules out."""
    bad = [
        name for name, t in tensors.items()
        if t.is_floating_point() and not torch.isfinite(t.sum(dtype=torch.float32)) and not torch.isfinite(t).all()
    ]
    if bad:
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise ValueError(
            f"{source} has NaN or inf weights in {len(bad)} tensor(s): {', '.join(bad[:5])}{more}; the checkpoint is "
            "corrupt or its training diverged: convert an earlier checkpoint"
        )


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

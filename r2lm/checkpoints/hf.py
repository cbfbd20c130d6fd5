"""Reading HF-format checkpoint folders: config.json, generation_config.json, safetensors weights (single file or
sharded), tokenizer files.

Nothing here runs code from the folder: the weights are read as tensors, checked against the folder's manifest
(checksums.sha256, where it has one) and for NaN / inf; tokenizers are loaded without remote code.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoTokenizer, GenerationConfig

from r2lm.checkpoints.manifest import verify_files

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json",
)
TOKENIZER_GLOBS = ("tokenization_*.py", "*.tiktoken")
# The files a vocabulary is read from (tokenizer_config.json and special_tokens_map.json only describe one).
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


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
        with _opened(path) as f:  # check_weights verified the files
            state.update({name: f.get_tensor(name) for name in f.offset_keys()})
    check_finite(state, src)
    return state


def check_weights(src: Path) -> list[Path]:
    """The weight files of a checkpoint folder, each opened and, where the folder has a manifest, checked against it:
    a missing, truncated or padded file (safetensors checks that the tensors its header lists cover the file exactly)
    or one whose bytes changed since r2lm wrote it is refused with a ValueError before anything is loaded, for
    readers that load through transformers (whose errors name neither the file nor the problem)."""
    files = weight_files(src)
    if not files:
        raise ValueError(f"{src} has no safetensors weights (model.safetensors or model.safetensors.index.json)")
    for path in files:
        with _opened(path):
            pass
    verify_files(src, files)
    return files


def read_tensors(path: Path, names=None) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file (only those in `names`, if given), checked against the manifest of its
    folder where it has one. Raises ValueError naming the file."""
    path = Path(path)
    verify_files(path.parent, [path])
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

    A sum per tensor is one cheap pass (far cheaper than isfinite().all(): docs/results.md, "Finite-weight check");
    it is non-finite when an element is, or when the sum overflows, which the exact check then rules out."""
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


def read_generation_config(src: Path):
    """The transformers GenerationConfig of a checkpoint folder's generation_config.json; None when it has none.
    A file that is not a JSON object of generation options is refused with a ValueError naming it: transformers
    would log it at info level and go on with its built-in defaults, so decoding would silently use other options."""
    path = Path(src) / "generation_config.json"
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}): repair it, or delete it to decode with the defaults") \
            from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object of generation options, not a {type(raw).__name__}")
    try:
        return GenerationConfig.from_pretrained(src, local_files_only=True)
    except (OSError, TypeError, ValueError) as err:
        raise ValueError(f"{path} is not a usable generation config: {err}") from None


def has_tokenizer(src: Path) -> bool:
    """Whether the folder has any tokenizer file (load_tokenizer says whether they make a tokenizer)."""
    return any((Path(src) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def check_tokenizer(src: Path) -> None:
    """Raise a ValueError naming the folder unless it holds a vocabulary a tokenizer can be loaded from without
    remote code (transformers would instead say to install sentencepiece or tiktoken, whatever the folder lacks)."""
    src = Path(src)
    if any((src / f).is_file() for f in VOCABULARY_FILES) or any(src.glob("*.tiktoken")):
        return
    found = sorted(n for n in TOKENIZER_FILES if (src / n).is_file())
    has = f"it has only {', '.join(found)}, which describe one" if found else "it has no tokenizer files"
    raise ValueError(f"{src} has no tokenizer vocabulary ({' / '.join(VOCABULARY_FILES)}): {has}; copy the tokenizer "
                     "files of the model it was made from into it")


def load_tokenizer(src: Path, **kwargs):
    """The tokenizer of a checkpoint folder (AutoTokenizer, local files only, no remote code; `kwargs` as
    AutoTokenizer takes them), or a ValueError naming the folder and what is wrong with its tokenizer files."""
    check_tokenizer(src)
    if (Path(src) / "tokenizer.model").is_file() and not (Path(src) / "tokenizer.json").is_file():
        if importlib.util.find_spec("sentencepiece") is None:
            raise ValueError(f"the tokenizer of {src} is a sentencepiece model (tokenizer.model, no tokenizer.json): "
                             "install sentencepiece (pip install sentencepiece) to load it")
    try:
        return AutoTokenizer.from_pretrained(src, local_files_only=True, trust_remote_code=False, **kwargs)
    except Exception as err:  # transformers raises ValueError, OSError, TypeError, KeyError ... for broken files
        raise ValueError(f"cannot load the tokenizer of {src}: {err}") from err


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    """The tokenizer files of `src`, verbatim (remote-code tokenizers included: nothing is loaded or run)."""
    src, dst = Path(src), Path(dst)
    names = {n for n in TOKENIZER_FILES if (src / n).is_file()}
    for pattern in TOKENIZER_GLOBS:
        names |= {p.name for p in src.glob(pattern) if p.is_file()}
    for name in sorted(names):
        shutil.copy(src / name, dst / name)

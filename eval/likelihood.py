"""Likelihood evaluations of every r2lm variant: held-out masked-diffusion NLL and multiple-choice scoring.

    python -m eval.likelihood MODEL --data HELDOUT.txt [--mode auto|ar|diffusion] [--ratios 0.15 0.5 0.9]
        [--seq-len 512] [--max-sequences 256] [--batch-size 4] [--elbo-points 0] [--out nll.json]

How a model is evaluated (`--mode`, see `eval_mode`):

    ar      causal attention, shift prediction, trained with the `ar` objective (the AR baseline)
    block   causal / block_causal diffusion models (R2LM, causal dLLM, frozen-backbone R2LM): the dual-stream
            block layout of training and decoding (DESIGN 2.1)
    single  bidirectional models (LLaDA-style mdlm): one noisy stream, every position sees every position

`auto` picks `block` or `single` from config.attention; the AR baseline cannot be told from a causal dLLM by its
config, so pass `--mode ar` for it.

Held-out NLL. The held-out text is tokenised and packed exactly like training data (documents followed by EOS,
cut into `seq_len` rows; `train.data.encode` / `pack`). In every row block 0 (the first `block_size` tokens) is
context: it is never masked and never scored, and separator (EOS) tokens are never masked, as in training. The
scored set S is every other position; it is the same for every variant. Each position draws one uniform
u ~ U(0, 1) from a generator seeded by (seed, row index) and is masked at ratio r when u < r, so every variant
sees exactly the same masks (and masks are nested across ratios). The numbers:

- `masked[r].nll`: mean cross-entropy (nats) of the masked tokens at mask ratio r, computed the way the model is
  used. Block models: the dual-stream layout with one fixed ratio for every block instead of a random t per
  block; a masked token sees the clean tokens of earlier blocks and its own noisy block (causally for `causal`,
  where the right part of the block reaches it only through the reverse sidecar; fully for `block_causal`),
  never later blocks. Single-stream models: the whole row noised at ratio r, the masked token sees every noisy
  position, later blocks included. The AR model: the same block layout as block models, read by its causal
  backbone (no sidecar; [MASK] is an input it never trained on).
- `masked[r].elbo_term`: sum of those cross-entropies / (r * |S|), the masked-diffusion ELBO integrand at t = r
  (what r2lm.diffusion's objectives average); its expectation equals `nll` up to the mask-count fluctuation.
- `elbo` (with `--elbo-points K`): the midpoint rule over K ratios of the integrand, i.e. the masked-diffusion
  negative ELBO per scored token: an upper bound on -log p(x_S | block 0) / |S| for that model.
- `next_token_nll`: (causal attention only) the exact next-token NLL of the same scored tokens, each read
  with everything to its left clean: AR decoding (block size 1). For a model with open sidecar gates each
  prediction is a one-column window with its sidecar, which is what block-size-1 decoding computes.

Comparability: numbers are comparable across variants only within a column: `masked[r].nll` for one r (same
tokens, same masks, each model with the context its architecture can use: that difference is what is
measured), or `elbo` together with the AR model's `next_token_nll` (both bound, or are, the per-token NLL of
the same tokens given block 0). A masked NLL at one ratio is not a likelihood, and values at different ratios,
or against `next_token_nll`, measure different things.

Multiple choice (`score_choices`, `answer_loglikelihood`): log p(answer | context). Diffusion variants use
LLaDA's Monte-Carlo estimator (ML-GSAI/LLaDA `get_log_likelihood.py`): draw a mask count x in {1..n}
(stratified over the rows of a batch), mask x answer tokens uniformly at random, and sum the log-probabilities
of the masked tokens weighted by n / x; the mean over `mc_num` samples estimates the masked-diffusion ELBO of the
answer (a lower bound on its log-likelihood). The answer follows the context in the layout the model decodes
with: block models put it in windows of `block_size` tokens after the clean context (the windows of `generate`:
each sees the context and the clean earlier answer blocks; the count is drawn per block, which is the ELBO of
the block factorisation), single-stream models mask it in one noisy stream after the context. The AR variant
uses the exact next-token log-likelihood. Answers whose blocks are all one token long need one sample (exact).
Block models encode the context once per question (`ContextCache`: its KV cache replicated over the rows of a
Monte-Carlo batch and shared by the choices; tested equal to the full layout), so a sample costs about two
answer lengths of tokens, not the context. `greedy_reproduces` gives lm-eval's is_greedy (LLaDA's
suffix_greedy_prediction: one token per step, most confident first).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from r2lm.layout import Layout, dual_stream

logger = logging.getLogger("eval.likelihood")

MODES = ("auto", "ar", "diffusion")
RATIOS = (0.15, 0.5, 0.9)


# ---------------------------------------------------------------------------------------------- models


def eval_mode(model, mode: str = "auto") -> str:
    """How `model` is evaluated: "ar", "block" (causal / block_causal diffusion) or "single" (bidirectional)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    config = model.config
    if mode == "ar":
        if config.attention != "causal" or config.prediction != "shift":
            raise ValueError(
                f"mode 'ar' needs a causal model with shift prediction, got attention={config.attention!r}, "
                f"prediction={config.prediction!r}"
            )
        return "ar"
    if config.mask_token_id is None:
        raise ValueError("diffusion evaluation needs config.mask_token_id (or use mode='ar' for an AR model)")
    return "single" if config.attention == "bidirectional" else "block"


def sidecars_active(model) -> bool:
    from r2lm.generation.decoding import sidecars_active as active

    return active(model)


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
    c = model.config
    return {
        "mode": mode, "attention": c.attention, "prediction": c.prediction, "sidecar_layers": list(c.sidecar_layers),
        "hybrid_layers": list(c.hybrid_layers), "sidecars_active": sidecars_active(model), "block_size": c.block_size,
    }


# ---------------------------------------------------------------------------------------------- data


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
    import re

    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def pack_texts(tokenizer, texts: list[str], seq_len: int, eos_id: int, max_sequences: int | None = None) -> torch.Tensor:
    """[N, seq_len] rows packed like training data (train.data: documents + EOS, concatenated, cut)."""
    from train.data import encode, pack

    rows, _ = pack(encode(tokenizer, texts), eos_id, seq_len)
    if not rows:
        raise ValueError(f"the held-out text is shorter than one sequence of {seq_len} tokens")
    if max_sequences:
        rows = rows[:max_sequences]
    return torch.tensor(rows, dtype=torch.long)


def eos_of(tokenizer, model) -> int | None:
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    eos = model.config.eos_token_id
    return int(eos[0] if isinstance(eos, list) else eos) if eos is not None else None


# ---------------------------------------------------------------------------------------------- held-out NLL


def position_uniforms(num_rows: int, length: int, seed: int, first_row: int = 0) -> torch.Tensor:
    """[num_rows, length] uniforms, row i drawn from a generator seeded by (seed, first_row + i): the same masks
    whatever the batch size or the model."""
    out = torch.empty(num_rows, length)
    for i in range(num_rows):
        g = torch.Generator().manual_seed(seed * 1_000_003 + first_row + i)
        out[i] = torch.rand(length, generator=g)
    return out


def scored_positions(x0: torch.Tensor, block_size: int, separator_id: int | None) -> torch.Tensor:
    """bool [B, L]: the positions every variant predicts (not block 0, not separators)."""
    ok = torch.ones_like(x0, dtype=torch.bool)
    ok[:, :block_size] = False
    if separator_id is not None:
        ok &= x0 != separator_id
    return ok


@torch.no_grad()
def masked_token_ce(model, x0: torch.Tensor, masked: torch.Tensor, mode: str, block_size: int | None = None) -> torch.Tensor:
    """Cross-entropy [B, L] (float32) of each masked token of x0 when the `masked` positions are [MASK]; 0 elsewhere.

    `block` / `ar`: the dual-stream layout (r2lm.layout.dual_stream) with `block_size`; `single`: one noisy stream.
    Block 0 must not be masked under `block` / `ar` (it is context only)."""
    config = model.config
    mask_id = config.mask_token_id
    if mask_id is None:
        raise ValueError("masked NLL needs config.mask_token_id")
    b = block_size or config.block_size
    xt = torch.where(masked, torch.full_like(x0, mask_id), x0)
    ce = torch.zeros(x0.shape, dtype=torch.float32, device=x0.device)
    if not bool(masked.any()):
        return ce
    if mode == "single":
        logits = model(xt).logits
        if config.prediction == "shift":
            if bool(masked[:, 0].any()):
                raise ValueError("position 0 cannot be scored under shift prediction")
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        ce[masked] = F.cross_entropy(logits[masked].float(), x0[masked], reduction="none")
        return ce
    if bool(masked[:, :b].any()):
        raise ValueError("block 0 is context in the block layout: it cannot be masked")
    inputs, layout, target = dual_stream(x0, xt, b, config.prediction)
    window = torch.nonzero(target >= 0).flatten()
    tgt = target[window]
    keep = masked[:, tgt].any(0)  # only columns that predict a masked token of some row need logits
    window, tgt = window[keep], tgt[keep]
    logits = model(inputs, layout=layout, logits_to_keep=window).logits  # [B, W, V]
    sel = masked[:, tgt]
    rows = torch.arange(x0.shape[0], device=x0.device)[:, None].expand_as(sel)
    ce[rows[sel], tgt[None].expand_as(sel)[sel]] = F.cross_entropy(logits[sel].float(), x0[:, tgt][sel], reduction="none")
    return ce


@torch.no_grad()
def next_token_ce(model, x0: torch.Tensor) -> torch.Tensor:
    """Cross-entropy [B, L] of each token given every token to its left (position 0: 0), causal models only.

    Without open sidecars this is the plain causal forward; with them, every prediction is a one-column window
    (the dual-stream layout at block size 1), exactly what block-size-1 decoding computes."""
    config = model.config
    if config.attention != "causal" or config.prediction != "shift":
        raise ValueError("next-token NLL needs a causal model with shift prediction")
    ce = torch.zeros(x0.shape, dtype=torch.float32, device=x0.device)
    if sidecars_active(model):
        inputs, layout, target = dual_stream(x0, x0, 1, "shift")
        window = torch.nonzero(target >= 0).flatten()
        logits = model(inputs, layout=layout, logits_to_keep=window).logits
        tgt = target[window]
    else:
        logits = model(x0).logits[:, :-1]
        tgt = torch.arange(1, x0.shape[1], device=x0.device)
    ce[:, tgt] = F.cross_entropy(logits.flatten(0, 1).float(), x0[:, tgt].flatten(), reduction="none").view(len(x0), -1)
    return ce


@torch.no_grad()
def heldout_nll(
    model,
    sequences: torch.Tensor,
    ratios=RATIOS,
    mode: str = "auto",
    block_size: int | None = None,
    batch_size: int = 4,
    seed: int = 0,
    separator_id: int | None = None,
    elbo_points: int = 0,
    progress: bool = True,
) -> dict:
    """Held-out masked NLL at fixed ratios (+ next-token NLL, + ELBO) of `model` on sequences [N, L]; see the module
    docstring for what each number means."""
    mode = eval_mode(model, mode) if mode in MODES else mode
    b = block_size or model.config.block_size
    n_rows, length = sequences.shape
    if length <= b:
        raise ValueError(f"sequences of {length} tokens leave nothing to score after block 0 ({b} tokens)")
    ratios = [float(r) for r in ratios]
    for r in ratios:
        if not 0 < r <= 1:
            raise ValueError(f"mask ratios must be in (0, 1], got {r}")
    grid = [(k + 0.5) / elbo_points for k in range(elbo_points)]
    all_ratios = sorted(set(ratios) | set(grid))
    sums = {r: [0.0, 0] for r in all_ratios}  # ratio -> [sum CE, masked tokens]
    next_sum, scored_total = 0.0, 0
    causal = model.config.attention == "causal" and model.config.prediction == "shift"
    device = model.device
    start = time.time()
    for first in tqdm(range(0, n_rows, batch_size), desc="held-out NLL", disable=not progress, unit="batch"):
        x0 = sequences[first : first + batch_size].to(device)
        scored = scored_positions(x0, b, separator_id)
        scored_total += int(scored.sum())
        u = position_uniforms(len(x0), length, seed, first).to(device)
        for r in all_ratios:
            masked = scored & (u < r)
            ce = masked_token_ce(model, x0, masked, mode, b)
            sums[r][0] += float(ce.sum())
            sums[r][1] += int(masked.sum())
        if causal:
            next_sum += float((next_token_ce(model, x0) * scored).sum())

    def term(r):
        return sums[r][0] / (r * scored_total)

    out = {
        **describe(model, mode),
        "block_size": b,
        "num_sequences": n_rows,
        "seq_len": length,
        "scored_tokens": scored_total,
        "seed": seed,
        "masked": {
            f"{r:g}": {"nll": sums[r][0] / max(sums[r][1], 1), "elbo_term": term(r), "masked_tokens": sums[r][1]}
            for r in ratios
        },
        "next_token_nll": next_sum / scored_total if causal else None,
        "elbo": sum(term(r) for r in grid) / len(grid) if grid else None,
        "elbo_points": elbo_points,
        "seconds": round(time.time() - start, 3),
    }
    return out


# ---------------------------------------------------------------------------------------------- answers


def stratified_masks(n: int, rows: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaDA's forward process for one answer (block) of n tokens over a batch of `rows` samples.

    The mask counts x are spread evenly over {1..n} from a random start (stratified), each row masks x tokens
    chosen uniformly. Returns (masked bool [rows, n], weight [rows] = n / x, the 1 / p of the ELBO)."""
    k = int(torch.randint(1, n + 1, (1,), generator=generator))
    x = torch.round(torch.linspace(float(k), k + (rows - 1) * (n / rows), rows)).long()
    x = (x - 1) % n + 1
    rank = torch.rand(rows, n, generator=generator).argsort(dim=1).argsort(dim=1)
    return rank < x[:, None], n / x.double()


def answer_blocks(n: int, mode: str, block_size: int) -> list[tuple[int, int]]:
    """[start, end) of each answer block: windows of block_size under `block`, the whole answer otherwise."""
    if mode != "block":
        return [(0, n)]
    return [(s, min(s + block_size, n)) for s in range(0, n, block_size)]


def block_answer_inputs(model, context: torch.Tensor, answer: torch.Tensor, masked: torch.Tensor, block_size: int,
                        cached_head: bool = False):
    """The answer after the context, as `generate` decodes it (DESIGN 2.1), for a batch of mask patterns.

    context [P], answer [n], masked [rows, n]. Columns: the clean context (prefill: all but its last token under
    `shift`, on the block grid where chunks matter), the clean answer blocks but the last (commits), then one
    window per answer block (shift: opened by the token before the block, positions shifted by one). Window j sees
    the context and the clean blocks < j. With `cached_head` the context columns are left out (they are in a KV
    cache, see `ContextCache`). Returns (input_ids [rows, T], layout, keep [n]: the column whose logits predict
    answer token i)."""
    config = model.config
    o = int(config.prediction == "shift")
    P, n = len(context), len(answer)
    if P < o:
        raise ValueError("a shift-prediction model needs at least one context token to open the first window")
    rows, device = masked.shape[0], context.device
    mask_id = config.mask_token_id
    z = torch.cat([context, answer])
    ids, pos, chunks, noisy = [], [], [], []
    head = P - o
    base = 0
    if head:
        hl = model.prompt_layout(torch.ones(1, head, dtype=torch.long, device=device))
        base = int(hl.chunks.max()) + 1
        if not cached_head:
            ids.append(z[:head][None].expand(rows, -1))
            pos.append(hl.positions[0])
            chunks.append(hl.chunks.reshape(-1, head)[0])
            noisy.append(torch.zeros(head, dtype=torch.bool, device=device))
    blocks = answer_blocks(n, "block", block_size)
    for j, (s, e) in enumerate(blocks[:-1]):  # committed blocks
        cols = torch.arange(P - o + s, P - o + e, device=device)
        ids.append(z[cols][None].expand(rows, -1))
        pos.append(cols)
        chunks.append(torch.full_like(cols, base + j))
        noisy.append(torch.zeros(len(cols), dtype=torch.bool, device=device))
    keep = []
    offset = sum(len(p) for p in pos)
    for j, (s, e) in enumerate(blocks):  # windows
        cols = torch.arange(P - o + s, P - o + e, device=device)
        win = z[cols][None].repeat(rows, 1)
        idx = cols - P  # answer index held by each input column (negative: context)
        own = (idx >= s) & (idx < e)
        hide = masked[:, idx.clamp(min=0, max=n - 1)] & own[None]
        win[hide] = mask_id
        ids.append(win)
        pos.append(cols)
        chunks.append(torch.full_like(cols, base + j))
        noisy.append(torch.ones(len(cols), dtype=torch.bool, device=device))
        keep.append(torch.arange(offset, offset + len(cols), device=device))
        offset += len(cols)
    layout = Layout(positions=torch.cat(pos)[None], chunks=torch.cat(chunks), noisy=torch.cat(noisy))
    return torch.cat(ids, dim=1), layout, torch.cat(keep)


class ContextCache:
    """The clean context of block models encoded once: a KVCache of its prefill part (all but the last token under
    `shift`) replicated over the rows of a Monte-Carlo batch, reused by every answer scored after that context.

    Exact: prefill is what the full layout computes for those columns (DESIGN 8.2), and forwards that read the
    cache without committing leave it unchanged. Holds the caches of the latest context only (one per batch size)."""

    def __init__(self):
        self.key, self.caches = None, {}

    def get(self, model, context: torch.Tensor, rows: int, room: int):
        o = int(model.config.prediction == "shift")
        head = len(context) - o
        if head <= 0:
            return None
        key = tuple(context.tolist())
        if key != self.key:
            self.key, self.caches = key, {}
        cache = self.caches.get(rows)
        if cache is None or cache.max_length < head + room:
            size = min(head + -(-room // 64) * 64, model.config.max_position_embeddings)
            if size < head + room:
                return None  # no room for the answer's columns: the full layout computes the same
            one = model.new_cache(1, head)
            model.prefill(context[None, :head], one)
            cache = model.new_cache(rows, size)
            cache.length = head
            for r in range(rows):
                cache.place_row(r, one)
            self.caches[rows] = cache
        return cache


@torch.no_grad()
def answer_logprobs(model, context: torch.Tensor, answer: torch.Tensor, masked: torch.Tensor, mode: str,
                    block_size: int, logits_only: bool = False, caches: ContextCache | None = None) -> torch.Tensor:
    """log p(answer_i | context, unmasked answer) [rows, n] for each row's mask pattern masked [rows, n] (mode
    `block` or `single`); with `logits_only`, the logits [rows, n, V] instead. Block models read the context from
    `caches` when given (the same numbers, computed once per context instead of once per row and batch)."""
    config = model.config
    n = len(answer)
    if mode == "block":
        cache = caches.get(model, context, len(masked), 2 * n) if caches is not None else None
        ids, layout, keep = block_answer_inputs(model, context, answer, masked, block_size, cached_head=cache is not None)
        logits = model(ids, layout=layout, cache=cache, logits_to_keep=keep).logits
    else:
        o = int(config.prediction == "shift")
        P = len(context)
        if P < o:
            raise ValueError("a shift-prediction model needs at least one context token")
        noisy = torch.where(masked, torch.full_like(masked, config.mask_token_id, dtype=torch.long), answer[None])
        ids = torch.cat([context[None].expand(len(masked), -1), noisy], dim=1)
        logits = model(ids, logits_to_keep=torch.arange(P - o, P - o + n, device=ids.device)).logits
    if logits_only:
        return logits
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, answer[None, :, None].expand(len(masked), -1, 1))[..., 0]


@torch.no_grad()
def ar_logprobs(model, context: torch.Tensor, answer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact next-token log p(answer_i | context, answer_<i) [n] and whether each is the argmax [n]."""
    P, n = len(context), len(answer)
    if P < 1:
        raise ValueError("AR scoring needs at least one context token")
    z = torch.cat([context, answer])[None]
    logits = model(z, logits_to_keep=torch.arange(P - 1, P - 1 + n, device=z.device)).logits[0].float()
    return torch.log_softmax(logits, -1).gather(-1, answer[:, None])[:, 0], logits.argmax(-1) == answer


@torch.no_grad()
def answer_loglikelihood(
    model,
    context,
    answer,
    mode: str = "auto",
    mc_num: int = 128,
    batch_size: int = 32,
    block_size: int | None = None,
    seed: int = 0,
    generator: torch.Generator | None = None,
    caches: ContextCache | None = None,
) -> float:
    """log p(answer | context): exact for `ar`, LLaDA's Monte-Carlo ELBO estimate for diffusion variants.

    context, answer: token id lists or 1-D tensors. With the same seed, answers of equal length see the same
    mask patterns (common random numbers: less variance between the choices of one question). `caches` (block
    models): a ContextCache shared by the answers of one context."""
    mode = eval_mode(model, mode) if mode in MODES else mode
    device = model.device
    context = torch.as_tensor(context, dtype=torch.long, device=device)
    answer = torch.as_tensor(answer, dtype=torch.long, device=device)
    n = len(answer)
    if n == 0:
        return 0.0
    if mode == "ar":
        return float(ar_logprobs(model, context, answer)[0].sum())
    b = block_size or model.config.block_size
    blocks = answer_blocks(n, mode, b)
    gen = generator or torch.Generator().manual_seed(seed)
    total = mc_num if max(e - s for s, e in blocks) > 1 else 1  # one-token blocks: one sample is exact
    if total <= 0:
        raise ValueError(f"mc_num must be positive, got {mc_num}")
    estimate, done = 0.0, 0
    while done < total:
        rows = min(batch_size, total - done)
        masks, weights = [], []
        for s, e in blocks:
            m, w = stratified_masks(e - s, rows, gen)
            masks.append(m)
            weights.append(w[:, None].expand(-1, e - s))
        masked = torch.cat(masks, 1).to(device)
        weight = torch.cat(weights, 1).to(device)
        logp = answer_logprobs(model, context, answer, masked, mode, b, caches=caches).double()
        estimate += float((logp * weight * masked).sum())
        done += rows
    return estimate / total


@torch.no_grad()
def greedy_reproduces(model, context, answer, mode: str = "auto", block_size: int | None = None,
                      caches: ContextCache | None = None) -> bool:
    """Whether greedy decoding after `context` produces exactly `answer` (lm-eval's is_greedy).

    ar: the argmax at every position. Diffusion (LLaDA's suffix_greedy_prediction): the answer starts fully
    masked and each step unmasks the single most confident position (per block for block models, whose blocks
    read the clean earlier blocks; blocks are checked in parallel) with its argmax; false at the first miss."""
    mode = eval_mode(model, mode) if mode in MODES else mode
    device = model.device
    context = torch.as_tensor(context, dtype=torch.long, device=device)
    answer = torch.as_tensor(answer, dtype=torch.long, device=device)
    n = len(answer)
    if n == 0:
        return True
    if mode == "ar":
        return bool(ar_logprobs(model, context, answer)[1].all())
    b = block_size or model.config.block_size
    blocks = answer_blocks(n, mode, b)
    masked = torch.ones(1, n, dtype=torch.bool, device=device)
    while bool(masked.any()):
        logits = answer_logprobs(model, context, answer, masked, mode, b, logits_only=True, caches=caches)[0].float()
        logits[:, model.config.mask_token_id] = float("-inf")
        probs = logits.softmax(-1)
        conf, tokens = probs.max(-1)
        for s, e in blocks:
            open_ = masked[0, s:e]
            if not bool(open_.any()):
                continue
            i = s + int(conf[s:e].masked_fill(~open_, -1.0).argmax())
            if int(tokens[i]) != int(answer[i]):
                return False
            masked[0, i] = False
    return True


def score_choices(
    model,
    context_ids,
    choices_ids,
    mode: str = "auto",
    mc_num: int = 128,
    batch_size: int = 32,
    block_size: int | None = None,
    seed: int = 0,
    use_cache: bool = True,
) -> list[float]:
    """log p(choice | context) for each choice (token id lists): exact for `ar`, the Monte-Carlo ELBO estimate for
    diffusion variants (every choice with the same seed). Block models encode the context once, in a KV cache
    shared by every choice (`use_cache=False`: recompute it in every forward; the same numbers)."""
    caches = ContextCache() if use_cache else None
    return [
        answer_loglikelihood(model, context_ids, c, mode=mode, mc_num=mc_num, batch_size=batch_size,
                             block_size=block_size, seed=seed, caches=caches)
        for c in choices_ids
    ]


# ---------------------------------------------------------------------------------------------- CLI


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="HF-format R2LM checkpoint folder")
    parser.add_argument("--data", required=True, help="held-out text: .txt (paragraphs), .jsonl / .json, or a folder")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    parser.add_argument("--mode", default="auto", choices=MODES, help="'ar' for the AR baseline; auto otherwise")
    parser.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS))
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--max-sequences", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=None,
                        help="block layout size and length of the unscored block 0 (default: config.block_size); give "
                             "every variant of one table the same value")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--elbo-points", type=int, default=0, help="also integrate the ELBO over K ratios")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--out", type=Path, default=None, help="JSON output (default: stdout only)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    model, tokenizer = load_model(args.model, args.device, args.dtype)
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    eos = eos_of(tokenizer, model)
    if eos is None:
        raise SystemExit("neither the tokenizer nor the config defines EOS, which packing needs as separator")
    seqs = pack_texts(tokenizer, read_texts(args.data), args.seq_len, eos, args.max_sequences)
    logger.info("%d held-out sequences of %d tokens from %s", len(seqs), args.seq_len, args.data)
    result = heldout_nll(model, seqs, args.ratios, args.mode, args.block_size, args.batch_size, args.seed, eos,
                         args.elbo_points)
    result.update(model=str(args.model), data=str(args.data))
    for r, v in result["masked"].items():
        logger.info("ratio %s: masked NLL %.4f (ELBO term %.4f, %d masked)", r, v["nll"], v["elbo_term"], v["masked_tokens"])
    if result["next_token_nll"] is not None:
        logger.info("next-token NLL %.4f", result["next_token_nll"])
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

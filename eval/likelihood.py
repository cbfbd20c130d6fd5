"""Likelihood evaluations of every r2lm variant: held-out masked-diffusion NLL and multiple-choice scoring.

    python -m eval.likelihood MODEL --data HELDOUT.txt [--mode auto|ar|diffusion] [--ratios 0.15 0.5 0.9]
        [--seq-len 512] [--max-sequences 256] [--batch-size 4] [--elbo-points 0] [--out nll.json]

How a model is evaluated (`--mode`, see `eval_mode`):

    ar      causal attention, shift prediction, trained with the `ar` objective (the AR baseline)
    block   causal / block_causal diffusion models (R2LM, causal dLLM, frozen-backbone R2LM): the dual-stream
            block layout of training and decoding (docs/design.md 2.1)
    single  bidirectional models (LLaDA-style mdlm): one noisy stream, every position sees every position

`auto` picks `block` or `single` from config.attention; the AR baseline cannot be told from a causal dLLM by its
config, so pass `--mode ar` for it.

Held-out NLL. The held-out text is tokenised and packed exactly like training data (documents followed by EOS,
cut into `seq_len` rows; `r2lm.text.encode` / `pack`). In every row block 0 (the first `block_size` tokens) is
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

Multiple choice and greedy reproduction (`score_choices`, `answer_loglikelihood`, `greedy_reproduces`) are the
library's: r2lm.scoring, whose docstring says how each is computed.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from eval.common import describe, eos_of, load_model, pack_texts, read_texts, write_result
from r2lm.scoring import MODES, eval_mode, masked_token_ce, next_token_ce

logger = logging.getLogger("eval.likelihood")

RATIOS = (0.15, 0.5, 0.9)


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
    causal = model.config.kind.ar
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

"""The decoders a lossless benchmark times side by side, one call signature for all: `run(ids, mask, n)` decodes a
left-padded batch and returns what was generated (each row up to its EOS), the tokens counted and the forwards the
rows took part in; and the benchmark's prompts as token ids."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from r2lm import generate, workloads


@dataclass
class Decoded:
    """One batch's outputs: each row's generated tokens (up to and including its EOS), the tokens the decoder counts
    (r2lm's new_tokens: up to each row's stop), and the forwards the rows took part in (r2lm's row_steps; None for
    transformers)."""

    rows: list[list[int]]
    tokens: int
    forwards: int | None = None
    computed_rows: int | None = None  # rows summed over the model's forwards (threshold decoding: rows that left)
    batch_forwards: int | None = None  # forwards times the batch: what every row staying in every forward costs


def generated(sequences: torch.Tensor, prompt_len: int, eos: list[int], limit: int) -> list[list[int]]:
    """Each row's generated tokens, cut after its first EOS (what follows is padding)."""
    rows = []
    for row in sequences[:, prompt_len : prompt_len + limit].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:end])
    return rows


def r2lm_decoder(model, eos: list[int], pad: int, **options):
    def run(ids, mask, n, **extra):
        out = generate(model, ids, mask, max_new_tokens=n, eos_token_id=eos, pad_token_id=pad, **options, **extra)
        return Decoded(generated(out.sequences, ids.shape[1], eos, n), out.new_tokens, out.row_steps)

    return run


def threshold_decoder(model, eos: list[int], pad: int, **options):
    """Default (threshold) decoding, lossy: also counts the rows every forward of the model computes (finished rows
    leave the batch at the end of their block)."""
    def run(ids, mask, n, **extra):
        rows = []
        hook = model.model.register_forward_pre_hook(
            lambda module, args, kwargs: rows.append((args[0] if args and args[0] is not None
                                                      else kwargs["hidden_states"]).shape[0]), with_kwargs=True)
        try:
            out = generate(model, ids, mask, max_new_tokens=n, eos_token_id=eos, pad_token_id=pad, **options, **extra)
        finally:
            hook.remove()
        return Decoded(generated(out.sequences, ids.shape[1], eos, n), out.new_tokens, out.row_steps, sum(rows),
                       len(rows) * ids.shape[0])

    return run


def transformers_decoder(hf, eos: list[int], pad: int, **options):
    def run(ids, mask, n):
        seq = hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=eos,
                          pad_token_id=pad, **options)
        rows = generated(seq, ids.shape[1], eos, n)
        return Decoded(rows, sum(map(len, rows)))

    return run


def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def category_prompts(category: str, count: int, tokenizer, max_tokens: int) -> list[tuple[str, list[int]]]:
    """(id, token ids) of the first `count` prompts of `category` whose rendered text has at most `max_tokens`
    tokens."""
    limit = count
    while True:
        prompts = workloads.prompts_of(category, limit)
        picked = []
        for p in prompts:
            try:
                text = workloads.render(p, tokenizer)
            except ValueError as err:  # no chat template: a base model's tokenizer
                raise ValueError(f"{category} prompts: {err}; leave {category} out of --categories") from None
            ids = tokenizer(text, add_special_tokens=False).input_ids
            if 0 < len(ids) <= max_tokens:
                picked.append((p.id, ids))
                if len(picked) == count:
                    return picked
        if len(prompts) < limit:  # the category has no more
            raise ValueError(f"only {len(picked)} {category} prompts have at most {max_tokens} tokens "
                             f"(--max-prompt-tokens); {count} were asked for")
        limit *= 4

"""Documents as training reads them: tokenised (`encode`) and packed into sequences (`pack`), separated by the EOS
id `eos_id_of` chooses. One implementation, for the training pipeline (train/data.py) and for every evaluation that
must read text as training did."""

from __future__ import annotations


def encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each document, no special tokens added; text that spells a special token ("<|mask|>",
    "<|endoftext|>") gets ordinary tokens, so [MASK] and EOS ids only ever come from the pipeline itself."""
    # the tokenizer would take a list for a text pair, and fail on null with a message that names no document
    bad = next((t for t in texts if not isinstance(t, str)), "")
    if not isinstance(bad, str):
        raise ValueError(f"a document's text is {type(bad).__name__} {str(bad)[:60]!r}, not a string: every record's "
                         "text field must hold a string")
    return tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def pack(token_lists, eos_id: int, seq_len: int, carry: list[int] | None = None):
    """Append EOS to each non-empty document, concatenate (after `carry`), cut into seq_len pieces.

    Returns (sequences, leftover tokens)."""
    flat = list(carry or [])
    for ids in token_lists:
        if ids:
            flat.extend(ids)
            flat.append(eos_id)
    n = len(flat) // seq_len
    return [flat[i * seq_len : (i + 1) * seq_len] for i in range(n)], flat[n * seq_len :]


def eos_id_of(tokenizer, model_config) -> int:
    """The separator `pack` appends to every document: the tokenizer's EOS, else the model config's (the first of a
    list); ValueError when neither defines one."""
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = model_config.eos_token_id[0] if isinstance(model_config.eos_token_id, list) else model_config.eos_token_id
    if eos is None:
        raise ValueError("neither the tokenizer nor the model config defines an EOS token, which packing needs as separator")
    return int(eos)

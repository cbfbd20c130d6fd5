"""The options of one `generate()` call: defaults from the model's generation_config, overridden by keyword
arguments, every value checked (a ValueError naming the argument) before any forward runs.

Precedence, as in transformers: keyword arguments > the `generation_config` argument > `model.generation_config`
(the checkpoint's generation_config.json) > the defaults (r2lm.generation_config). The decoding options of a
diffusion decoder (block_size, one unmasking rule, confidence) are stored in generation_config.json next to
transformers' own keys (eos_token_id, pad_token_id, do_sample, temperature, top_k, top_p, max_new_tokens,
stop_strings).

A Request is option groups, each checked beside the code that uses it:

    prompt       Prompt       input_ids, attention_mask, suffix_ids                      here
    unmasking    Unmasking    block_size, one rule of r2lm.unmasking.RULES, confidence   r2lm.generation.sampling
    sampling     Sampling     temperature, top_k, top_p, do_sample, generator            r2lm.generation.sampling
    stopping     Stopping     eos / pad ids, stop_strings + tokenizer, criteria, streamer r2lm.generation.stopping
    caching      Caching      use_cache, compile, approximate_cache, prefix_cache, bicache r2lm.generation.contexts
    verifying    Verifying    verify, verify_windows, verify_draft, drafter, ngram,      r2lm.generation.verify
                              verify_policy, verify_siblings
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from r2lm.checks import positive_int
from r2lm.generation.contexts import Caching
from r2lm.generation.sampling import Sampling, Unmasking
from r2lm.generation.stopping import Stopping
from r2lm.generation.verify import Verifying
from r2lm.generation_config import DECODING_KEYS, DEFAULT_MAX_NEW_TOKENS, SHARED_KEYS
from r2lm.unmasking import RULES

# every keyword generate() takes, by group; and one per unmasking rule, read from RULES when a call is checked
OPTIONS = {
    "prompt": ("suffix_ids",), "length": ("max_new_tokens",), "unmasking": ("block_size", "confidence"),
    "sampling": ("temperature", "top_k", "top_p", "do_sample", "generator"),
    "stopping": ("eos_token_id", "pad_token_id", "stop_strings", "tokenizer", "stopping_criteria", "streamer"),
    "caching": ("use_cache", "compile", "approximate_cache", "prefix_cache", "bicache"),
    "verifying": ("verify", "verify_windows", "verify_draft", "drafter", "ngram", "verify_policy",
                  "verify_siblings"),
    "callback": ("step_callback",),
}


def options_of(generation_config: GenerationConfig | None) -> dict:
    """The options a GenerationConfig sets (keys it leaves at transformers' defaults are not set)."""
    if generation_config is None:
        return {}
    if not isinstance(generation_config, GenerationConfig):
        raise ValueError(f"generation_config must be a transformers GenerationConfig, got {type(generation_config).__name__}")
    diff = generation_config.to_diff_dict()
    return {k: diff[k] for k in (*DECODING_KEYS, *RULES, *SHARED_KEYS) if k in diff and diff[k] is not None}


def merge_options(model, generation_config, kwargs: dict) -> dict:
    """model.generation_config < generation_config < kwargs; a rule given at a level replaces the rules below."""
    merged = {}
    for level in (options_of(getattr(model, "generation_config", None)), options_of(generation_config), kwargs):
        if any(level.get(rule) is not None for rule in RULES):
            for rule in RULES:
                merged.pop(rule, None)
        merged.update(level)
    return merged


@dataclass(frozen=True)
class Prompt:
    """Left-padded prompts input_ids [B, P] (long) with attention_mask [B, P] (long, 1 = token), and the clean
    tokens suffix_ids [B, r] that follow the generated span when infilling ([B, 0] otherwise)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    suffix_ids: torch.Tensor

    @classmethod
    def of(cls, config, input_ids, attention_mask, suffix_ids, mask_id: int, max_new_tokens: int) -> Prompt:
        input_ids, attention_mask = _check_prompt(config, input_ids, attention_mask)
        longest = int(attention_mask.sum(1).max())
        if longest + max_new_tokens > config.max_position_embeddings:
            raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                             f"maximum length {config.max_position_embeddings}")
        real = attention_mask.bool()
        if (input_ids[real] == mask_id).any():
            row = int(torch.nonzero((input_ids == mask_id) & real)[0, 0])
            raise ValueError(f"the prompt of row {row} contains the mask token id {mask_id}")
        suffix = _check_suffix(config, suffix_ids, input_ids, mask_id)
        if longest + max_new_tokens + suffix.shape[1] > config.max_position_embeddings:
            raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) + suffix "
                             f"({suffix.shape[1]} tokens) exceeds the model's maximum length "
                             f"{config.max_position_embeddings}")
        return cls(input_ids, attention_mask, suffix)


@dataclass(frozen=True)
class Request:
    """The checked options of one generate() call, in groups (the module docstring)."""

    prompt: Prompt
    max_new_tokens: int
    mask_id: int
    unmasking: Unmasking
    sampling: Sampling
    stopping: Stopping
    caching: Caching
    verifying: Verifying
    step_callback: object = None

    @property
    def num_blocks(self) -> int:
        return -(-self.max_new_tokens // self.unmasking.block_size)


def make_request(model, input_ids, attention_mask=None, generation_config=None, **kwargs) -> Request:
    """Check every argument (ValueError naming the problem) and fill defaults (see the module docstring)."""
    known = {name for names in OPTIONS.values() for name in names} | set(RULES)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"unknown generate() option(s) {unknown}; known: {sorted(known)}")
    o = merge_options(model, generation_config, kwargs)
    config = model.config
    mask_id = config.mask_token_id
    if mask_id is None:
        raise ValueError("the model has no mask_token_id; set config.mask_token_id")
    max_new_tokens = positive_int("max_new_tokens", o.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
    prompt = Prompt.of(config, input_ids, attention_mask, o.get("suffix_ids"), mask_id, max_new_tokens)
    unmasking = Unmasking.of(o, config.block_size, max_new_tokens)
    sampling, stopping = Sampling.of(o), Stopping.of(o, config, mask_id)
    callback = o.get("step_callback")
    if callback is not None and not callable(callback):
        raise ValueError(f"step_callback must be callable, got {type(callback).__name__}")
    verifying = Verifying.of(o, config, unmasking.block_size, "block_size" in kwargs, max_new_tokens)
    caching = Caching.of(o, config.kind)
    return Request(prompt, max_new_tokens, mask_id, unmasking, sampling, stopping, caching, verifying, callback)


def _check_prompt(config, input_ids, attention_mask):
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a [batch, length] tensor of token ids")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.numel() == 0:
        raise ValueError(f"empty prompt: input_ids has shape {tuple(input_ids.shape)}")
    input_ids = input_ids.long()
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask {shape} does not match input_ids {tuple(input_ids.shape)}")
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    attention_mask = attention_mask.long()
    lengths = attention_mask.sum(1)
    if (lengths == 0).any():
        raise ValueError(f"row {int(torch.nonzero(lengths == 0)[0])} of the batch is all padding")
    if (attention_mask[:, 1:] < attention_mask[:, :-1]).any():
        raise ValueError("prompts must be left-padded (padding before the tokens, none after)")
    outside = (input_ids < 0) | (input_ids >= config.vocab_size)
    if outside.any():  # padding slots too: they are embedded (and then hidden), so they must be token ids
        row, col = (int(i) for i in torch.nonzero(outside)[0])
        where = "a padding position" if attention_mask[row, col] == 0 else "a prompt token"
        raise ValueError(f"input_ids holds token id {int(input_ids[row, col])} at {where} (row {row}, column {col}), "
                         f"outside the vocabulary [0, {config.vocab_size})")
    return input_ids, attention_mask


def _check_suffix(config, suffix, input_ids, mask_id) -> torch.Tensor:
    """Infilling: clean tokens [B, r] that follow the generated span (empty when None)."""
    if suffix is None:
        return input_ids.new_zeros(input_ids.shape[0], 0)
    if not isinstance(suffix, torch.Tensor) or suffix.dim() != 2 or suffix.shape[0] != input_ids.shape[0]:
        raise ValueError(f"suffix_ids must be a [batch, length] tensor with the batch of input_ids ({input_ids.shape[0]})")
    if suffix.dtype.is_floating_point or suffix.dtype == torch.bool:
        raise ValueError(f"suffix_ids must hold integer token ids, got dtype {suffix.dtype}")
    suffix = suffix.long().to(input_ids.device)
    if suffix.numel() and (int(suffix.min()) < 0 or int(suffix.max()) >= config.vocab_size or bool((suffix == mask_id).any())):
        raise ValueError(f"suffix_ids must hold token ids in [0, {config.vocab_size}) other than the mask id {mask_id}")
    return suffix

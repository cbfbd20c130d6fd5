"""The decoding options a checkpoint stores in generation_config.json, and their defaults.

A diffusion decoder's own options (block_size, one unmasking rule, confidence) sit in generation_config.json next
to transformers' keys (eos_token_id, pad_token_id, do_sample, temperature, top_k, top_p, max_new_tokens,
stop_strings). The model (its default generation_config), the checkpoint writers and `generate`
(r2lm.generation.options) all read them from here. Each unmasking rule is a key of its own, its name in the rule
table (r2lm.unmasking.RULES: threshold, factor, steps), exactly one applying.
"""

from __future__ import annotations

from transformers import GenerationConfig

from r2lm.unmasking import DEFAULT_RULE, RULES

DEFAULT_MAX_NEW_TOKENS = 128
# generation_config.json keys that are ours besides one per unmasking rule (RULES): transformers keeps unknown keys
# as attributes and saves them
DECODING_KEYS = ("block_size", "confidence")
# transformers' own keys that mean the same here
SHARED_KEYS = ("max_new_tokens", "eos_token_id", "pad_token_id", "do_sample", "temperature", "top_k", "top_p",
               "stop_strings")


def decoding_generation_config(model_config, base: GenerationConfig | None = None) -> GenerationConfig:
    """`base` (e.g. the source checkpoint's generation config; default: one from the model config) with the
    decoding defaults added where it has none: the model's block_size and the default rule (a confidence threshold
    of 0.9)."""
    config = GenerationConfig.from_dict(base.to_dict()) if base is not None else GenerationConfig.from_model_config(model_config)
    config._from_model_config = False  # it holds decoding options now: transformers drops those of a "from model" config
    if getattr(config, "block_size", None) is None:
        config.block_size = model_config.block_size
    if not any(getattr(config, rule, None) is not None for rule in RULES):
        setattr(config, *DEFAULT_RULE)
    if getattr(config, "confidence", None) is None:
        config.confidence = "max_prob"
    return config

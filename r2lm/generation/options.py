"""The options of one `generate()` call: defaults from the model's generation_config, overridden by keyword
arguments, every value checked (a ValueError naming the argument) before any forward runs.

Precedence, as in transformers: keyword arguments > the `generation_config` argument > `model.generation_config`
(the checkpoint's generation_config.json) > the defaults below. The decoding options of a diffusion decoder
(block_size, threshold, factor, steps, confidence) are stored in generation_config.json next to transformers' own
keys (eos_token_id, pad_token_id, do_sample, temperature, top_k, top_p, max_new_tokens, stop_strings).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig

from r2lm.generation.sampling import CONFIDENCES

DEFAULT_MAX_NEW_TOKENS = 128
DEFAULT_THRESHOLD = 0.9
RULES = ("threshold", "factor", "steps")  # unmasking rules: exactly one applies
VERIFY_DRAFTS = ("window", "lookup", "drafter", "lookup+drafter")  # what drafts under verify=True (generation.drafts)
# generation_config.json keys that are ours (transformers keeps unknown keys as attributes and saves them)
DECODING_KEYS = ("block_size", *RULES, "confidence")
# transformers' own keys that mean the same here
SHARED_KEYS = ("max_new_tokens", "eos_token_id", "pad_token_id", "do_sample", "temperature", "top_k", "top_p",
               "stop_strings")


def decoding_generation_config(model_config, base: GenerationConfig | None = None) -> GenerationConfig:
    """`base` (e.g. the source checkpoint's generation config; default: one from the model config) with the
    decoding defaults added where it has none: the model's block_size and a confidence threshold of 0.9."""
    config = GenerationConfig.from_dict(base.to_dict()) if base is not None else GenerationConfig.from_model_config(model_config)
    config._from_model_config = False  # it holds decoding options now: transformers drops those of a "from model" config
    if getattr(config, "block_size", None) is None:
        config.block_size = model_config.block_size
    if not any(getattr(config, rule, None) is not None for rule in RULES):
        config.threshold = DEFAULT_THRESHOLD
    if getattr(config, "confidence", None) is None:
        config.confidence = "max_prob"
    return config


def options_of(generation_config: GenerationConfig | None) -> dict:
    """The options a GenerationConfig sets (keys it leaves at transformers' defaults are not set)."""
    if generation_config is None:
        return {}
    if not isinstance(generation_config, GenerationConfig):
        raise ValueError(f"generation_config must be a transformers GenerationConfig, got {type(generation_config).__name__}")
    diff = generation_config.to_diff_dict()
    return {k: diff[k] for k in (*DECODING_KEYS, *SHARED_KEYS) if k in diff and diff[k] is not None}


def merge_options(model, generation_config, kwargs: dict) -> dict:
    """model.generation_config < generation_config < kwargs; a rule given at a level replaces the rules below."""
    merged = {}
    for level in (options_of(getattr(model, "generation_config", None)), options_of(generation_config), kwargs):
        if any(level.get(rule) is not None for rule in RULES):
            for rule in RULES:
                merged.pop(rule, None)
        merged.update(level)
    return merged


@dataclass
class Request:
    """The checked arguments of one generate() call."""

    input_ids: torch.Tensor  # [B, P] long, left-padded
    attention_mask: torch.Tensor  # [B, P] long, 1 = token
    max_new_tokens: int
    block_size: int
    threshold: float | None
    factor: float | None
    steps: int | None
    confidence: str
    temperature: float
    top_k: int | None
    top_p: float | None
    generator: torch.Generator | None
    mask_id: int
    pad_id: int
    eos_ids: list[int]
    use_cache: bool
    compile: bool
    verify: bool
    verify_windows: int | None  # verify=True: drafting windows per verification forward (None: block_size + 1)
    verify_draft: str  # verify=True: what drafts (VERIFY_DRAFTS; r2lm.generation.drafts)
    drafter: object | None  # verify=True: an r2lm.drafter.Drafter for the model
    approximate_cache: str | None
    prefix_cache: object | None
    bicache: object | None
    suffix_ids: torch.Tensor | None = None  # [B, r] clean tokens after the generated span (infilling)
    stop_strings: list[str] = field(default_factory=list)
    tokenizer: object = None
    stopping_criteria: list = field(default_factory=list)
    streamer: object = None
    step_callback: object = None

    @property
    def num_blocks(self) -> int:
        return -(-self.max_new_tokens // self.block_size)


def make_request(model, input_ids, attention_mask=None, generation_config=None, **kwargs) -> Request:
    """Check every argument (ValueError naming the problem) and fill defaults (see the module docstring)."""
    known = set(Request.__dataclass_fields__) - {"input_ids", "attention_mask", "mask_id", "pad_id", "eos_ids"}
    known |= {"eos_token_id", "pad_token_id", "do_sample"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"unknown generate() option(s) {unknown}; known: {sorted(known)}")
    o = merge_options(model, generation_config, kwargs)
    config = model.config
    input_ids, attention_mask = _check_prompt(config, input_ids, attention_mask)

    max_new_tokens = _positive_int("max_new_tokens", o.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
    longest = int(attention_mask.sum(1).max())
    if longest + max_new_tokens > config.max_position_embeddings:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's maximum length "
            f"{config.max_position_embeddings}"
        )
    block_size = _positive_int("block_size", o.get("block_size", config.block_size))

    given = [rule for rule in RULES if o.get(rule) is not None]
    if len(given) > 1:
        raise ValueError(f"give at most one unmasking rule among {RULES}, got {given}")
    threshold = DEFAULT_THRESHOLD if not given else o.get("threshold")
    factor, steps = o.get("factor"), o.get("steps")
    if threshold is not None and not (_real(threshold) and 0 < threshold <= 1):
        raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
    if factor is not None and not (_real(factor) and factor > 0):
        raise ValueError(f"factor must be a positive number, got {factor!r}")
    num_blocks = -(-max_new_tokens // block_size)
    if steps is not None:
        steps = _positive_int("steps", steps)
        if steps % num_blocks:
            raise ValueError(f"steps ({steps}) must be a multiple of the number of blocks ({num_blocks}: "
                             f"max_new_tokens {max_new_tokens} in blocks of {block_size}), as in LLaDA")
    confidence = o.get("confidence", "max_prob")
    if confidence not in CONFIDENCES:
        raise ValueError(f"unknown confidence {confidence!r}; expected one of {CONFIDENCES}")

    temperature, top_k, top_p = _sampling(o)
    generator = o.get("generator")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")

    eos = _token_list("eos_token_id", o.get("eos_token_id", config.eos_token_id), config.vocab_size)
    pad_id = o.get("pad_token_id", config.pad_token_id)
    if pad_id is None:
        pad_id = eos[0] if eos else 0
    pad_id = _token_list("pad_token_id", pad_id, config.vocab_size)[0]
    mask_id = config.mask_token_id
    if mask_id is None:
        raise ValueError("the model has no mask_token_id; set config.mask_token_id")
    if mask_id in eos:  # every [MASK] still to decode would read as an EOS
        raise ValueError(f"eos_token_id includes the mask token id {mask_id}")
    real = attention_mask.bool()
    if (input_ids[real] == mask_id).any():
        row = int(torch.nonzero((input_ids == mask_id) & real)[0, 0])
        raise ValueError(f"the prompt of row {row} contains the mask token id {mask_id}")

    stop_strings = o.get("stop_strings") or []
    if isinstance(stop_strings, str):
        stop_strings = [stop_strings]
    if not all(isinstance(s, str) and s for s in stop_strings):
        raise ValueError(f"stop_strings must be non-empty strings, got {stop_strings!r}")
    tokenizer = o.get("tokenizer")
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need the tokenizer (pass tokenizer=...)")
    criteria = o.get("stopping_criteria") or []
    if callable(criteria):
        criteria = [criteria]
    if not all(callable(c) for c in criteria):
        raise ValueError("stopping_criteria must be transformers StoppingCriteria (callables returning a bool per row)")
    callback = o.get("step_callback")
    if callback is not None and not callable(callback):
        raise ValueError(f"step_callback must be callable, got {type(callback).__name__}")

    suffix = _check_suffix(config, o.get("suffix_ids"), input_ids, mask_id)
    if longest + max_new_tokens + suffix.shape[1] > config.max_position_embeddings:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) + suffix ({suffix.shape[1]} "
                         f"tokens) exceeds the model's maximum length {config.max_position_embeddings}")
    use_cache, compile_, verify = (bool(o.get(k, default)) for k, default in
                                   (("use_cache", True), ("compile", False), ("verify", False)))
    verify_windows = o.get("verify_windows")
    if verify_windows is not None:
        if not verify:
            raise ValueError("verify_windows sets how verify=True drafts; pass verify=True")
        if not (isinstance(verify_windows, int) and 2 <= verify_windows <= block_size + 1):
            raise ValueError(f"verify_windows must be an int in [2, block_size + 1] = [2, {block_size + 1}], "
                             f"got {verify_windows!r}")
    drafter = o.get("drafter")
    verify_draft = o.get("verify_draft") or ("lookup+drafter" if drafter is not None else "window")
    if verify_draft not in VERIFY_DRAFTS:
        raise ValueError(f"verify_draft must be one of {VERIFY_DRAFTS}, got {verify_draft!r}")
    if (verify_draft != "window" or drafter is not None) and not verify:
        raise ValueError("verify_draft and drafter set how verify=True drafts; pass verify=True")
    if verify_draft != "window" and verify_windows is not None:
        raise ValueError(f"verify_windows counts drafting windows; verify_draft={verify_draft!r} drafts without any")
    if ("drafter" in verify_draft) != (drafter is not None):
        raise ValueError(f"verify_draft={verify_draft!r} " + ("needs a drafter (drafter=...)" if drafter is None else
                         "does not use the drafter given: use verify_draft='drafter' or 'lookup+drafter'"))
    if drafter is not None:
        _check_drafter(drafter, config)
        if "block_size" not in kwargs:  # the drafter's own draft length, unless asked otherwise
            block_size = drafter.config.block_size
    if verify and block_size > max_new_tokens:  # a draft past the last new token is never verified: cut it
        block_size = max_new_tokens
        verify_windows = None if verify_windows is None else min(verify_windows, block_size + 1)
    approximate_cache, prefix_cache, bicache = o.get("approximate_cache"), o.get("prefix_cache"), o.get("bicache")
    if approximate_cache not in (None, "prefix", "dual"):
        raise ValueError(f"approximate_cache must be None, 'prefix' or 'dual', got {approximate_cache!r}")
    if approximate_cache and config.attention != "bidirectional":
        raise ValueError("approximate_cache is for bidirectional models; causal and block_causal models have an exact cache")
    if prefix_cache is not None:
        _check_prefix_cache(prefix_cache, config, use_cache)
    if bicache is not None:
        _check_bicache(bicache, config, approximate_cache)
    if compile_ and (not use_cache or config.attention == "bidirectional"):
        raise ValueError("compile=True compiles the cached decode step: it needs use_cache=True and a causal or "
                         "block_causal model")
    return Request(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, block_size=block_size,
        threshold=threshold, factor=factor, steps=steps, confidence=confidence,
        temperature=temperature, top_k=top_k, top_p=top_p, generator=generator, mask_id=mask_id, pad_id=pad_id,
        eos_ids=eos, use_cache=use_cache, compile=compile_, verify=verify, verify_windows=verify_windows,
        verify_draft=verify_draft, drafter=drafter,
        approximate_cache=approximate_cache,
        prefix_cache=prefix_cache, bicache=bicache, suffix_ids=suffix, stop_strings=stop_strings, tokenizer=tokenizer,
        stopping_criteria=criteria, streamer=o.get("streamer"), step_callback=callback,
    )


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


def _sampling(o: dict) -> tuple[float, int | None, float | None]:
    """(temperature, top_k, top_p); temperature 0 is greedy. transformers' do_sample=False means greedy whatever
    the temperature; do_sample=True samples with transformers' defaults (temperature 1, top_k 50)."""
    do_sample = o.get("do_sample")
    if do_sample is False:
        return 0.0, None, None
    default_temperature, default_top_k = (1.0, 50) if do_sample else (0.0, None)
    temperature = o.get("temperature", default_temperature)
    top_k, top_p = o.get("top_k", default_top_k), o.get("top_p")
    if not (_real(temperature) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if do_sample and temperature == 0:
        raise ValueError("do_sample=True needs a temperature > 0")
    if top_k is not None:
        top_k = _positive_int("top_k", top_k)
    if top_p is not None and not (_real(top_p) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    return float(temperature), top_k, None if top_p is None or top_p == 1.0 else float(top_p)


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not math.isnan(x)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _token_list(name: str, ids, vocab_size: int) -> list[int]:
    ids = [] if ids is None else [ids] if isinstance(ids, numbers.Integral) else list(ids)
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < vocab_size:
            raise ValueError(f"{name} {i!r} is not a token id in the vocabulary [0, {vocab_size})")
    return [int(i) for i in ids]


def _check_drafter(drafter, config) -> None:
    from r2lm.drafter import Drafter

    if not isinstance(drafter, Drafter):
        raise ValueError(f"drafter must be an r2lm.drafter.Drafter, got {type(drafter).__name__}")
    drafter.check_target(config)


def _check_prefix_cache(prefix_cache, config, use_cache: bool) -> None:
    from r2lm.prefix.cache import PrefixCache

    if not isinstance(prefix_cache, PrefixCache):
        raise ValueError(f"prefix_cache must be an r2lm.prefix.PrefixCache, got {type(prefix_cache).__name__}")
    if not use_cache or config.attention == "bidirectional":
        raise ValueError("prefix_cache reuses exact keys: it needs use_cache=True and a causal or block_causal model")


def _check_bicache(bicache, config, approximate_cache) -> None:
    from r2lm.prefix.bicache import BiCache

    if not isinstance(bicache, BiCache):
        raise ValueError(f"bicache must be an r2lm.prefix.BiCache, got {type(bicache).__name__}")
    if config.attention != "bidirectional":
        raise ValueError("bicache is the approximate shallow-layer prefix reuse of bidirectional models; causal and "
                         "block_causal models reuse exact keys with prefix_cache")
    if approximate_cache is not None:
        raise ValueError("bicache runs in the no-cache bidirectional decoder; it does not combine with approximate_cache")

"""Per-step choices of a parallel decoder, vectorised over rows: what token each masked position would take and
how confident the model is in it (which positions to unmask now: the rules of r2lm.unmasking).

The proposal is the most likely token other than [MASK] (or a sample without it); its confidence comes from the
model's unmodified softmax p, [MASK] included, as LLaDA's and Fast-dLLM's samplers compute it:
    max_prob   p(x0)                         (Fast-dLLM, LLaDA's low_confidence)
    margin     p(top1) - p(top2), over the tokens other than [MASK]   (Dream's topk_margin)
    entropy    exp(-H(p))                    (a monotone map of negative entropy: same ranking, 1 for a sure token)
all in [0, 1], so one threshold fits every measure.

The generate() options that choose them are checked here: `Unmasking` (block_size, one rule of the table
r2lm.unmasking.RULES with its value, confidence) and `Sampling` (temperature, top_k, top_p, do_sample, generator).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from r2lm.checks import positive_int, real
from r2lm.unmasking import DEFAULT_RULE, RULES

CONFIDENCES = ("max_prob", "margin", "entropy")


@dataclass(frozen=True)
class Unmasking:
    """How a denoising step unmasks: exactly one rule of RULES with its value, positions ranked by `confidence`, in
    blocks of `block_size` generated tokens."""

    block_size: int
    rule: str = DEFAULT_RULE[0]
    value: object = DEFAULT_RULE[1]
    confidence: str = "max_prob"

    @classmethod
    def of(cls, options: dict, model_block_size: int, max_new_tokens: int) -> Unmasking:
        block_size = positive_int("block_size", options.get("block_size", model_block_size))
        given = [rule for rule in RULES if options.get(rule) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one unmasking rule among {tuple(RULES)}, got {given}")
        rule, value = (given[0], options[given[0]]) if given else DEFAULT_RULE
        value = RULES[rule].check(value, block_size, max_new_tokens)
        confidence = options.get("confidence", "max_prob")
        if confidence not in CONFIDENCES:
            raise ValueError(f"unknown confidence {confidence!r}; expected one of {CONFIDENCES}")
        return cls(block_size, rule, value, confidence)

    def plan(self, masked: torch.Tensor, num_blocks: int):
        """The rule's plan for a block whose masked positions are `masked` [B, L] (what `select` reads)."""
        return RULES[self.rule].plan(self.value, masked, num_blocks)


@dataclass(frozen=True)
class Sampling:
    """How a proposal is drawn: greedy at temperature 0, else sampled after top-k and nucleus (top-p) filtering."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    generator: torch.Generator | None = None

    @classmethod
    def of(cls, options: dict) -> Sampling:
        temperature, top_k, top_p = _filters(options)
        generator = options.get("generator")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        return cls(temperature, top_k, top_p, generator)


def _filters(options: dict) -> tuple[float, int | None, float | None]:
    """(temperature, top_k, top_p). transformers' do_sample=False means greedy whatever the temperature;
    do_sample=True samples with transformers' defaults (temperature 1, top_k 50)."""
    do_sample = options.get("do_sample")
    if do_sample is False:
        return 0.0, None, None
    default_temperature, default_top_k = (1.0, 50) if do_sample else (0.0, None)
    temperature = options.get("temperature", default_temperature)
    top_k, top_p = options.get("top_k", default_top_k), options.get("top_p")
    if not (real(temperature) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if do_sample and temperature == 0:
        raise ValueError("do_sample=True needs a temperature > 0")
    if top_k is not None:
        top_k = positive_int("top_k", top_k)
    if top_p is not None and not (real(top_p) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    return float(temperature), top_k, None if top_p is None or top_p == 1.0 else float(top_p)


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
                  exclude: int | None = None) -> torch.Tensor:
    """A new tensor: the logits with token `exclude` removed, then temperature, top-k and nucleus (top-p)
    filtering; filtered entries become -inf."""
    logits = logits.float() / (temperature if temperature > 0 else 1.0)
    if exclude is not None:
        logits[..., exclude] = float("-inf")
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def propose(logits: torch.Tensor, mask_id: int, temperature: float = 0.0, top_k=None, top_p=None,
            confidence: str = "max_prob", generator: torch.Generator | None = None):
    """logits [B, L, V] -> (tokens [B, L], confidence [B, L]): greedy when temperature == 0, else sampled; never
    [MASK]. The logits are not modified (no copy of them is made on the greedy path)."""
    probs = logits.float().softmax(-1)
    if confidence == "entropy":  # of the whole distribution, before [MASK] is set aside
        conf = torch.exp((probs * torch.log(probs.clamp_min(1e-30))).sum(-1))
    probs[..., mask_id] = 0  # our own tensor: [MASK] leaves the argmax (and the sampler) only
    if temperature > 0:
        sampling = filter_logits(logits, temperature, top_k, top_p, exclude=mask_id)
        tokens = torch.multinomial(sampling.softmax(-1).flatten(0, 1), 1, generator=generator).view(probs.shape[:2])
    else:
        tokens = probs.argmax(-1)
    if confidence == "max_prob":
        conf = probs.gather(-1, tokens[..., None])[..., 0]
    elif confidence == "margin":
        top2 = probs.topk(2, dim=-1).values
        conf = top2[..., 0] - top2[..., 1]
    elif confidence != "entropy":
        raise ValueError(f"unknown confidence {confidence!r}; expected one of {CONFIDENCES}")
    return tokens, conf

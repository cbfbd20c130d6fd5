"""Per-step choices of a parallel decoder, vectorised over rows: what token each masked position would take,
how confident the model is in it, and which positions to unmask now.

Confidence (higher = surer), all in [0, 1] so one threshold fits every measure:
    max_prob   p(x0)                         (Fast-dLLM, LLaDA's low_confidence)
    margin     p(top1) - p(top2)             (Dream's topk_margin)
    entropy    exp(-H(p))                    (a monotone map of negative entropy: same ranking, 1 for a sure token)

Unmasking rules (each takes at least one token per row that still has a [MASK]):
    threshold  every masked position with confidence >= threshold (Fast-dLLM)
    factor     the n most confident, for the largest n whose n-th confidence >= 1 - factor / (n + 1) (Fast-dLLM)
    fixed k    the k most confident (LLaDA)
"""

from __future__ import annotations

import torch

CONFIDENCES = ("max_prob", "margin", "entropy")


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Temperature, then top-k, then nucleus (top-p) filtering; filtered entries become -inf."""
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def propose(logits: torch.Tensor, temperature: float = 0.0, top_k=None, top_p=None, confidence: str = "max_prob",
            generator: torch.Generator | None = None):
    """logits [B, L, V] -> (tokens [B, L], confidence [B, L]): greedy when temperature == 0, else sampled.

    Confidence is measured on the model's own distribution, not the sampler's truncated one: it says how sure the
    model is of the token, which top-k / top-p filtering must not inflate."""
    probs = logits.float().softmax(-1)
    if temperature > 0:
        sampling = filter_logits(logits, temperature, top_k, top_p).softmax(-1).flatten(0, 1)
        tokens = torch.multinomial(sampling, 1, generator=generator).view(probs.shape[:2])
    else:
        tokens = probs.argmax(-1)
    if confidence == "max_prob":
        conf = probs.gather(-1, tokens[..., None])[..., 0]
    elif confidence == "margin":
        top2 = probs.topk(2, dim=-1).values
        conf = top2[..., 0] - top2[..., 1]
    elif confidence == "entropy":
        conf = torch.exp((probs * torch.log(probs.clamp_min(1e-30))).sum(-1))
    else:
        raise ValueError(f"unknown confidence {confidence!r}; expected one of {CONFIDENCES}")
    return tokens, conf


def select(conf: torch.Tensor, masked: torch.Tensor, threshold=None, factor=None, tokens_per_step=None) -> torch.Tensor:
    """Which masked positions to unmask: bool [B, L]. Exactly one rule among threshold / factor / tokens_per_step."""
    scores = conf.masked_fill(~masked, float("-inf"))
    order = scores.argsort(dim=-1, descending=True, stable=True)
    rank = order.argsort(dim=-1)  # rank[b, j]: 0 for the most confident masked position of row b
    n_masked = masked.sum(-1, keepdim=True)
    if threshold is not None:
        take = rank.lt(1) | (scores >= threshold)
    else:
        if factor is not None:
            ranked = scores.gather(-1, order)
            n = torch.arange(1, conf.shape[-1] + 1, device=conf.device)
            passing = (ranked >= 1 - factor / (n + 1)).long().cumprod(-1).sum(-1, keepdim=True)
            k = passing.clamp(min=1)
        else:
            k = torch.full_like(n_masked, tokens_per_step)
        take = rank < k
    return take & masked

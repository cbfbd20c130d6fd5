"""Per-step choices of a parallel decoder, vectorised over rows: what token each masked position would take,
how confident the model is in it, and which positions to unmask now.

The proposal is the most likely token other than [MASK] (or a sample without it); its confidence comes from the
model's unmodified softmax p, [MASK] included, as LLaDA's and Fast-dLLM's samplers compute it:
    max_prob   p(x0)                         (Fast-dLLM, LLaDA's low_confidence)
    margin     p(top1) - p(top2), over the tokens other than [MASK]   (Dream's topk_margin)
    entropy    exp(-H(p))                    (a monotone map of negative entropy: same ranking, 1 for a sure token)
all in [0, 1], so one threshold fits every measure.

Unmasking rules (each takes at least one token per row that still has a [MASK]):
    threshold  every masked position with confidence >= threshold (Fast-dLLM)
    factor     the n most confident, for the largest n whose n-th confidence >= 1 - factor / (n + 1) (Fast-dLLM)
    steps      LLaDA's schedule: a block's steps share its masked tokens evenly, the first (m mod s) steps taking
               one more (`schedule`), the most confident first
"""

from __future__ import annotations

import torch

CONFIDENCES = ("max_prob", "margin", "entropy")


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


def schedule(masked: torch.Tensor, steps: int) -> torch.Tensor:
    """LLaDA's get_num_transfer_tokens: tokens to unmask at each of `steps` steps, [B, steps], from each row's
    masked positions masked [B, L]: m // steps each, and one more in the first m % steps steps."""
    m = masked.sum(-1, keepdim=True)
    first = torch.arange(steps, device=masked.device) < (m % steps)
    return m // steps + first.long()


def select(conf: torch.Tensor, masked: torch.Tensor, threshold=None, factor=None, counts=None) -> torch.Tensor:
    """Which masked positions to unmask: bool [B, L]. Exactly one rule among threshold / factor / counts (tokens
    per row, [B], from `schedule`)."""
    scores = conf.masked_fill(~masked, float("-inf"))
    if threshold is not None:  # the surest position of each row always goes, and every other that passes
        best = torch.arange(scores.shape[-1], device=scores.device) == scores.argmax(-1, keepdim=True)
        return (best | (scores >= threshold)) & masked
    order = scores.argsort(dim=-1, descending=True, stable=True)
    rank = order.argsort(dim=-1)  # rank[b, j]: 0 for the most confident masked position of row b
    if factor is not None:
        ranked = scores.gather(-1, order)
        n = torch.arange(1, conf.shape[-1] + 1, device=conf.device)
        passing = (ranked >= 1 - factor / (n + 1)).long().cumprod(-1).sum(-1, keepdim=True)
        k = passing.clamp(min=1)
    else:
        k = counts[:, None]
    return (rank < k) & masked

"""Training objectives (docs/design.md section 3).

Each objective maps a batch of clean token ids x0 [B, L] (packed text, optional padding mask) to a scalar
loss, drawing its noise from a `torch.Generator` so that a run can be replayed exactly.

Normalisation. With per-token mask probability p, the masked-diffusion ELBO weights the cross-entropy of each
masked token by 1 / p; both diffusion objectives sum those weighted terms and divide by the number of tokens
that *could* have been masked (real tokens, not separators, inside noised blocks). That is an unbiased estimate
of the per-token negative ELBO, comparable across batch compositions and equal in scale to the AR loss. The AR
loss is the mean next-token cross-entropy over predicted real tokens.

Certainty forcing (`certainty`, after dParallel; docs/notes/parallelism.md section 2) trains a block model to be
confident where it is already right, so that a confidence threshold accepts many tokens per denoising step: the
block objective's dual stream with complementary masks (both views scored; every noised token is predicted once),
plus `entropy_weight` x the entropy of softmax(logits / temperature) at the masked positions whose argmax equals
the target, and nowhere else. Its CE is the plain mean over masked tokens: the two views partition the tokens, so
each counts once, while 1 / p weights would let whichever view masked a token decide its weight (up to 1 / eps).

What never carries a loss: padding; separator tokens (they are never masked: they are context, not content);
the clean stream; the first block of the `block` objective (context only); under AR, the position whose input
is a separator (the next document's first token is not predictable from the previous document).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from r2lm.kind import ATTENTION
from r2lm.layout import dual_stream

OBJECTIVES = ("ar", "mdlm", "block", "certainty")
# what each objective needs of the attention kind (r2lm.kind.Attention): ar a token-causal one (a clean pass
# predicts each next token); mdlm's single noisy stream one without streams (under causal attention a masked token
# would see nothing to its right); block and certainty the streams of a layout decoding can cache.
FITS = {"ar": lambda rule: rule.token_causal, "mdlm": lambda rule: not rule.streams,
        "block": lambda rule: rule.streams, "certainty": lambda rule: rule.streams}


@dataclass
class Loss:
    loss: torch.Tensor  # scalar to backpropagate
    tokens: int  # tokens the loss is normalised by (denominator)
    masked: int  # tokens that received a loss term

    def metrics(self) -> dict[str, torch.Tensor]:
        """Named scalar parts of the loss that a training run logs beside it (none for most objectives)."""
        return {}


@dataclass
class CertaintyLoss(Loss):
    ce: torch.Tensor | None = None  # mean cross-entropy over masked tokens (both views), detached
    entropy: torch.Tensor | None = None  # mean tempered entropy over the masked tokens already right, detached
    right_fraction: torch.Tensor | None = None  # masked tokens whose argmax equals the target / masked tokens

    def metrics(self) -> dict[str, torch.Tensor]:
        return {"ce": self.ce, "entropy": self.entropy, "right_fraction": self.right_fraction}


def check_objective(name: str, config) -> None:
    """Reject an objective that does not fit the model, before any work starts."""
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; expected one of {OBJECTIVES}")
    if not FITS[name](config.kind.attention):
        fitting = tuple(kind for kind, rule in ATTENTION.items() if FITS[name](rule))
        raise ValueError(f"objective {name!r} does not fit a {config.attention!r} model (it needs attention in "
                         f"{fitting})")
    if name == "ar" and not config.kind.shift:
        raise ValueError("objective 'ar' needs prediction='shift' (the hidden state at i-1 predicts token i)")
    if name != "ar" and config.mask_token_id is None:
        raise ValueError(f"objective {name!r} needs config.mask_token_id")


def _eligible(x0, attention_mask, separator_id):
    ok = torch.ones_like(x0, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    if separator_id is not None:
        ok = ok & (x0 != separator_id)
    return ok


def _mask_probability(t, eps):
    return (1 - eps) * t + eps


def ar_loss(model, x0, attention_mask=None, separator_id=None, generator=None, config=None) -> Loss:
    logits = model(x0, attention_mask=attention_mask).logits[:, :-1]
    target = x0[:, 1:]
    keep = _eligible(x0, attention_mask, None)[:, 1:]
    if separator_id is not None:
        keep = keep & (x0[:, :-1] != separator_id)
    ce = F.cross_entropy(logits[keep].float(), target[keep], reduction="sum")
    n = int(keep.sum())
    return Loss(ce / max(n, 1), n, n)


def mdlm_loss(model, x0, attention_mask=None, separator_id=None, generator=None, config=None, eps=1e-3) -> Loss:
    """LLaDA: t ~ U(0, 1) per sample, p = (1 - eps) t + eps, tokens masked i.i.d. with p, loss = CE / p."""
    config = config or model.config
    eligible = _eligible(x0, attention_mask, separator_id)
    if config.kind.shift:
        eligible[:, 0] = False  # nothing predicts position 0
    t = torch.rand(x0.shape[0], 1, generator=generator, device=x0.device)
    p = _mask_probability(t, eps).expand_as(x0)
    masked = eligible & (torch.rand(x0.shape, generator=generator, device=x0.device) < p)
    xt = torch.where(masked, torch.full_like(x0, config.mask_token_id), x0)
    logits = model(xt, attention_mask=attention_mask).logits
    if config.kind.shift:
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)  # column i now holds the prediction of token i
    ce = F.cross_entropy(logits[masked].float(), x0[masked], reduction="none")
    n = int(eligible.sum())
    return Loss((ce / p[masked]).sum() / max(n, 1), n, int(masked.sum()))


def block_noise(x0, config, attention_mask=None, separator_id=None, generator=None, eps=1e-3, complementary=False):
    """The noise of the block objective: one t per (sample, block), masks i.i.d. inside the block.

    Returns (eligible [B, L], copies): `copies` holds (masked [B, L], p [B, L]) once, or twice with
    `complementary` (the second masks exactly the other eligible tokens, with p' = 1 - p). Block 0 is context."""
    b, (batch, length) = config.block_size, x0.shape
    if length <= b:
        raise ValueError(f"the block objective needs sequences longer than one block ({b}), got {length}")
    eligible = _eligible(x0, attention_mask, separator_id)
    eligible[:, :b] = False  # block 0 is context
    block_of = torch.arange(length, device=x0.device) // b
    t = torch.rand(batch, int(block_of[-1]) + 1, generator=generator, device=x0.device)
    p = _mask_probability(t, eps)
    if complementary:
        p = p.clamp(max=1 - eps)
    p = p[:, block_of]
    masked = eligible & (torch.rand(x0.shape, generator=generator, device=x0.device) < p)
    copies = [(masked, p)]
    if complementary:
        copies.append((eligible & ~masked, 1 - p))
    return eligible, copies


def noised_dual_stream(x0, masked, config):
    """x0 with the `masked` tokens replaced by [MASK], on the dual-stream layout: (input_ids, layout, target)."""
    xt = torch.where(masked, torch.full_like(x0, config.mask_token_id), x0)
    return dual_stream(x0, xt, config.block_size, config.prediction)


def masked_window_logits(model, x0, masked, config):
    """One dual-stream forward of x0 with the `masked` tokens replaced by [MASK]: the logits [N, V] that predict
    the N masked tokens, and their (rows, positions) in x0, in the same order."""
    inputs, layout, target = noised_dual_stream(x0, masked, config)
    cols = target >= 0
    # [B, W, V]: window column j predicts x0[target[j]]; the clean stream needs no logits
    logits = model(inputs, layout=layout, logits_to_keep=torch.nonzero(cols).flatten()).logits
    tgt = target[cols]
    sel = masked[:, tgt]
    rows, columns = torch.nonzero(sel, as_tuple=True)
    return logits[sel], (rows, tgt[columns])


def block_loss(
    model, x0, attention_mask=None, separator_id=None, generator=None, config=None, eps=1e-3, complementary=False
) -> Loss:
    """Block diffusion on the dual-stream layout: one t per (sample, block), masks i.i.d. inside the block.

    With `complementary`, a second copy masks exactly the other tokens (t' = 1 - t) so every token of a noised
    block gets a loss term in one of the two; its ELBO weight is 1 / (1 - p). p is then kept in [eps, 1 - eps]."""
    config = config or model.config
    eligible, copies = block_noise(x0, config, attention_mask, separator_id, generator, eps, complementary)
    total, n_masked = 0.0, 0
    for m, prob in copies:
        logits, where = masked_window_logits(model, x0, m, config)
        ce = F.cross_entropy(logits.float(), x0[where], reduction="none")
        total = total + (ce / prob[where]).sum()
        n_masked += len(ce)
    n = int(eligible.sum()) * len(copies)
    return Loss(total / max(n, 1), n, n_masked)


def tempered_entropy(logits, target, temperature):
    """The entropy of softmax(logits / temperature) [N] at the rows of `logits` [N, V] whose argmax equals `target`
    [N], and those rows (bool [N]). Rows whose argmax is wrong are left out, so they get no gradient from it."""
    right = logits.detach().argmax(dim=-1) == target
    logp = F.log_softmax(logits[right].float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1), right


def certainty_loss(model, x0, attention_mask=None, separator_id=None, generator=None, config=None, eps=1e-3,
                   entropy_weight=2.0, temperature=0.5) -> CertaintyLoss:
    """Certainty forcing (dParallel): masked CE over two complementary views of each sequence, plus
    `entropy_weight` x the mean tempered entropy over the masked tokens whose argmax is already the target."""
    if temperature <= 0:
        raise ValueError(f"certainty forcing needs temperature > 0, got {temperature}")
    config = config or model.config
    _, copies = block_noise(x0, config, attention_mask, separator_id, generator, eps, complementary=True)
    ce_sum = entropy_sum = 0.0
    n_masked = n_right = 0
    for masked, _ in copies:
        logits, where = masked_window_logits(model, x0, masked, config)
        target = x0[where]
        entropy, right = tempered_entropy(logits, target, temperature)
        ce_sum = ce_sum + F.cross_entropy(logits.float(), target, reduction="sum")
        entropy_sum = entropy_sum + entropy.sum()
        n_masked += len(target)
        n_right += int(right.sum())
    ce, entropy = ce_sum / max(n_masked, 1), entropy_sum / max(n_right, 1)
    return CertaintyLoss(
        ce + entropy_weight * entropy, n_masked, n_masked, ce=ce.detach(), entropy=entropy.detach(),
        right_fraction=torch.tensor(n_right / max(n_masked, 1), device=x0.device),
    )


def noise_seed(*parts: int) -> int:
    """A generator seed from integers (seed, step, micro-step, rank): the noise is replayed exactly on resume, and an
    evaluation that seeds its batches the same way draws the noise training's held-out evaluation drew."""
    digest = hashlib.sha256("/".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def compute_loss(name: str, model, x0, attention_mask=None, separator_id=None, generator=None, config=None, **options) -> Loss:
    """Objective `name` on x0 [B, L]. `model` may be a wrapper (a DeepSpeed engine): pass the R2LMConfig then."""
    fn = {"ar": ar_loss, "mdlm": mdlm_loss, "block": block_loss, "certainty": certainty_loss}[name]
    return fn(model, x0, attention_mask=attention_mask, separator_id=separator_id, generator=generator, config=config, **options)

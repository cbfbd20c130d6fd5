"""Likelihood scoring of every r2lm variant: masked-token cross-entropy, LLaDA's Monte-Carlo ELBO of an answer
after a context, exact next-token log-likelihood, and greedy reproduction (lm-eval's is_greedy).

How a model is scored (`mode`, see `eval_mode`):

    ar      causal attention, shift prediction, trained with the `ar` objective (the AR baseline)
    block   causal / block_causal diffusion models (R2LM, causal dLLM, frozen-backbone R2LM): the dual-stream
            block layout of training and decoding (docs/design.md 2.1)
    single  bidirectional models (LLaDA-style mdlm): one noisy stream, every position sees every position

Multiple choice (`score_choices`, `answer_loglikelihood`): log p(answer | context). Diffusion variants use
LLaDA's Monte-Carlo estimator (ML-GSAI/LLaDA `get_log_likelihood.py`): draw a mask count x in {1..n}
(stratified over the rows of a batch), mask x answer tokens uniformly at random, and sum the log-probabilities
of the masked tokens weighted by n / x; the mean over `mc_num` samples estimates the masked-diffusion ELBO of the
answer (a lower bound on its log-likelihood). The answer follows the context in the layout the model decodes
with: block models put it in windows of `block_size` tokens after the clean context (the windows of `generate`:
each sees the context and the clean earlier answer blocks; the count is drawn per block, which is the ELBO of
the block factorisation), single-stream models mask it in one noisy stream after the context. The AR variant
uses the exact next-token log-likelihood. Answers whose blocks are all one token long need one sample (exact).
Block models encode the context once per question (`ContextCache`: its KV cache replicated over the rows of a
Monte-Carlo batch and shared by the choices; tested equal to the full layout), so a sample costs about two
answer lengths of tokens, not the context. `greedy_reproduces` gives lm-eval's is_greedy through `generate`.

The evaluations built on these (held-out NLL tables, multiple choice on held-out text, the lm-eval adapter) are in
eval/ (eval/likelihood.py, eval/cloze.py, eval/lm_eval_adapter.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from r2lm.generation import generate
from r2lm.generation.contexts import sidecars_active
from r2lm.layout import Layout, dual_stream

MODES = ("auto", "ar", "diffusion")


def eval_mode(model, mode: str = "auto") -> str:
    """How `model` is evaluated: "ar", "block" (causal / block_causal diffusion) or "single" (bidirectional)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    config = model.config
    if mode == "ar":
        if not config.kind.ar:
            raise ValueError(
                f"mode 'ar' needs a causal model with shift prediction, got attention={config.attention!r}, "
                f"prediction={config.prediction!r}"
            )
        return "ar"
    if config.mask_token_id is None:
        raise ValueError("diffusion evaluation needs config.mask_token_id (or use mode='ar' for an AR model)")
    return "block" if config.kind.exact_cache else "single"


@torch.no_grad()
def masked_token_ce(model, x0: torch.Tensor, masked: torch.Tensor, mode: str, block_size: int | None = None) -> torch.Tensor:
    """Cross-entropy [B, L] (float32) of each masked token of x0 when the `masked` positions are [MASK]; 0 elsewhere.

    `block` / `ar`: the dual-stream layout (r2lm.layout.dual_stream) with `block_size`; `single`: one noisy stream.
    Block 0 must not be masked under `block` / `ar` (it is context only)."""
    config = model.config
    mask_id = config.mask_token_id
    if mask_id is None:
        raise ValueError("masked NLL needs config.mask_token_id")
    b = block_size or config.block_size
    xt = torch.where(masked, torch.full_like(x0, mask_id), x0)
    ce = torch.zeros(x0.shape, dtype=torch.float32, device=x0.device)
    if not bool(masked.any()):
        return ce
    if mode == "single":
        logits = model(xt).logits
        if config.kind.shift:
            if bool(masked[:, 0].any()):
                raise ValueError("position 0 cannot be scored under shift prediction")
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        ce[masked] = F.cross_entropy(logits[masked].float(), x0[masked], reduction="none")
        return ce
    if bool(masked[:, :b].any()):
        raise ValueError("block 0 is context in the block layout: it cannot be masked")
    inputs, layout, target = dual_stream(x0, xt, b, config.prediction)
    window = torch.nonzero(target >= 0).flatten()
    tgt = target[window]
    keep = masked[:, tgt].any(0)  # only columns that predict a masked token of some row need logits
    window, tgt = window[keep], tgt[keep]
    logits = model(inputs, layout=layout, logits_to_keep=window).logits  # [B, W, V]
    sel = masked[:, tgt]
    rows = torch.arange(x0.shape[0], device=x0.device)[:, None].expand_as(sel)
    ce[rows[sel], tgt[None].expand_as(sel)[sel]] = F.cross_entropy(logits[sel].float(), x0[:, tgt][sel], reduction="none")
    return ce


@torch.no_grad()
def next_token_ce(model, x0: torch.Tensor) -> torch.Tensor:
    """Cross-entropy [B, L] of each token given every token to its left (position 0: 0), causal models only.

    Without open sidecars this is the plain causal forward; with them, every prediction is a one-column window
    (the dual-stream layout at block size 1), exactly what block-size-1 decoding computes."""
    config = model.config
    if not config.kind.ar:
        raise ValueError("next-token NLL needs a causal model with shift prediction")
    ce = torch.zeros(x0.shape, dtype=torch.float32, device=x0.device)
    if sidecars_active(model):
        inputs, layout, target = dual_stream(x0, x0, 1, config.prediction)
        window = torch.nonzero(target >= 0).flatten()
        logits = model(inputs, layout=layout, logits_to_keep=window).logits
        tgt = target[window]
    else:
        logits = model(x0).logits[:, :-1]
        tgt = torch.arange(1, x0.shape[1], device=x0.device)
    ce[:, tgt] = F.cross_entropy(logits.flatten(0, 1).float(), x0[:, tgt].flatten(), reduction="none").view(len(x0), -1)
    return ce


def stratified_masks(n: int, rows: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaDA's forward process for one answer (block) of n tokens over a batch of `rows` samples.

    The mask counts x are spread evenly over {1..n} from a random start (stratified), each row masks x tokens
    chosen uniformly. Returns (masked bool [rows, n], weight [rows] = n / x, the 1 / p of the ELBO)."""
    k = int(torch.randint(1, n + 1, (1,), generator=generator))
    x = torch.round(torch.linspace(float(k), k + (rows - 1) * (n / rows), rows)).long()
    x = (x - 1) % n + 1
    rank = torch.rand(rows, n, generator=generator).argsort(dim=1).argsort(dim=1)
    return rank < x[:, None], n / x.double()


def answer_blocks(n: int, mode: str, block_size: int) -> list[tuple[int, int]]:
    """[start, end) of each answer block: windows of block_size under `block`, the whole answer otherwise."""
    if mode != "block":
        return [(0, n)]
    return [(s, min(s + block_size, n)) for s in range(0, n, block_size)]


def block_answer_inputs(model, context: torch.Tensor, answer: torch.Tensor, masked: torch.Tensor, block_size: int,
                        cached_head: bool = False):
    """The answer after the context, as `generate` decodes it (docs/design.md 2.1), for a batch of mask patterns.

    context [P], answer [n], masked [rows, n]. Columns: the clean context (prefill: its head, all but its last token
    under `shift`, on the block grid where chunks matter), the clean answer blocks but the last (commits), then one
    window per answer block (shift: opened by the token before the block, positions shifted by one). Window j sees
    the context and the clean blocks < j. With `cached_head` the context columns are left out (they are in a KV
    cache, see `ContextCache`). Returns (input_ids [rows, T], layout, keep [n]: the column whose logits predict
    answer token i)."""
    kind = model.config.kind
    P, n = len(context), len(answer)
    head = kind.head(P)
    if head < 0:
        raise ValueError("a shift-prediction model needs at least one context token to open the first window")
    rows, device = masked.shape[0], context.device
    z = torch.cat([context, answer])
    ids, parts, base = [], [], 0
    if head:
        prompt = Layout.prompt(torch.ones(1, head, dtype=torch.long, device=device), kind)
        base = int(prompt.chunks.max()) + 1
        if not cached_head:
            ids.append(z[:head][None].expand(rows, -1))
            parts.append(prompt)
    blocks = answer_blocks(n, "block", block_size)
    ones = torch.ones(1, max(e - s for s, e in blocks), dtype=torch.long, device=device)
    for j, (s, e) in enumerate(blocks[:-1]):  # committed blocks
        ids.append(z[head + s : head + e][None].expand(rows, -1))
        parts.append(Layout.span(ones[:, : e - s], start=head + s, chunk=base + j))
    keep, offset = [], sum(part.length for part in parts)
    for j, (s, e) in enumerate(blocks):  # windows
        win = z[head + s : head + e][None].repeat(rows, 1)
        idx = torch.arange(head + s, head + e, device=device) - P  # answer index of each input (negative: context)
        own = (idx >= s) & (idx < e)
        win[masked[:, idx.clamp(min=0, max=n - 1)] & own[None]] = model.config.mask_token_id
        ids.append(win)
        parts.append(Layout.span(ones[:, : e - s], start=head + s, noisy=True, chunk=base + j))
        keep.append(torch.arange(offset, offset + e - s, device=device))
        offset += e - s
    return torch.cat(ids, dim=1), Layout.cat(*parts), torch.cat(keep)


class ContextCache:
    """The clean context of block models encoded once: a KVCache of its prefill part (all but the last token under
    `shift`) replicated over the rows of a Monte-Carlo batch, reused by every answer scored after that context.

    Exact: prefill is what the full layout computes for those columns (docs/design.md 8.2), and forwards that read the
    cache without committing leave it unchanged. Holds the caches of the latest context only (one per batch size)."""

    def __init__(self):
        self.key, self.caches = None, {}

    def get(self, model, context: torch.Tensor, rows: int, room: int):
        head = model.config.kind.head(len(context))
        if head <= 0:
            return None
        key = tuple(context.tolist())
        if key != self.key:
            self.key, self.caches = key, {}
        cache = self.caches.get(rows)
        if cache is None or cache.max_length < head + room:
            size = min(head + -(-room // 64) * 64, model.config.max_position_embeddings)
            if size < head + room:
                return None  # no room for the answer's columns: the full layout computes the same
            one = model.new_cache(1, head)
            model.prefill(context[None, :head], one)
            cache = model.new_cache(rows, size)
            cache.pad(head)
            for r in range(rows):
                cache.place_row(r, one)
            self.caches[rows] = cache
        return cache


@torch.no_grad()
def answer_logprobs(model, context: torch.Tensor, answer: torch.Tensor, masked: torch.Tensor, mode: str,
                    block_size: int, logits_only: bool = False, caches: ContextCache | None = None) -> torch.Tensor:
    """log p(answer_i | context, unmasked answer) [rows, n] for each row's mask pattern masked [rows, n] (mode
    `block` or `single`); with `logits_only`, the logits [rows, n, V] instead. Block models read the context from
    `caches` when given (the same numbers, computed once per context instead of once per row and batch)."""
    config = model.config
    n = len(answer)
    if mode == "block":
        cache = caches.get(model, context, len(masked), 2 * n) if caches is not None else None
        ids, layout, keep = block_answer_inputs(model, context, answer, masked, block_size, cached_head=cache is not None)
        logits = model(ids, layout=layout, cache=cache, logits_to_keep=keep).logits
    else:
        head = config.kind.head(len(context))  # the column predicting the answer's first token is the last of the head
        if head < 0:
            raise ValueError("a shift-prediction model needs at least one context token")
        noisy = torch.where(masked, torch.full_like(masked, config.mask_token_id, dtype=torch.long), answer[None])
        ids = torch.cat([context[None].expand(len(masked), -1), noisy], dim=1)
        logits = model(ids, logits_to_keep=torch.arange(head, head + n, device=ids.device)).logits
    if logits_only:
        return logits
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, answer[None, :, None].expand(len(masked), -1, 1))[..., 0]


@torch.no_grad()
def ar_logprobs(model, context: torch.Tensor, answer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact next-token log p(answer_i | context, answer_<i) [n] and whether each is the argmax [n]."""
    P, n = len(context), len(answer)
    if P < 1:
        raise ValueError("AR scoring needs at least one context token")
    z = torch.cat([context, answer])[None]
    logits = model(z, logits_to_keep=torch.arange(P - 1, P - 1 + n, device=z.device)).logits[0].float()
    return torch.log_softmax(logits, -1).gather(-1, answer[:, None])[:, 0], logits.argmax(-1) == answer


@torch.no_grad()
def answer_loglikelihood(
    model,
    context,
    answer,
    mode: str = "auto",
    mc_num: int = 128,
    batch_size: int = 32,
    block_size: int | None = None,
    seed: int = 0,
    generator: torch.Generator | None = None,
    caches: ContextCache | None = None,
) -> float:
    """log p(answer | context): exact for `ar`, LLaDA's Monte-Carlo ELBO estimate for diffusion variants.

    context, answer: token id lists or 1-D tensors. With the same seed, answers of equal length see the same
    mask patterns (common random numbers: less variance between the choices of one question). `caches` (block
    models): a ContextCache shared by the answers of one context."""
    mode = eval_mode(model, mode) if mode in MODES else mode
    device = model.device
    context = torch.as_tensor(context, dtype=torch.long, device=device)
    answer = torch.as_tensor(answer, dtype=torch.long, device=device)
    n = len(answer)
    if n == 0:
        return 0.0
    if mode == "ar":
        return float(ar_logprobs(model, context, answer)[0].sum())
    b = block_size or model.config.block_size
    blocks = answer_blocks(n, mode, b)
    gen = generator or torch.Generator().manual_seed(seed)
    total = mc_num if max(e - s for s, e in blocks) > 1 else 1  # one-token blocks: one sample is exact
    if total <= 0:
        raise ValueError(f"mc_num must be positive, got {mc_num}")
    estimate, done = 0.0, 0
    while done < total:
        rows = min(batch_size, total - done)
        masks, weights = [], []
        for s, e in blocks:
            m, w = stratified_masks(e - s, rows, gen)
            masks.append(m)
            weights.append(w[:, None].expand(-1, e - s))
        masked = torch.cat(masks, 1).to(device)
        weight = torch.cat(weights, 1).to(device)
        logp = answer_logprobs(model, context, answer, masked, mode, b, caches=caches).double()
        estimate += float((logp * weight * masked).sum())
        done += rows
    return estimate / total


@torch.no_grad()
def greedy_reproduces(model, context, answer, mode: str = "auto", block_size: int | None = None) -> bool:
    """Whether greedy decoding after `context` produces exactly `answer` (lm-eval's is_greedy).

    ar: the argmax at every position. Diffusion (LLaDA's suffix_greedy_prediction): `generate` with one token per
    step, the most confident first (LLaDA's schedule with as many steps as tokens), in blocks for block models;
    the answer is reproduced iff every step chose the answer's token (a token, once unmasked, never changes)."""
    mode = eval_mode(model, mode) if mode in MODES else mode
    device = model.device
    context = torch.as_tensor(context, dtype=torch.long, device=device)
    answer = torch.as_tensor(answer, dtype=torch.long, device=device)
    n = len(answer)
    if n == 0:
        return True
    if mode == "ar":
        return bool(ar_logprobs(model, context, answer)[1].all())
    b = (block_size or model.config.block_size) if mode == "block" else n
    blocks = -(-n // b)
    out = generate(model, context[None], max_new_tokens=n, block_size=b, steps=blocks * b, eos_token_id=[])
    return bool(torch.equal(out.sequences[0, len(context) :], answer))


def score_choices(
    model,
    context_ids,
    choices_ids,
    mode: str = "auto",
    mc_num: int = 128,
    batch_size: int = 32,
    block_size: int | None = None,
    seed: int = 0,
    use_cache: bool = True,
) -> list[float]:
    """log p(choice | context) for each choice (token id lists): exact for `ar`, the Monte-Carlo ELBO estimate for
    diffusion variants (every choice with the same seed). Block models encode the context once, in a KV cache
    shared by every choice (`use_cache=False`: recompute it in every forward; the same numbers)."""
    caches = ContextCache() if use_cache else None
    return [
        answer_loglikelihood(model, context_ids, c, mode=mode, mc_num=mc_num, batch_size=batch_size,
                             block_size=block_size, seed=seed, caches=caches)
        for c in choices_ids
    ]

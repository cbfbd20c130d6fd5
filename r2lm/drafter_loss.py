"""How a drafter (r2lm.drafter) learns: the drafting loss of a batch of text, DFlash's recipe (docs/notes/drafting.md),
with EAGLE's feature regression and self-distillation as options.

A batch is the text's context, written into the drafter's cache by KV injection as decoding writes it, and one
block per anchor read over it in one forward: `r2lm.layout.anchored_blocks` says who sees whom (each block the
text before its anchor and itself), so training reads exactly what decoding will hold before each block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from r2lm.diffusion import Loss
from r2lm.layout import anchored_blocks
from r2lm.plan import plan_of


@dataclass
class DraftLoss(Loss):
    tau: torch.Tensor | None = None  # committed tokens per verification forward, were these blocks verified
    first_right: torch.Tensor | None = None  # share of blocks whose first guess is right
    text_agreement: torch.Tensor | None = None  # distillation: share of scored text tokens that are the target's own

    def metrics(self) -> dict[str, torch.Tensor]:
        out = {"tau": self.tau, "first_right": self.first_right}
        return out if self.text_agreement is None else {**out, "text_agreement": self.text_agreement}


def drafting_loss(drafter, bound, captured, ids: torch.Tensor, valid: torch.Tensor, reply: torch.Tensor, blocks: int,
                  generator: torch.Generator | None = None, decay: float = 0.8, feature_weight: float = 0.0,
                  distill: bool = False, replay: float = 0.0, conditional: bool = False) -> DraftLoss:
    """The drafting loss of a batch of text for `drafter` (an r2lm.drafter.Drafter) reading `bound` (its target's
    embeddings and LM head rows, r2lm.drafter.Bound).

    ids [B, T] right-padded (valid [B, T]); captured: the target's outputs at feature_layers over them (the
    frozen target's forward, or a cache of it); reply [B, T]: the tokens drafts are asked for (the target's own
    reply, or an answer of a fixed text). Up to `blocks` anchors a per row, drawn at random among the positions
    whose block's first token is a reply token, each opening a block [x_a, [MASK] * (b-1)] that reads the context
    of x_0 .. x_{a-1} (what decoding holds before that block) and predicts x_{a+1} .. x_{a+b}: column j
    weighted by decay^j (an early token gates every later one's acceptance), scored where x_{a+j+1} is a reply
    token. The label of column j is the text's token x_{a+j+1} (cross-entropy over the draft vocabulary; a
    token outside it is not scored), or with `distill` the target's own next-token distribution after
    x_{a+j} (its logits over the draft vocabulary, from its last layer's output, which must be a feature
    layer): self-distillation, which on text the target did not write teaches what the target would say.

    With `feature_weight` > 0 (and the target's last layer among the feature layers), EAGLE's dense supervision
    too: column j's last hidden state, normalised, regresses onto the target's own last-layer state at x_{a+j}
    (normalised: what its LM head reads to predict x_{a+j+1}), squared error per dimension, weighted the same.

    With `conditional`, column j counts only in blocks whose guesses before it are all right (the gate is the
    drafter's own argmax, no gradient through it): verification reads a guess only then. A block's columns, drafted
    in one pass, otherwise each learn the token likeliest at their position whatever comes before it, and two
    likeliest tokens need not follow each other (docs/results.md measures how often the shipped drafter's second
    guess is right after a right first one); gated, column j learns what follows the guesses before it when they are
    right, which is what acceptance counts.

    In the "dflash" layout the opener's column guesses nothing and column j >= 1 guesses x_{a+j} (weighted
    decay^(j-1)): DFlash's [MASK] columns predict their own tokens.

    `tau` (logged) is what verification would commit per forward were these blocks verified: the leading
    columns whose guess is the target's greedy token (the text's, without `distill`; with it, in training, the
    target's likeliest token of the draft vocabulary) and the target's own next token.

    With `replay` > 0, Draft-OPD's replay of the drafter's own errors (docs/notes/drafting.md): decoding opens a
    block where verification refused the last one, so the states that limit acceptance are the positions just
    after a wrong guess, which uniform anchors visit only as often as any other. A first pass (no gradient) drafts
    at the random anchors and verifies each block as above; then that share of each row's blocks opens where
    decoding would open the next one (a + the tokens the block commits: its right leading guesses and the target's
    own token), the rest at the random anchors as before. `tau` and `first_right` are then the first pass's (the
    random anchors': comparable with a run without replay)."""
    config = drafter.config
    b, (batch, length) = config.block_size, ids.shape
    device = ids.device
    lengths = valid.sum(1)
    reply = reply.bool() & valid.bool()
    top_layer = config.target_num_hidden_layers - 1
    top = captured[config.feature_layers.index(top_layer)] if top_layer in config.feature_layers else None
    if distill and top is None:
        raise ValueError(f"distillation reads the target's logits from its last layer ({top_layer}): add it to "
                         "feature_layers")
    count = min(blocks, length)
    context = drafter.new_context(batch, length + count * b)
    c = drafter.append(context, captured, valid)
    offsets = torch.arange(b, device=device)
    skip = b - config.draft_length  # leading columns that guess nothing (DFlash's opener column)
    index = drafter.draft_index()
    evaluating = not torch.is_grad_enabled()  # (replay's first pass runs without gradients in training too)

    def read(score: torch.Tensor):
        """The blocks at each row's `count` best-scored positions (score < 0: never an anchor), read and judged."""
        best = score.topk(count, dim=1)
        anchors, used = best.indices, best.values >= 0  # [B, n]; rows with fewer allowed positions use fewer
        held, layout = anchored_blocks(valid, anchors, b)  # the text the cache holds, and the blocks read over it
        at = layout.positions  # [B, n * b]: each block column's position
        inside = at.clamp(max=length - 1)
        first = (offsets == 0).expand(batch, count, b).flatten(1)
        dtype = bound.rows.dtype
        inputs = torch.where(first[..., None], bound.embed(ids.gather(1, inside)).detach().to(dtype),
                             drafter.mask_embedding.to(dtype))  # the target's embeddings: frozen
        if drafter.direct is not None:
            before = (anchors - 1).repeat_interleave(b, 1)  # the last context token of each block (none at anchor 0)
            last = c.gather(1, before.clamp(min=0)[..., None].expand(-1, -1, c.shape[-1])) * (before >= 0)[..., None]
            inputs = inputs + drafter.direct(last)
        plan = plan_of(drafter.stack, drafter.rotary_emb, layout, context.kv, like=bound.rows, context=held)
        h = drafter.hidden(inputs, plan, context.kv, norm=False)
        logits = drafter.logits(drafter.norm(h)).float()  # [B, n * b, draft vocab]
        target_at = at + 1 - skip  # the token each column guesses
        source = (target_at - 1).clamp(0, length - 1)  # the position whose next token that is
        scored = (target_at < lengths[:, None]) & reply.gather(1, target_at.clamp(max=length - 1))
        scored &= used.repeat_interleave(b, 1) & (offsets >= skip).repeat(count)[None, :]
        soft = None
        if distill:  # the target's own next token after x_{a+j}, and its distribution over the draft vocabulary
            state = top.gather(1, source[..., None].expand(-1, -1, top.shape[-1]))
            rows = bound.logits(state, bound.rows)
            soft = rows.softmax(-1)
            # its greedy token: over the whole vocabulary when evaluating; in training (where the whole LM head
            # would cost six times the draft vocabulary's) its likeliest draft-vocabulary token, almost always the same
            greedy = (bound.logits(state, bound.head).argmax(-1) if evaluating
                      else drafter.draft_ids[rows.argmax(-1)])
        else:
            greedy = ids.gather(1, target_at.clamp(max=length - 1))
            scored &= index[greedy] >= 0
        right = (logits.argmax(-1) == index[greedy]) & scored
        # what verification would commit per forward: the right leading guesses and AR's own next token, at most b
        # (a block whose text ends early counts the guesses it has)
        leading = right.view(batch, count, b)[..., skip:].long().cumprod(-1).sum(-1)
        blocks_used = used.sum().clamp(min=1)
        tau = ((leading + 1).clamp(max=b) * used).sum() / blocks_used
        first_right = (right.view(batch, count, b)[..., skip] & used).sum().float() / blocks_used
        return Blocks(anchors, used, h, logits, target_at, source, scored, soft, greedy, right, leading, tau,
                      first_right)

    allowed = torch.zeros_like(reply)
    allowed[:, :-1] = reply[:, 1:]  # the block's first guess is a reply token
    score = torch.rand(batch, length, generator=generator, device=device).masked_fill(~allowed, -1.0)
    measured = None
    if replay > 0:
        with torch.no_grad():
            measured = read(score)
        score = replayed(score, measured, allowed, b, round(replay * count))
    out = read(score)
    measured = out if measured is None else measured
    if distill:
        ce = -(out.soft * out.logits.log_softmax(-1)).sum(-1)
    else:
        ce = F.cross_entropy(out.logits.flatten(0, 1), index[out.greedy].clamp(min=0).flatten(),
                             reduction="none").view(batch, -1)
    weight = (decay ** (offsets - skip).clamp(min=0).float()).repeat(count)[None, :] * out.scored
    if conditional:  # column j where the guesses before it are right: 1 for the first guess, then their running product
        right = out.right.view(batch, count, b).long()
        before = torch.cat([torch.ones_like(right[..., : skip + 1]), right[..., skip:-1].cumprod(-1)], -1)
        weight = weight * before.flatten(1)
    scored_count = int(out.scored.sum())
    loss = (ce * weight).sum() / weight.sum().clamp(min=1e-6)
    if feature_weight > 0 and top is not None:
        state = top.gather(1, out.source[..., None].expand(-1, -1, top.shape[-1])).float()
        error = (_unit(out.h.float()) - _unit(state)).pow(2).mean(-1)
        loss = loss + feature_weight * (error * weight).sum() / weight.sum().clamp(min=1e-6)
    metrics = dict(tau=measured.tau.detach(), first_right=measured.first_right)
    if distill:  # how often the text's next token is the target's own (1 on the target's own replies)
        text = ids.gather(1, out.target_at.clamp(max=length - 1))
        metrics["text_agreement"] = ((text == out.greedy) & out.scored).sum().float() / out.scored.sum().clamp(min=1)
    return DraftLoss(loss=loss, tokens=scored_count, masked=scored_count, **metrics)


@dataclass
class Blocks:
    """Blocks read at a set of anchors, and judged as verification would judge them."""

    anchors: torch.Tensor  # [B, n] each block's anchor a (its opener x_a)
    used: torch.Tensor  # [B, n] whether the block is one (a row with fewer allowed positions has fewer)
    h: torch.Tensor  # [B, n * b, hidden] the block columns' last hidden states (before the final norm)
    logits: torch.Tensor  # [B, n * b, draft vocabulary]
    target_at: torch.Tensor  # [B, n * b] the position of the token each column guesses
    source: torch.Tensor  # [B, n * b] the position whose next token that is
    scored: torch.Tensor  # [B, n * b] the columns the loss scores
    soft: torch.Tensor | None  # distillation: the target's distribution over the draft vocabulary at each column
    greedy: torch.Tensor  # [B, n * b] the target's greedy token each column is judged against
    right: torch.Tensor  # [B, n * b] the scored columns whose guess is that token
    leading: torch.Tensor  # [B, n] each block's right leading guesses
    tau: torch.Tensor  # tokens a verification of these blocks would commit, on average
    first_right: torch.Tensor  # share of blocks whose first guess is right


def replayed(score: torch.Tensor, measured: Blocks, allowed: torch.Tensor, b: int, k: int) -> torch.Tensor:
    """`score` with up to k positions per row raised above every random one: where decoding would open the block
    after each measured one (its anchor + the tokens it commits, at most b), those that may open a block, in the
    measured blocks' (random) order."""
    length = score.shape[1]
    after = measured.anchors + (measured.leading + 1).clamp(max=b)
    fits = measured.used & (after < length)
    fits &= allowed.gather(1, after.clamp(max=length - 1))
    take = fits & (fits.long().cumsum(1) <= k)
    raised = score.clone()
    rows = torch.arange(score.shape[0], device=score.device)[:, None].expand_as(after)
    raised[rows[take], after[take]] = 1.0 + score[rows[take], after[take]]  # above [0, 1): chosen first
    return raised


def _unit(h: torch.Tensor) -> torch.Tensor:
    """h scaled to unit root-mean-square per vector (RMSNorm without its weight)."""
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)

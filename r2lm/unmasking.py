"""The unmasking rules of the decode loop, in one table `RULES` (name -> `Rule`: its value's check, its per-block
plan, its selection, its command-line type and help). Each takes at least one token per row that still has a
[MASK]:

    threshold  every masked position with confidence >= threshold (Fast-dLLM); the default, at 0.9
    factor     the n most confident, for the largest n whose n-th confidence >= 1 - factor / (n + 1) (Fast-dLLM)
    steps      LLaDA's schedule: a block's steps share its masked tokens evenly, the first (m mod s) steps taking
               one more (`schedule`), the most confident first

Everything that names rules reads the table: generate()'s options and their one-rule check
(r2lm.generation.options, r2lm.generation.sampling.Unmasking), `select` and the decode loop
(r2lm.generation.decoding), the keys of generation_config.json and its default rule (r2lm.generation_config), and
r2lm-generate's flags (r2lm.cli.generate). So a new rule is its functions and its entry here. The table sits
outside r2lm.generation because r2lm.generation_config reads it, and the checkpoint writers, which read that, reach
nothing of the generator (tests/project/test_structure.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from r2lm.checks import positive_int, real

DEFAULT_RULE = ("threshold", 0.9)  # the rule, and its value, where no option names one


def _as_is(value, masked: torch.Tensor, num_blocks: int):
    return value


@dataclass(frozen=True)
class Rule:
    """An unmasking rule, given one value (generate(name=value), the key `name` of generation_config.json,
    r2lm-generate's --name):

        check(value, block_size, max_new_tokens) -> value   the value, checked (a ValueError naming the option)
        plan(value, masked [B, L], num_blocks) -> plan      once per block, from its masked positions (default: the
                                                            value itself)
        take(scores [B, L], plan, step) -> bool [B, L]      at the block's step `step` (0, 1, ..): the positions to
                                                            unmask, at least the surest of each row; scores are the
                                                            confidences, -inf where not masked

    `parse` reads the value on the command line (float, int); `help` says what it does there."""

    check: Callable
    take: Callable
    parse: Callable[[str], object]
    help: str
    plan: Callable = _as_is


def _ranking(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's scores, the surest first; each position's rank among them: 0 for the surest, ties leftmost
    first)."""
    ranked, order = scores.sort(dim=-1, descending=True, stable=True)
    return ranked, order.argsort(dim=-1)


def _check_threshold(threshold, block_size: int, max_new_tokens: int):
    if not (real(threshold) and 0 < threshold <= 1):
        raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
    return threshold


def _by_threshold(scores: torch.Tensor, threshold, step: int) -> torch.Tensor:
    """The surest position of each row always goes, and every other that passes."""
    best = torch.arange(scores.shape[-1], device=scores.device) == scores.argmax(-1, keepdim=True)
    return best | (scores >= threshold)


def _check_factor(factor, block_size: int, max_new_tokens: int):
    if not (real(factor) and factor > 0):
        raise ValueError(f"factor must be a positive number, got {factor!r}")
    return factor


def _by_factor(scores: torch.Tensor, factor, step: int) -> torch.Tensor:
    ranked, rank = _ranking(scores)
    n = torch.arange(1, scores.shape[-1] + 1, device=scores.device)
    passing = (ranked >= 1 - factor / (n + 1)).long().cumprod(-1).sum(-1, keepdim=True)
    return rank < passing.clamp(min=1)


def _check_steps(steps, block_size: int, max_new_tokens: int) -> int:
    steps = positive_int("steps", steps)
    num_blocks = -(-max_new_tokens // block_size)
    if steps % num_blocks:
        raise ValueError(f"steps ({steps}) must be a multiple of the number of blocks ({num_blocks}: "
                         f"max_new_tokens {max_new_tokens} in blocks of {block_size}), as in LLaDA")
    return steps


def schedule(masked: torch.Tensor, steps: int) -> torch.Tensor:
    """LLaDA's get_num_transfer_tokens: tokens to unmask at each of `steps` steps, [B, steps], from each row's
    masked positions masked [B, L]: m // steps each, and one more in the first m % steps steps."""
    m = masked.sum(-1, keepdim=True)
    first = torch.arange(steps, device=masked.device) < (m % steps)
    return m // steps + first.long()


def _plan_steps(steps: int, masked: torch.Tensor, num_blocks: int) -> torch.Tensor:
    return schedule(masked, steps // num_blocks)  # the call's steps, shared evenly by its blocks


def _by_steps(scores: torch.Tensor, counts: torch.Tensor, step: int) -> torch.Tensor:
    return _ranking(scores)[1] < counts[:, step, None]


RULES: dict[str, Rule] = {
    "threshold": Rule(_check_threshold, _by_threshold, float,
                      "unmask every position at least this confident (Fast-dLLM)"),
    "factor": Rule(_check_factor, _by_factor, float, "unmask the n most confident, n chosen by this factor (Fast-dLLM)"),
    "steps": Rule(_check_steps, _by_steps, int, "denoising steps in all, a multiple of the number of blocks (LLaDA)",
                  plan=_plan_steps),
}


def select(conf: torch.Tensor, masked: torch.Tensor, plan, rule: str = DEFAULT_RULE[0], step: int = 0) -> torch.Tensor:
    """Which masked positions to unmask: bool [B, L], by `rule` (a name in RULES) with its `plan` for the block (the
    rule's value, unless the rule plans: Unmasking.plan) at the block's step `step`."""
    scores = conf.masked_fill(~masked, float("-inf"))
    return RULES[rule].take(scores, plan, step) & masked

"""The unmasking rule table (r2lm.unmasking.RULES) is the one place rules are listed: the options, `select`,
the decode loop, the checkpoint's generation_config keys and r2lm-generate's flags all read it, so a rule
registered in it (here a toy one, for the test only) decodes through generate() and gets its flag."""

import pytest
import torch
from transformers import GenerationConfig

from r2lm import generate
from r2lm.checks import positive_int
from r2lm.cli.generate import build_parser, decoding_options
from r2lm.unmasking import RULES, Rule, select
from tests.helpers.decoding import left_padded
from tests.helpers.models import peaky


def _by_count(scores, counts, step):
    """The counts[b] most confident masked positions of row b at every step."""
    rank = scores.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    return rank < counts[:, None]


# unmask the `per_step` most confident positions at each step; its plan (one count per row) is made per block
PER_STEP = Rule(check=lambda value, block_size, max_new_tokens: positive_int("per_step", value), take=_by_count,
                parse=int, help="unmask this many of the most confident positions per step",
                plan=lambda value, masked, num_blocks: torch.full((masked.shape[0],), value, device=masked.device))


@pytest.fixture
def per_step(monkeypatch):
    """The toy rule registered in the table for one test (monkeypatch restores the table after it)."""
    monkeypatch.setitem(RULES, "per_step", PER_STEP)


def flags_of_rules(parser) -> list[str]:
    """The dests of r2lm-generate's mutually exclusive group of rule flags."""
    groups = [g for g in parser._mutually_exclusive_groups if {a.dest for a in g._group_actions} & {"threshold"}]
    assert len(groups) == 1
    return [a.dest for a in groups[0]._group_actions]


def test_the_cli_offers_one_flag_per_rule_of_the_table(per_step):
    parser = build_parser()
    assert flags_of_rules(parser) == list(RULES) == ["threshold", "factor", "steps", "per_step"]
    args = parser.parse_args(["ckpt", "--prompt", "x", "--per-step", "2"])
    assert decoding_options(args, torch.device("cpu")) == {"per_step": 2}
    with pytest.raises(SystemExit):  # one rule at a time
        parser.parse_args(["ckpt", "--prompt", "x", "--per-step", "2", "--threshold", "0.5"])


def test_select_applies_a_rule_it_finds_in_the_table(per_step):
    g = torch.Generator().manual_seed(0)
    conf, masked = torch.rand(8, 16, generator=g), torch.rand(8, 16, generator=g) < 0.6
    counts = torch.full((8,), 3)
    take = select(conf, masked, counts, "per_step")
    assert torch.equal(take.sum(1), masked.sum(1).clamp(max=3))
    assert not (take & ~masked).any()
    # the surest masked positions: none left out is more confident than one taken
    left = conf.masked_fill(~masked | take, -1).amax(1)
    assert (conf.masked_fill(~take, 2).amin(1)[take.any(1)] >= left[take.any(1)]).all()


def test_a_rule_registered_in_the_table_decodes_through_generate(per_step):
    """per_step=k takes the k surest positions per step: what LLaDA's schedule does with n / k steps for n tokens
    (blocks of 8, k dividing 8), token for token. Its checks, the one-rule check and generation_config.json's keys
    come from the table too."""
    model = peaky(sidecar_layers=[1, 3])
    ids, mask = left_padded(pads=(0, 3))
    for k in (1, 2):
        toy = generate(model, ids, mask, max_new_tokens=24, block_size=8, per_step=k, eos_token_id=[])
        llada = generate(model, ids, mask, max_new_tokens=24, block_size=8, steps=24 // k, eos_token_id=[])
        assert torch.equal(toy.sequences, llada.sequences)
        assert toy.steps == llada.steps == 24 // k
    stored = GenerationConfig(per_step=2, block_size=8, max_new_tokens=24)
    assert torch.equal(generate(model, ids, mask, generation_config=stored, eos_token_id=[]).sequences,
                       generate(model, ids, mask, max_new_tokens=24, block_size=8, steps=12, eos_token_id=[]).sequences)
    with pytest.raises(ValueError, match="per_step must be a positive integer"):
        generate(model, ids, mask, max_new_tokens=8, per_step=0)
    with pytest.raises(ValueError, match="at most one unmasking rule"):
        generate(model, ids, mask, max_new_tokens=8, per_step=1, threshold=0.5)


def test_a_rule_outside_the_table_is_an_unknown_option():
    ids, mask = left_padded(pads=(0, 3))
    with pytest.raises(ValueError, match="unknown generate"):
        generate(peaky(sidecar_layers=[1, 3]), ids, mask, max_new_tokens=8, per_step=1)

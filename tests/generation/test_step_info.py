"""What a step callback sees (StepInfo) is one type in both decode loops: `start` is each row's first generated
position of the step's columns, a [B] long tensor (decode: the block's, shared; verify=True: each row's own, rows
committing their own lengths), and ParallelismMeter counts per row from it in both."""

import pytest
import torch

from r2lm import generate
from r2lm.generation import ParallelismMeter
from tests.helpers.decoding import left_padded
from tests.helpers.models import MASK_ID, peaky, tiny_r2lm

DECODE = dict(max_new_tokens=20, block_size=8, threshold=0.6)
VERIFY = dict(max_new_tokens=24, block_size=4, verify=True, verify_draft="lookup", verify_policy="longest")


def prompts():
    """Two random prompts: under lookup drafts their rows accept at different rates."""
    return torch.stack([torch.randperm(MASK_ID - 1, generator=torch.Generator().manual_seed(s))[:8] for s in (0, 1)])


@pytest.mark.parametrize("options", [DECODE, VERIFY], ids=["decode", "verify"])
def test_a_step_callback_sees_each_rows_start_as_a_long_tensor(options):
    model = tiny_r2lm(open_gates=True, sidecar_layers=[1, 3])
    ids = prompts()
    seen = []
    out = generate(model, ids, eos_token_id=[], step_callback=seen.append, **options)
    assert len(seen) == out.steps
    for info in seen:
        assert isinstance(info.start, torch.Tensor) and info.start.dtype == torch.long
        assert info.start.shape == (2,) and info.start.device == ids.device
    starts = torch.stack([info.start for info in seen])
    if options.get("verify"):  # each row's start is what it has committed: rows move at their own pace
        assert (starts[0] == 0).all() and (starts[1:] >= starts[:-1]).all()
        assert (starts[:, 0] != starts[:, 1]).any()  # the case under test
    else:  # the block's start, every row's
        assert (starts == starts[:, :1]).all() and set(starts[:, 0].tolist()) == {0, 8, 16}


def counted(records, generated):
    """ParallelismMeter's counts, by brute force: (row, step) pairs with a masked position, accepted positions of
    those, and positions whose proposal is the token the row finally has there."""
    pairs = accepted = oracle = 0
    for start, masked, proposals, taken in records:
        for row in range(masked.shape[0]):
            inside = [j for j in range(masked.shape[1]) if start[row] + j < generated.shape[1] and masked[row, j]]
            if not inside:
                continue
            pairs += 1
            accepted += sum(bool(taken[row, j]) for j in inside)
            oracle += sum(int(proposals[row, j]) == int(generated[row, start[row] + j]) for j in inside)
    return pairs, accepted, oracle


@pytest.mark.parametrize("options", [DECODE, VERIFY], ids=["decode", "verify"])
def test_the_parallelism_meter_counts_each_row_from_its_own_start(options):
    model = peaky(sidecar_layers=[1, 3]) if not options.get("verify") else tiny_r2lm(open_gates=True,
                                                                                      sidecar_layers=[1, 3])
    ids = prompts() if options.get("verify") else left_padded(pads=(0, 3))[0]
    meter = ParallelismMeter()
    out = generate(model, ids, eos_token_id=[], step_callback=meter, **options)
    generated = out.sequences[:, ids.shape[1]:]
    summary = meter.summary(generated)
    pairs, accepted, oracle = counted(meter.records, generated)
    assert summary["row_steps"] == pairs == out.row_steps and summary["steps"] == out.steps
    assert summary["accepted_tpf"] == pytest.approx(accepted / pairs)
    assert summary["oracle_tpf"] == pytest.approx(oracle / pairs)
    assert oracle >= accepted > 0  # an accepted proposal is the committed token
    if options.get("verify"):
        # each live step commits its accepted draft tokens and AR's next one (none past a whole draft)
        assert accepted < out.new_tokens <= accepted + out.row_steps
    else:
        assert accepted == out.new_tokens

"""The certainty-forcing objective (r2lm.diffusion.certainty_loss, after dParallel): its entropy term acts only
where the argmax is already the target, its two views partition every block, it trains, and its config checks."""

import math

import pytest
import torch

from r2lm.diffusion import (
    block_noise,
    certainty_loss,
    check_objective,
    compute_loss,
    masked_window_logits,
    noised_dual_stream,
    tempered_entropy,
)
from tests.helpers.models import make_model_dir, tiny_r2lm
from tests.helpers.training import write_corpus
from train.config import load_config

SEP = 3  # a separator id in the batches below


def batch(seed=0, rows=3, length=40, vocab=90):
    x0 = torch.randint(4, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))
    x0[0, 13] = x0[1, 30] = SEP  # separators inside noised blocks: context, never masked
    return x0


def entropy(probs):
    return -sum(p * math.log(p) for p in probs if p > 0)


def test_tempered_entropy_is_the_entropy_at_right_rows_only():
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 1.0], [1.0, 0.5, -1.0], [0.2, 0.1, 0.4]], requires_grad=True)
    target = torch.tensor([0, 2, 0, 1])  # argmax 0 (right), 1 (wrong), 0 (right), 2 (wrong)
    values, right = tempered_entropy(logits, target, temperature=0.5)
    assert right.tolist() == [True, False, True, False]

    def softmax(row, tau):
        e = [math.exp(v / tau) for v in row]
        return [x / sum(e) for x in e]

    expected = [entropy(softmax([2.0, 0.0, 0.0], 0.5)), entropy(softmax([1.0, 0.5, -1.0], 0.5))]
    assert values.tolist() == pytest.approx(expected, rel=1e-6)
    values.sum().backward()
    assert torch.equal(logits.grad[1], torch.zeros(3)) and torch.equal(logits.grad[3], torch.zeros(3))  # wrong: none
    assert (logits.grad[0].abs() > 0).all() and (logits.grad[2].abs() > 0).all()  # right: sharpened
    assert logits.grad[0, 0] < 0  # lowering the entropy means raising the winning logit
    # the temperature is tau: at tau = 1 it is the plain softmax entropy
    assert tempered_entropy(logits, target, 1.0)[0][0].item() == pytest.approx(entropy(softmax([2.0, 0.0, 0.0], 1.0)))


@pytest.mark.parametrize("prediction", ["shift", "inplace"])
def test_complementary_views_partition_every_block(prediction):
    model = tiny_r2lm(prediction=prediction)
    b = model.config.block_size
    x0 = batch()
    eligible, [(a, _), (c, _)] = block_noise(x0, model.config, separator_id=SEP,
                                             generator=torch.Generator().manual_seed(1), complementary=True)
    assert not (a & c).any()  # disjoint
    assert torch.equal(a | c, eligible)  # together: every token that can be masked
    assert not eligible[:, :b].any() and not eligible[x0 == SEP].any()  # block 0 is context; separators never masked
    for k in range(1, x0.shape[1] // b):
        block = slice(k * b, (k + 1) * b)
        assert torch.equal((a | c)[:, block], x0[:, block] != SEP)  # each block: all of its tokens, once
    out = certainty_loss(model, x0, separator_id=SEP, generator=torch.Generator().manual_seed(1))
    assert out.masked == out.tokens == int(eligible.sum())  # both views scored: every eligible token, once


def trained_model(steps=40):
    """A tiny R2LM trained with the certainty loss on one periodic batch (to about 3/4 of its masked tokens right),
    and the loss of every step."""
    model = tiny_r2lm(seed=0, open_gates=True, sidecar_layers=[1, 3]).train()
    x0 = (torch.arange(32) % 12 + 4).repeat(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    history = []
    for step in range(steps):
        out = certainty_loss(model, x0, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        history.append(out)
    return model, x0, history


@pytest.fixture(scope="module")
def trained():
    return trained_model()


def test_loss_decreases_and_right_fraction_grows(trained):
    _, _, history = trained
    losses = [h.loss.item() for h in history]
    assert all(math.isfinite(x) for x in losses)
    ce = [h.ce.item() for h in history]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    assert sum(ce[-5:]) / 5 < 0.7 * sum(ce[:5]) / 5, ce
    assert history[0].right_fraction < 0.05 and history[-1].right_fraction > 0.5, [h.right_fraction for h in history]
    assert all(h.loss.item() == pytest.approx(h.ce.item() + 2.0 * h.entropy.item(), rel=1e-5) for h in history)


def test_entropy_gradient_reaches_only_masked_positions_already_right(trained):
    """Through the model: the entropy term's gradient on the logits (loss at weight 1 minus loss at weight 0, same
    noise) is exactly zero at every window column but the masked ones whose argmax equals their target."""
    model, x0, _ = trained
    model.eval()
    config = model.config
    captured = []

    def keep(module, inputs, out):  # the logits of each forward, with their gradient kept
        out.retain_grad()
        captured.append(out)

    hook = model.lm_head.register_forward_hook(keep)
    grads = []
    for weight in (0.0, 1.0):
        captured.clear()
        model.zero_grad()
        certainty_loss(model, x0, generator=torch.Generator().manual_seed(99), entropy_weight=weight).loss.backward()
        grads.append([out.grad for out in captured])
    hook.remove()
    _, copies = block_noise(x0, config, generator=torch.Generator().manual_seed(99), complementary=True)
    kinds = set()
    for view, (masked, _) in enumerate(copies):
        _, _, target = noised_dual_stream(x0, masked, config)
        tgt = target[target >= 0]
        logits = captured[view].detach()  # the second pass's logits of this view (the same as the first's)
        right = masked[:, tgt] & (logits.argmax(-1) == x0[:, tgt])  # [B, W]
        diff = grads[1][view] - grads[0][view]
        assert torch.equal(diff[~right], torch.zeros_like(diff[~right]))
        assert (diff[right].abs().sum(-1) > 0).all()
        kinds |= {bool(right.any()), bool((masked[:, tgt] & ~right).any())}
    assert kinds == {True}  # both kinds occurred: masked-and-right, and masked-but-wrong positions


def test_loss_parts_and_dispatch():
    model = tiny_r2lm(seed=2, open_gates=True, sidecar_layers=[1])
    x0 = batch(seed=3)
    noise = dict(separator_id=SEP, config=model.config)
    plain = certainty_loss(model, x0, generator=torch.Generator().manual_seed(5), entropy_weight=0.0, **noise)
    forced = compute_loss("certainty", model, x0, generator=torch.Generator().manual_seed(5), entropy_weight=2.0,
                          temperature=0.5, **noise)
    assert plain.loss.item() == pytest.approx(plain.ce.item()) and plain.ce.item() == pytest.approx(forced.ce.item())
    assert forced.loss.item() == pytest.approx(forced.ce.item() + 2.0 * forced.entropy.item())
    assert set(forced.metrics()) == {"ce", "entropy", "right_fraction"} and 0 <= forced.right_fraction <= 1
    # the CE is the plain mean over the masked tokens of both views
    total, count = 0.0, 0
    _, copies = block_noise(x0, model.config, separator_id=SEP, generator=torch.Generator().manual_seed(5),
                            complementary=True)
    with torch.no_grad():
        for masked, _ in copies:
            logits, where = masked_window_logits(model, x0, masked, model.config)
            total += torch.nn.functional.cross_entropy(logits, x0[where], reduction="sum").item()
            count += len(logits)
    assert forced.ce.item() == pytest.approx(total / count, rel=1e-6)
    with pytest.raises(ValueError, match="temperature > 0"):
        certainty_loss(model, x0, temperature=0.0)


def test_objective_fits_block_models_only():
    for attention in ("causal", "block_causal"):
        check_objective("certainty", tiny_r2lm(attention=attention).config)
    with pytest.raises(ValueError, match=r"objective 'certainty' does not fit a 'bidirectional' model \(it needs "
                                         r"attention in \('causal', 'block_causal'\)\)"):
        check_objective("certainty", tiny_r2lm(attention="bidirectional", prediction="inplace").config)
    with pytest.raises(ValueError, match="objective 'certainty' needs config.mask_token_id"):
        check_objective("certainty", tiny_r2lm(mask_token_id=None).config)


REQUIRED = ["model=m", "output_dir=o", "data.train=t.jsonl"]


def test_config_keys():
    cfg = load_config(None, REQUIRED + ["objective=certainty", "certainty.entropy_weight=1", "certainty.temperature=0.25"])
    assert cfg.objective == "certainty" and cfg.certainty.entropy_weight == 1.0 and cfg.certainty.temperature == 0.25
    defaults = load_config(None, REQUIRED + ["objective=certainty"]).certainty
    assert (defaults.entropy_weight, defaults.temperature) == (2.0, 0.5)  # dParallel's
    with pytest.raises(ValueError, match="certainty.temperature must be positive"):
        load_config(None, REQUIRED + ["objective=certainty", "certainty.temperature=0"])
    with pytest.raises(ValueError, match="certainty.entropy_weight >= 0"):
        load_config(None, REQUIRED + ["objective=certainty", "certainty.entropy_weight=-1"])
    with pytest.raises(ValueError, match=r"the certainty.\* keys set the certainty objective, but objective is 'block'"):
        load_config(None, REQUIRED + ["certainty.temperature=0.3"])


def test_training_config_validates_against_the_model(tmp_path):

    from train.checks import validate

    train, _ = write_corpus(tmp_path / "corpus", n_train=20, n_heldout=2)
    items = [f"data.train={train}", f"output_dir={tmp_path / 'out'}", "objective=certainty", "seq_len=64"]
    plan = validate(load_config(None, items + [f"model={make_model_dir(tmp_path / 'causal')}"]))
    assert plan.model_config.attention == "causal"
    bidirectional = make_model_dir(tmp_path / "bidi", attention="bidirectional", prediction="inplace", sidecar_layers=[])
    with pytest.raises(ValueError, match="objective 'certainty' does not fit a 'bidirectional' model"):
        validate(load_config(None, items + [f"model={bidirectional}"]))
    with pytest.raises(ValueError, match="seq_len 8 must exceed the block size 8"):
        validate(load_config(None, items + [f"model={tmp_path / 'causal'}", "seq_len=8"]))
    assert not (tmp_path / "out").exists()
